"""Frozen-LM activations computed once per distinct input and reused.

The LM never changes, so the residual stream of an input at a layer is the same at every
training step, every validation and for every intervention trained at that layer. Inputs are
keyed by their unpadded token ids, so a sentence that is the base of one pair and the source of
another (swap-doubling makes every sentence both) is computed once.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_interventions.sites import read_layers

Key = tuple[int, ...]


def input_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[Key], list[int]]:
    """Unpadded token ids of each row, and the index of each row's first real token."""
    keys, starts = [], []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        real = [i for i, m in enumerate(mask) if m]
        keys.append(tuple(ids[i] for i in real))
        starts.append(real[0])
    return keys, starts


class ActivationCache:
    """Residual-stream states at `layers` for every input seen, (n_layers, seq, d) per input."""

    def __init__(self, model: nn.Module, layers: list[int]):
        self.model, self.layers = model, sorted(set(layers))
        self._states: dict[Key, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._states)

    def states(
        self,
        layer: int,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keys: tuple[list[Key], list[int]] | None = None,
    ) -> torch.Tensor:
        """The residual stream at `layer` for a padded batch, (batch, seq, d), padding as zeros.

        `keys` is `input_keys(input_ids, attention_mask)` computed on the host (the CausalGym
        collate function does), which spares a device-to-host copy per step on a GPU."""
        keys, starts = keys if keys is not None else input_keys(input_ids, attention_mask)
        missing = [i for i, key in enumerate(keys) if key not in self._states]
        if missing:
            rows = torch.tensor(missing, device=input_ids.device)
            self._compute(input_ids[rows], attention_mask[rows], [keys[i] for i in missing], [starts[i] for i in missing])
        index = self.layers.index(layer)
        first = self._states[keys[0]]
        out = first.new_zeros(input_ids.shape + first.shape[-1:])
        for i, key in enumerate(keys):
            out[i, starts[i] : starts[i] + len(key)] = self._states[key][index]
        return out

    def _compute(self, input_ids, attention_mask, keys: list[Key], starts: list[int]) -> None:
        found = read_layers(self.model, self.layers, input_ids, attention_mask)
        for j, (key, start) in enumerate(zip(keys, starts)):
            self._states[key] = torch.stack([found[l][j, start : start + len(key)] for l in self.layers])

    @torch.no_grad()
    def fill(self, batches, sides: tuple[str, ...] = ("base", "source"), batch_size: int = 64) -> int:
        """Compute every input of `batches` not cached yet, before they are needed: deduplicated,
        sorted by length and run `batch_size` at a time, so the frozen forwards are few and full
        instead of one small one per training step. Returns how many inputs were computed."""
        todo: dict[Key, None] = {}
        for batch in batches:
            for side in sides:
                if f"{side}_input_ids" not in batch:
                    continue
                keys = batch.get(f"{side}_keys") or input_keys(batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"])
                todo.update((key, None) for key in keys[0] if key not in self._states)
        ordered = sorted(todo, key=len)
        device = self.model.device
        for i in range(0, len(ordered), batch_size):
            chunk = ordered[i : i + batch_size]
            width = len(chunk[-1])
            input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, key in enumerate(chunk):  # right padding: positions ignore it (sites.position_ids)
                input_ids[row, : len(key)] = torch.tensor(key)
                attention_mask[row, : len(key)] = 1
            self._compute(input_ids.to(device), attention_mask.to(device), chunk, [0] * len(chunk))
        return len(ordered)
