"""Frozen-LM activations computed once per distinct input and reused.

The LM never changes, so the residual stream of an input at a layer is the same at every
training step, every validation and for every intervention trained at that layer. Inputs are
keyed by their unpadded token ids, so a sentence that is the base of one pair and the source of
another (swap-doubling makes every sentence both) is computed once.

Under causal attention the tokens before a base's site are unchanged by the intervention in
every block, so the cache also keeps their keys and values in the blocks above the lowest layer
(the "prefix"): a training step then runs the upper blocks on the columns from the site on only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import DynamicCache

from lit_interventions.core.batch import Key, PairBatch, Side
from lit_interventions.core.forward import keys_values_above, read_layers
from lit_interventions.core.lm import num_layers
from lit_interventions.core.progress import stage
from lit_interventions.core.sharding import input_device
from lit_interventions.core.stacked import RowPrefix

PREFIXES = ("site", "all", "none")


class ActivationCache:
    """Residual-stream states at `layers` for every input seen, (n_layers, seq, d) per input."""

    def __init__(self, model: nn.Module, layers: list[int]):
        self.model, self.layers = model, sorted(set(layers))
        self._states: dict[Key, torch.Tensor] = {}
        # first tokens' keys and values in the blocks above the lowest layer, (n_above, 2, heads, n, head_dim)
        self._prefix: dict[Key, torch.Tensor] = {}
        # every token's keys and values in blocks 0..lowest, kept for the bases of a `fill(below=True)`:
        # an answer generated after an intervened prompt reads them (`forward.greedy_at`), (lowest + 1, 2, heads, seq, head_dim)
        self._below: dict[Key, torch.Tensor] = {}
        self._n_blocks = num_layers(model.config)

    def __len__(self) -> int:
        return len(self._states)

    def states(self, layer: int | list[int], side: Side) -> torch.Tensor:
        """The residual stream at `layer` for one side of a batch, (batch, seq, d), padding as
        zeros; with a list, one layer per row (rows at different layers, `stacked.stacked_hidden`).
        Inputs are found by the side's keys (`Side.keys`)."""
        input_ids = side.input_ids
        keys, starts = side.keys
        missing = [i for i, key in enumerate(keys) if key not in self._states]
        if missing:
            rows = torch.tensor(missing, device=input_ids.device)
            self._compute(
                input_ids[rows],
                side.attention_mask[rows],
                [keys[i] for i in missing],
                [starts[i] for i in missing],
                [0] * len(missing),
            )
        layers = [layer] * len(keys) if isinstance(layer, int) else layer
        index = {layer: self.layers.index(layer) for layer in set(layers)}
        first = self._states[keys[0]]
        out = first.new_zeros(input_ids.shape + first.shape[-1:], device=input_ids.device)  # where the batch is
        for i, (key, layer) in enumerate(zip(keys, layers)):
            out[i, starts[i] : starts[i] + len(key)] = self._states[key][index[layer]]
        return out

    def at_site(self, layer: int | list[int], side: Side) -> torch.Tensor:
        """f(x) at each row's site (`pos`) on one side of a batch, (batch, d): `states` at `layer`
        (or one layer per row)."""
        states = self.states(layer, side)
        return states[torch.arange(len(states), device=states.device), side.pos]

    def prefix(self, layer: int, side: Side) -> tuple[int, torch.Tensor] | None:
        """The keys and values of the blocks above `layer` for the side's first c columns,
        (n_above, 2, batch, heads, c, head_dim), padding as zeros, for `forward.logits_at(prefix=)`;
        c is as many columns as are cached for every row and before every site. None: c = 0."""
        keys, starts = side.keys
        stored = [start + self._prefix[key].shape[-2] if key in self._prefix else 0 for key, start in zip(keys, starts)]
        c = min(stored + side.sites)
        if c <= 0 or layer >= self._n_blocks - 1:
            return None
        skip = layer - self.layers[0]  # blocks between the lowest layer and this one are not needed
        first = self._prefix[keys[0]][skip:]
        out = first.new_zeros((first.shape[0], 2, len(keys), first.shape[2], c, first.shape[-1]))
        for i, (key, start) in enumerate(zip(keys, starts)):
            if start < c:
                out[:, :, i, :, start:c] = self._prefix[key][skip:, :, :, : c - start]
        return c, out

    def keys_values_below(self, layer: int, side: Side) -> torch.Tensor | None:
        """Every token's keys and values in blocks 0..`layer` for the side's rows, (layer + 1, 2,
        batch, heads, seq, head_dim), padding as zeros, for `forward.greedy_at`. None: `layer` is not
        the lowest cached layer, or a row's are not kept (`fill(below=True)` keeps the bases')."""
        keys, starts = side.keys
        if layer != self.layers[0] or layer < 0 or any(key not in self._below for key in keys):
            return None
        first = self._below[keys[0]]
        out = first.new_zeros((first.shape[0], 2, len(keys), first.shape[2], side.input_ids.shape[1], first.shape[-1]))
        for i, (key, start) in enumerate(zip(keys, starts)):
            out[:, :, i, :, start : start + len(key)] = self._below[key]
        return out

    def longest_prefix(self) -> int:
        """The most first tokens whose keys and values are cached for any input."""
        return max((stored.shape[-2] for stored in self._prefix.values()), default=0)

    def row_prefix(self, layer: int, side: Side, width: int | None = None) -> RowPrefix | None:
        """Each row's own cached keys and values of the blocks above `layer` before its site, for
        `stacked.stacked_hidden`: unlike `prefix`, a row whose site is late does not rerun the
        columns between the batch's earliest site and its own. None: no row has any.

        `width`: the prefix's columns (default: the batch's longest). A fixed one
        (`longest_prefix()`) puts each row's columns in the same places whatever rows share its
        batch, so its attention's bits do not depend on them (part of what lets a resumed sweep
        rescore a site exactly)."""
        if layer >= self._n_blocks - 1:
            return None
        keys, starts = side.keys
        lengths = self._cached_before(keys, starts, side.sites)
        if max(lengths) == 0:
            return None
        width = max(lengths) if width is None else width
        if width < max(lengths):
            raise ValueError(f"width={width} is narrower than a row's {max(lengths)} cached columns")
        skip = layer - self.layers[0]  # blocks between the lowest layer and this one are not needed
        first = self._prefix[keys[lengths.index(max(lengths))]][skip:]
        out = first.new_zeros((first.shape[0], 2, len(keys), first.shape[2], width, first.shape[-1]))
        mask = torch.zeros((len(keys), width), dtype=torch.long, device=first.device)
        for i, (key, n) in enumerate(zip(keys, lengths)):
            if n > 0:  # right-aligned: the row's cached columns end where its run begins
                out[:, :, i, :, width - n :] = self._prefix[key][skip:, :, :, :n]
                mask[i, width - n :] = 1
        return RowPrefix([start + n for start, n in zip(starts, lengths)], out, mask)

    def run_starts(self, side: Side) -> list[int]:
        """Where each row's run begins in `row_prefix` (`RowPrefix.ends`): after its cached columns."""
        keys, starts = side.keys
        return [start + n for start, n in zip(starts, self._cached_before(keys, starts, side.sites))]

    def _cached_before(self, keys: list[Key], starts: list[int], sites: list[int]) -> list[int]:
        """How many of each row's columns before its site have cached keys and values."""
        cached = [self._prefix[key].shape[-2] if key in self._prefix else 0 for key in keys]
        return [max(0, min(n, site - start)) for n, site, start in zip(cached, sites, starts)]

    def _compute(
        self, input_ids, attention_mask, keys: list[Key], starts: list[int], firsts: list[int], bottom=frozenset()
    ) -> None:
        """States at the layers for every row, and keys and values above the lowest layer for
        each row's `firsts` first tokens: the blocks up to the highest layer record them in the same
        forward; the blocks above it run on the first tokens only. The rows of the keys in
        `bottom` also keep every token's keys and values in blocks 0..lowest."""
        lowest, highest = self.layers[0], self.layers[-1]
        wanted = max(firsts) > 0  # `fill` asks for none when no block is above the lowest layer
        bottom = [j for j, key in enumerate(keys) if key in bottom] if lowest >= 0 else []
        below = DynamicCache() if wanted or bottom else None
        found = read_layers(self.model, self.layers, input_ids, attention_mask, keys_values=below)
        for j, (key, start) in enumerate(zip(keys, starts)):
            self._states[key] = torch.stack([found[layer][j, start : start + len(key)] for layer in self.layers])
        home = input_ids.device  # a dispatched model keeps each block's keys and values on its device
        if bottom:
            self._keep_below(below, [keys[j] for j in bottom], [starts[j] for j in bottom], bottom, home)
        if not wanted:
            return
        width = max(start + n for start, n in zip(starts, firsts))
        blocks = [below.layers[b] for b in range(lowest + 1, highest + 1)]
        if highest < self._n_blocks - 1:
            above = keys_values_above(
                self.model, highest, input_ids[:, :width], attention_mask[:, :width], found[highest][:, :width]
            )
            blocks += [above.layers[b] for b in range(highest + 1, self._n_blocks)]
        stacked = torch.stack(
            [torch.stack([b.keys[..., :width, :].to(home), b.values[..., :width, :].to(home)]) for b in blocks]
        )
        for j, (key, start, n) in enumerate(zip(keys, starts, firsts)):
            if n > 0:  # (n_above, 2, heads, n, head_dim)
                self._prefix[key] = stacked[:, :, j, :, start : start + n].clone()

    def _keep_below(self, below: DynamicCache, keys: list[Key], starts: list[int], rows: list[int], home) -> None:
        """Store, for each of `keys` (row `rows[j]` of the forward that filled `below`), every token's
        keys and values in blocks 0..lowest."""
        blocks = [below.layers[b] for b in range(self.layers[0] + 1)]
        kept = torch.stack([torch.stack([b.keys.to(home), b.values.to(home)]) for b in blocks])
        for key, start, row in zip(keys, starts, rows):
            self._below[key] = kept[:, :, row, :, start : start + len(key)].clone()

    def _compute_below(self, input_ids, attention_mask, keys: list[Key]) -> None:
        """Only the keys and values in blocks 0..lowest of rows whose states are cached already:
        a forward that stops at the lowest layer."""
        below = DynamicCache()
        read_layers(self.model, [self.layers[0]], input_ids, attention_mask, keys_values=below)
        self._keep_below(below, keys, [0] * len(keys), list(range(len(keys))), input_ids.device)

    def _missing(self, key: Key, first: int) -> bool:
        """Whether `key` lacks its states, or keys and values for its `first` first tokens."""
        stored = self._prefix[key].shape[-2] if key in self._prefix else 0
        return key not in self._states or stored < first

    @torch.no_grad()
    def fill(
        self,
        batches: Iterable[PairBatch],
        sides: tuple[str, ...] = ("base", "source"),
        batch_size: int = 64,
        prefix: str = "site",
        below: bool = False,
    ) -> int:
        """Compute every input of `batches` not cached yet, before they are needed: deduplicated,
        sorted by length and run `batch_size` at a time, so the frozen forwards are few and full
        instead of one small one per training step. Returns how many inputs were computed (an input
        whose states are cached and whose keys and values below are asked for runs blocks 0..lowest
        only).

        `prefix`: which tokens' keys and values above the lowest layer to keep as well. "site": a
        base's tokens before its site, what a training step at that site reads;
        "all": every token of every input (a sweep: its regions put the site anywhere); "none".
        `below`: also keep every base token's keys and values in blocks 0..lowest, what an answer
        generated after the intervened prompt reads (`keys_values_below`)."""
        if prefix not in PREFIXES:
            raise ValueError(f"prefix={prefix!r}: choose one of {PREFIXES}")
        if self.layers[0] == self._n_blocks - 1:
            prefix = "none"  # no block above the last one
        todo: dict[Key, int] = {}  # input -> how many first tokens need keys and values
        bottom: set[Key] = set()  # inputs whose keys and values below are kept
        for batch in batches:
            for name in sides:
                side = batch.side(name)
                keys, starts = side.keys
                if prefix == "site" and name == "base":
                    firsts = [site - start for site, start in zip(side.sites, starts)]
                else:
                    firsts = [len(key) if prefix == "all" else 0 for key in keys]
                if below and name == "base" and self.layers[0] >= 0:
                    bottom.update(key for key in keys if key not in self._below)
                for key, first in zip(keys, firsts):
                    first = max(todo.get(key, 0), first)
                    if self._missing(key, first):
                        todo[key] = first
        ordered = sorted(todo, key=len)
        only_below = sorted(bottom.difference(todo), key=len)  # their states are cached: blocks 0..lowest only
        device = input_device(self.model)
        chunks = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
        whole = len(chunks)  # the chunks after these need blocks 0..lowest only
        chunks += [only_below[i : i + batch_size] for i in range(0, len(only_below), batch_size)]
        with stage(len(chunks), "cached forwards", "forward") as shown:  # a study's progress
            for i, chunk in enumerate(chunks):
                width = len(chunk[-1])
                input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
                attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, key in enumerate(chunk):  # right padding: positions ignore it (forward.position_ids)
                    input_ids[row, : len(key)] = torch.tensor(key)
                    attention_mask[row, : len(key)] = 1
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                if i < whole:
                    firsts = [todo[key] for key in chunk]
                    self._compute(input_ids, attention_mask, chunk, [0] * len(chunk), firsts, bottom)
                else:
                    self._compute_below(input_ids, attention_mask, chunk)
                shown.update()
        return len(ordered) + len(only_below)
