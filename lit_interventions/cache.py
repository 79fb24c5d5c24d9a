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
            found = read_layers(self.model, self.layers, input_ids[rows], attention_mask[rows])
            for j, i in enumerate(missing):
                span = slice(starts[i], starts[i] + len(keys[i]))
                self._states[keys[i]] = torch.stack([found[l][j, span] for l in self.layers])
        index = self.layers.index(layer)
        first = self._states[keys[0]]
        out = first.new_zeros(input_ids.shape + first.shape[-1:])
        for i, key in enumerate(keys):
            out[i, starts[i] : starts[i] + len(key)] = self._states[key][index]
        return out
