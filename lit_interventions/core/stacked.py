"""Rows whose sites lie at different layers, in one forward (`stacked_hidden`): each row starts
from its residual stream at its own layer and block j runs only the rows whose layer is below j,
so each block's frozen weights are read once for all rows. `RowPrefix`: the cached keys and
values of each row's first columns, so a row runs only its columns from its site on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from lit_interventions.core.blocks import check_layer, decoder_layers
from lit_interventions.core.forward import position_ids, returns_tuple, row_index, run_body
from lit_interventions.core.hooks import hidden_of, with_hidden


@dataclass
class RowPrefix:
    """Cached keys and values of each row's first columns in the blocks above a layer
    (`ActivationCache.row_prefix`), for `stacked_hidden`: row i runs from column `ends[i]` (at
    or before its site) and reads its earlier columns from `keys_values`, (n_above, 2, batch,
    heads, width, head_dim), right-aligned: `mask` (batch, width) is 1 on the row's own columns."""

    ends: list[int]
    keys_values: torch.Tensor
    mask: torch.Tensor


def _take_rows(value, batch: int, n: int):
    """`value` with every batch-dimension tensor cut to its first `n` rows: tensors of 2 or more
    dimensions whose first is `batch` (hidden states, masks, position ids, rotary cos and sin),
    also inside tuples, lists and dicts. Masks broadcast over the batch (first dimension 1),
    caches and 1-D tensors (cache positions) are left as they are."""
    if torch.is_tensor(value):
        return value[:n] if value.dim() >= 2 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, batch, n) for v in value)
    if isinstance(value, dict):
        return {k: _take_rows(v, batch, n) for k, v in value.items()}
    return value


@contextmanager
def _rows_enter_at_their_layer(model: nn.Module, starts: torch.Tensor, entered: list[int]):
    """Block j runs only on the first `entered[j]` rows, those whose site layer is below j (the
    rows are in ascending order of layer); every other row carries its start state `starts`
    (batch, seq, d), the residual stream at its own layer, into the block above it."""
    blocks = decoder_layers(model)
    batch, as_tuple = starts.shape[0], returns_tuple(model, blocks[0])  # (found before the blocks change)

    def wrap(j, block):
        forward, n = block.forward, entered[j]
        ran = entered[j - 1] if j > 0 else 0  # rows that came out of block j - 1

        def rows_above_their_site(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            h0 = starts.to(hidden.dtype)
            if n == 0:
                return (h0,) if as_tuple else h0
            x = torch.cat([hidden[:ran], h0[ran:n]])  # rows whose site is the layer just below enter here
            args = _take_rows(args, batch, n)
            kwargs = _take_rows(kwargs, batch, n)
            if args:
                args = (x,) + tuple(args[1:])
            else:
                kwargs["hidden_states"] = x
            output = forward(*args, **kwargs)
            return with_hidden(output, torch.cat([hidden_of(output), h0[n:]]))

        return rows_above_their_site

    for j, block in enumerate(blocks):
        block.forward = wrap(j, block)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _attention_kernel(device: torch.device):
    """On a CPU, scaled-dot-product attention by its plain (math) kernel. Training: on the
    sweep's short rows its backward is about 4× faster than the flash kernel's (0.04 s against
    0.16 s at 360 rows × 4 heads × 8 query × 10 key columns, bfloat16). Scoring: with rows
    shifted to their sites the batch's width depends on the other rows, and the flash kernel's
    bits for a row change with it (by ~1e-7); the math kernel's do not (with a fixed prefix
    width, `ActivationCache.row_prefix`), part of what lets a resumed sweep rescore a site exactly."""
    return sdpa_kernel([SDPBackend.MATH]) if device.type == "cpu" else nullcontext()


def stacked_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logit_positions: torch.Tensor,
    layers: list[int],
    site_positions: torch.Tensor,
    intervention: Callable[[torch.Tensor], torch.Tensor] | None,
    start_states: torch.Tensor,
    prefix: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The final hidden states at `logit_positions` (batch, d), what the LM head reads, for rows
    whose sites lie at different layers, in one forward: row i starts
    from its residual stream at `layers[i]` (`start_states` (batch, seq, d), each row at its own
    layer), with `intervention` (on all rows' site states at once, (batch, d)) written at its site,
    and block j runs only the rows whose layer is below j. Each block's frozen weights are read
    once for all rows. With `final_logits` on it, it equals `logits_at` row by row, to float rounding.

    `prefix` (`ActivationCache.row_prefix` in the blocks above min(layers)): row i runs only its
    columns ends[i]..logit_positions[i], left-aligned after its cached ones (so the real columns
    of every row stay contiguous and their distances, which sliding windows read, are kept).
    Rows may come in any order (they are sorted by layer inside); component='block_output' only.
    """
    n_blocks = len(decoder_layers(model))
    for layer in set(layers):
        check_layer(layer, n_blocks)
    if len(layers) != len(input_ids):
        raise ValueError(f"{len(layers)} layers for {len(input_ids)} rows: give one layer per row")
    rows = row_index(start_states)
    h0 = start_states.clone()
    if intervention is not None:
        h0[rows, site_positions] = intervention(h0[rows, site_positions]).to(h0.dtype)
    order = sorted(range(len(layers)), key=layers.__getitem__)  # stable: ascending layer
    if order != list(range(len(layers))):
        index = torch.tensor(order, device=input_ids.device)
        input_ids, attention_mask, logit_positions, h0 = (
            input_ids[index],
            attention_mask[index],
            logit_positions[index],
            h0[index],
        )
        if prefix is not None:
            prefix = RowPrefix([prefix.ends[i] for i in order], prefix.keys_values[:, :, index], prefix.mask[index])
        layers = [layers[i] for i in order]
        unsort = torch.empty_like(index)
        unsort[index] = torch.arange(len(index), device=index.device)
    else:
        unsort = None
    entered = [sum(1 for layer in layers if layer < j) for j in range(n_blocks)]  # rows block j runs
    past, positions = None, None
    if prefix is not None:
        above, lowest = prefix.keys_values, layers[0]
        placeholder = (above[0, 0], above[0, 1])  # blocks no row runs: never read
        past = DynamicCache(
            [placeholder] * (lowest + 1)
            + [
                (above[j - lowest - 1, 0, : entered[j]], above[j - lowest - 1, 1, : entered[j]])
                for j in range(lowest + 1, n_blocks)
            ]
        )
        ends = torch.tensor(prefix.ends, device=input_ids.device)
        columns = ends[:, None] + torch.arange(int((logit_positions - ends).max()) + 1, device=ends.device)
        inside = columns <= logit_positions[:, None]  # the columns a row needs: its own, up to its logits
        columns = columns.clamp(max=input_ids.shape[1] - 1)
        positions = position_ids(attention_mask).gather(1, columns)
        running = attention_mask.gather(1, columns) * inside
        input_ids, h0, logit_positions = (
            input_ids.gather(1, columns),
            h0[rows[:, None], columns],
            logit_positions - ends,
        )
        attention_mask = torch.cat([prefix.mask.to(running.dtype), running], dim=1)
    with _rows_enter_at_their_layer(model, h0, entered), _attention_kernel(input_ids.device):
        hidden = run_body(model, input_ids, attention_mask, past, positions).last_hidden_state
    hidden = hidden[row_index(hidden), logit_positions]
    return hidden if unsort is None else hidden[unsort]
