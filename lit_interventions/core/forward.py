"""Running the frozen LM at a site: the decoder body, the states at some layers (a forward that
stops after the highest), the keys and values above a layer, and next-token logits at chosen
positions with an intervention written at a site.

The cached fast path starts the forward from the residual stream at the layer computed earlier
(`start_states`: the blocks below are skipped) and may read the keys and values of the first
columns from a cache (`prefix`). On a model spread over devices by a device map (`sharding.py`)
the returned states and logits are on the device of the inputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from functools import cache

import torch
from torch import nn
from transformers import DynamicCache

from lit_interventions.core.blocks import BLOCK_OUTPUT, EMBEDDINGS, check_component, decoder_layers
from lit_interventions.core.hooks import residual_hook, site_hook
from lit_interventions.core.sharding import execution_device, input_device, is_dispatched


def row_index(hidden: torch.Tensor) -> torch.Tensor:
    """0..batch-1 on the device of `hidden`: with per-row positions, it picks one column per row."""
    return torch.arange(hidden.shape[0], device=hidden.device)


def _block_output_only(component: str, **fast_path) -> None:
    """The cached fast path (skipped blocks, cached keys and values) starts from the residual stream."""
    given = [name for name, value in fast_path.items() if value is not None]
    if component != BLOCK_OUTPUT and given:
        raise ValueError(
            f"{' and '.join(given)} need component='block_output', not {component!r}: the cached fast "
            f"path starts from the residual stream. Leave out {' and '.join(given)} to run the full forward."
        )


class _StopForward(Exception):
    pass


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore padding, so left and right padding give the same states."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@cache
def cache_keyword(body: type) -> str:
    """The keyword a decoder body's (or causal LM's) forward takes its key/value cache by: `cache` in recent
    transformers, `past_key_values` before it (the new name avoids the deprecation warning)."""
    parameters = inspect.signature(body.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def run_body(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    past: DynamicCache | None = None,
    positions: torch.Tensor | None = None,
):
    """The decoder body (no LM head). With `past`, blocks read the keys and values of earlier
    columns from it and append their own; `input_ids` are then the columns after those. The last
    hidden state is on the device of `input_ids` (a dispatched model ends on its last device)."""
    if positions is None:
        positions = position_ids(attention_mask)
    body = model.base_model
    out = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=past is not None,
        **{cache_keyword(type(body)): past},
    )
    if out.last_hidden_state.device != input_ids.device:
        out.last_hidden_state = out.last_hidden_state.to(input_ids.device)
    return out


@torch.no_grad()
def read_layers(
    model: nn.Module,
    layers: list[int],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keys_values: DynamicCache | None = None,
    component: str = BLOCK_OUTPUT,
    head=None,
) -> dict[int, torch.Tensor]:
    """The residual stream (or `component`, of `head` for a head component) at every position for
    each of `layers`, {layer: (batch, seq, d)}, from one forward that stops after the highest of
    them. An empty `keys_values` cache is filled with the keys and values of the blocks that ran."""
    _block_output_only(component, keys_values=keys_values)
    blocks = decoder_layers(model)
    for layer in layers:
        check_component(layer, component, len(blocks), head, model.config)
    found, top = {}, max(layers)

    def grabber(layer):
        def grab(hidden):
            found[layer] = hidden
            if layer == top:
                raise _StopForward

        return grab

    with ExitStack() as stack:
        for layer in set(layers):
            stack.enter_context(site_hook(model, layer, component, grabber(layer), input_ids.device, head))
        try:
            run_body(model, input_ids, attention_mask, past=keys_values)
        except _StopForward:
            pass
    return found


@torch.no_grad()
def keys_values_above(
    model: nn.Module, layer: int, input_ids: torch.Tensor, attention_mask: torch.Tensor, start_states: torch.Tensor
) -> DynamicCache:
    """The keys and values of every block above `layer`, run from the residual stream at `layer`
    computed earlier, (batch, seq, d); the blocks below are skipped and hold nothing."""
    keys_values = DynamicCache()
    with ExitStack() as stack:
        if layer != EMBEDDINGS:
            stack.enter_context(skip_blocks(model, layer))
        stack.enter_context(residual_hook(model, layer, lambda h: start_states.to(h.dtype), input_ids.device))
        run_body(model, input_ids, attention_mask, past=keys_values)
    return keys_values


def prefix_cache(model: nn.Module, layer: int, above: torch.Tensor) -> DynamicCache:
    """A cache of the first c columns from the keys and values of the blocks above `layer`,
    (n_above, 2, batch, heads, c, head_dim), each on its block's device. The skipped blocks
    0..layer get placeholders of the same length (never read), so the model counts c columns
    already seen."""
    placeholder = (above[0, 0], above[0, 1])
    above = _on_block_devices(model, layer + 1, above)
    return DynamicCache([placeholder] * (layer + 1) + [(kv[0], kv[1]) for kv in above])


def _on_block_devices(model: nn.Module, first: int, stacked: torch.Tensor) -> list[torch.Tensor]:
    """Blocks first.. keys and values, (n, 2, ...), each on its block's device: a block appends
    its new columns to its cached ones."""
    if not is_dispatched(model):
        return list(stacked)
    blocks = decoder_layers(model)[first:]
    return [kv.to(execution_device(block) or kv.device) for kv, block in zip(stacked, blocks)]


@torch.no_grad()
def read_site(
    model: nn.Module,
    layer: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    component: str = BLOCK_OUTPUT,
    head=None,
) -> torch.Tensor:
    """f(x): the residual stream (or `component`, of `head` for a head component) at (layer,
    positions), (batch, d). The forward stops at `layer`."""
    hidden = read_layers(model, [layer], input_ids, attention_mask, component=component, head=head)[layer]
    return hidden[row_index(hidden), positions]


def returns_tuple(model: nn.Module, block: nn.Module) -> bool:
    """Whether decoder blocks return a tuple (GPT-2) or a tensor (Llama in transformers 5)."""
    known = getattr(model, "_lit_block_returns_tuple", None)
    if known is None:
        seen = {}

        def record(module, args, output):
            seen["tuple"] = isinstance(output, tuple)

        handle = block.register_forward_hook(record)
        try:
            ids = torch.zeros((1, 1), dtype=torch.long, device=input_device(model))
            with torch.no_grad():
                run_body(model, ids, torch.ones_like(ids))
        finally:
            handle.remove()
        known = model._lit_block_returns_tuple = seen["tuple"]
    return known


@contextmanager
def skip_blocks(model: nn.Module, upto: int):
    """Blocks 0..upto pass their input through unchanged (their output is replaced anyway)."""
    blocks = decoder_layers(model)
    as_tuple = returns_tuple(model, blocks[0])

    def passthrough(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden,) if as_tuple else hidden

    # accelerate's dispatch hooks live in the instance's `forward` too: put back what was there
    replaced = [(block, block.__dict__.get("forward")) for block in blocks[: upto + 1]]
    for block, _ in replaced:
        block.forward = passthrough
    try:
        yield
    finally:
        for block, forward in replaced:
            if forward is None:
                del block.forward
            else:
                block.forward = forward


def final_logits(model: nn.Module, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """LM head on final hidden states (after the final norm), with Gemma's soft-capping if set.

    With `vocab` (batch, n) token ids, only those rows of the head are computed, (batch, n): a
    metric that compares a few tokens' logits (the odds ratio) skips the rest of the vocabulary.
    The logits are on the device of `hidden` (the head of a dispatched model may be elsewhere)."""
    head = model.get_output_embeddings()
    if vocab is None:
        logits = head(hidden)
    elif is_dispatched(model):
        from accelerate.utils import align_module_device

        device = execution_device(head) or hidden.device
        with align_module_device(head):  # loads an offloaded head's weights for the gather
            logits = _vocab_logits(head, hidden.to(device), vocab.to(device))
    else:
        logits = _vocab_logits(head, hidden, vocab)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.to(hidden.device)


def _vocab_logits(head: nn.Module, hidden: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """The head's logits of the token ids `vocab` (batch, n) alone, (batch, n)."""
    logits = torch.einsum("bd,bnd->bn", hidden, head.weight[vocab].to(hidden.dtype))
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[vocab]
    return logits


def logits_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logit_positions: torch.Tensor,
    layer: int | None = None,
    site_positions: torch.Tensor | None = None,
    intervention: Callable[[torch.Tensor], torch.Tensor] | None = None,
    start_states: torch.Tensor | None = None,
    vocab: torch.Tensor | None = None,
    prefix: tuple[int, torch.Tensor] | None = None,
    component: str = BLOCK_OUTPUT,
    head=None,
) -> torch.Tensor:
    """Next-token logits at `logit_positions` only, (batch, vocab), or (batch, n) for the token
    ids `vocab` (batch, n) alone.

    With an intervention, the residual stream (or `component` and its `head`, see `Site`) at
    (layer, site_positions) is replaced by `intervention(f(b))` during the forward, i.e. p_{f <- f*}.

    With `start_states` (batch, seq, d), the residual stream at `layer` computed earlier for
    these inputs (the LM is frozen, so it never changes), blocks 0..layer are skipped and the
    forward starts from it: only the blocks above the site do work.

    With `prefix` (c, keys and values of the blocks above `layer` for the first c columns,
    (n_above, 2, batch, heads, c, head_dim)), as well as `start_states`, only columns c.. are
    run: under causal attention the columns before every site are unchanged above it as well.
    The caller keeps c at or before every site (`ActivationCache.prefix`). Both are for
    component='block_output' only.
    """
    _block_output_only(component, start_states=start_states, prefix=prefix)
    past, c = None, 0
    if prefix is not None:
        if start_states is None:
            raise ValueError("a prefix of keys and values needs start_states: the blocks below the layer are skipped")
        c, above = prefix
        past = prefix_cache(model, layer, above)
    hidden = _hidden_at(
        model, input_ids, attention_mask, logit_positions, layer, site_positions, intervention, start_states, past, c,
        component, head,
    )  # fmt: skip
    return final_logits(model, hidden, vocab)


def _hidden_at(
    model, input_ids, attention_mask, logit_positions, layer, site_positions, intervention, start_states, past, c,
    component=BLOCK_OUTPUT, head=None,
) -> torch.Tensor:  # fmt: skip
    """`logits_at`'s forward: the final hidden states at `logit_positions`, (batch, d). With
    `past` (`prefix_cache` of the first `c` columns) only columns c.. run, and the blocks above
    `layer` append their keys and values to it."""
    if past is not None:
        positions = position_ids(attention_mask)[:, c:]
        input_ids, start_states, logit_positions = input_ids[:, c:], start_states[:, c:], logit_positions - c
        site_positions = None if site_positions is None else site_positions - c

    def write(h):
        h = (h if start_states is None else start_states.to(h.dtype)).clone()
        if intervention is not None:
            rows = row_index(h)
            h[rows, site_positions] = intervention(h[rows, site_positions]).to(h.dtype)
        return h

    with ExitStack() as stack:
        if start_states is not None and layer != EMBEDDINGS:
            stack.enter_context(skip_blocks(model, layer))
        if intervention is not None or start_states is not None:
            stack.enter_context(site_hook(model, layer, component, write, input_ids.device, head))
        hidden = run_body(model, input_ids, attention_mask, past, None if past is None else positions).last_hidden_state
    return hidden[row_index(hidden), logit_positions]


@torch.no_grad()
def greedy_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    last: torch.Tensor,
    n: int,
    layer: int,
    site_positions: torch.Tensor,
    intervention: Callable[[torch.Tensor], torch.Tensor],
    start_states: torch.Tensor,
    prefix: tuple[int, torch.Tensor] | None = None,
    below: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits at `last`, (batch, vocab); the n greedy tokens after it, (batch, n)) of the
    model with `intervention` written at (layer, site_positions) of the prompt: the first by
    `logits_at`'s cached path (`start_states`, `prefix`; a block-output site above the
    embeddings), the others one column a step with every block's keys and values kept, as a
    generation that keeps an intervened prompt's keys and values (pyvene's `generate` with
    `intervene_on_prompt=True`). The blocks up to `layer` keep the prompt's clean keys and values
    (an edit of the layer's output changes nothing below it): `below`, (layer + 1, 2, batch,
    heads, seq, head_dim) (`ActivationCache.keys_values_below`), or one forward that stops at the
    layer. The blocks above keep the intervened forward's. Under causal attention this equals
    running the prompt extended by the tokens so far with the same edit at the same place."""
    blocks = len(decoder_layers(model))
    if below is None:  # blocks 0..layer: the prompt's keys and values, unintervened
        computed = DynamicCache()
        read_layers(model, [layer], input_ids, attention_mask, keys_values=computed)
        below = [(computed.layers[b].keys, computed.layers[b].values) for b in range(layer + 1)]
    else:
        below = [(kv[0], kv[1]) for kv in _on_block_devices(model, 0, below)]
    if prefix is None:  # no cached columns: every block above starts empty
        empty = below[0][0][..., :0, :]
        prefix = (0, empty.new_zeros((blocks - layer - 1, 2, *empty.shape)))
    c, above = prefix
    past = prefix_cache(model, layer, above)
    hidden = _hidden_at(
        model, input_ids, attention_mask, last, layer, site_positions, intervention, start_states, past, c
    )  # fmt: skip
    first = final_logits(model, hidden)
    kept = DynamicCache(below + [(past.layers[b].keys, past.layers[b].values) for b in range(layer + 1, blocks)])
    tokens, mask = [first.argmax(-1)], attention_mask
    positions = position_ids(attention_mask)[row_index(attention_mask), last]  # each row's last token
    for step in range(1, n):  # the prompt's sites are behind: no edit in the new column
        mask = torch.nn.functional.pad(mask, (0, 1), value=1)
        out = run_body(model, tokens[-1][:, None], mask, kept, (positions + step)[:, None])
        tokens.append(final_logits(model, out.last_hidden_state[:, -1]).argmax(-1))
    return first, torch.stack(tokens, 1)
