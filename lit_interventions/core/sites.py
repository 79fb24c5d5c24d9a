"""Where to intervene: read and write the residual stream of any decoder-only HF causal LM, or
the output of a block's attention or MLP.

A site is (layer, component, token position per example); see `Site`. Layers follow pyvene's
`block_output`:
- `layer = l` for 0 <= l < L is the residual stream after decoder block l;
- `layer = -1` is the embedding output, i.e. the residual stream before block 0.

Decoder blocks, and their attention and MLP modules, are found generically (`decoder_layers`,
`component_module`), not from a per-architecture table, so GPT-NeoX, GPT-2, Llama, Gemma 2 and
Gemma 3 all work. Positions are per example, shape (batch,).

A model spread over devices by a device map (`sharding.py`) computes each block on its own
device: the hooks hand `on_hidden` (the intervention) its tensor on the device of the inputs and
put what it returns back on the block's device, and the returned states and logits are on the
device of the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from lit_interventions.core.lm import num_layers
from lit_interventions.core.sharding import execution_device, input_device, is_dispatched

EMBEDDINGS = -1
BLOCK_OUTPUT, ATTENTION_OUTPUT, MLP_OUTPUT = "block_output", "attention_output", "mlp_output"
COMPONENTS = (BLOCK_OUTPUT, ATTENTION_OUTPUT, MLP_OUTPUT)
POSITIONS = ("region", "last", "response")
# a block's child whose name holds one of these (and a weight matrix) computes the component
NAME_PATTERNS = {ATTENTION_OUTPUT: ("attn", "attention"), MLP_OUTPUT: ("mlp", "feed_forward", "ffn")}
_BLOCKS: WeakKeyDictionary = WeakKeyDictionary()  # model -> its decoder blocks, found once
_CHILDREN: WeakKeyDictionary = WeakKeyDictionary()  # model -> {component: name of the block's child}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder blocks: the ModuleList of `num_hidden_layers` modules of one class.
    Found once per model: walking every module took about 1 ms, twice a training step."""
    if model in _BLOCKS:
        return _BLOCKS[model]
    n = num_layers(model.config)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n and len({type(child) for child in module}) == 1
    ]
    if not candidates:
        raise ValueError(
            f"Cannot find the decoder blocks of {type(model).__name__}: no ModuleList of "
            f"{n} identical modules (config.num_hidden_layers)."
        )
    blocks = _BLOCKS[model] = min(candidates, key=lambda item: item[0].count("."))[1]  # the outermost one
    return blocks


def check_layer(layer: int, n_layers: int) -> None:
    if not isinstance(layer, int) or not -1 <= layer < n_layers:
        raise ValueError(
            f"layer={layer!r} is out of range: this model has {n_layers} layers, so layer must be "
            f"-1 (embeddings) or 0..{n_layers - 1}."
        )


def site_layer(config, layer: int | None) -> int:
    """`layer`, or the middle decoder block when None, checked against the model's config (no
    weights loaded): the default site of every module and study."""
    n_layers = num_layers(config)
    layer = n_layers // 2 if layer is None else layer
    check_layer(layer, n_layers)
    return layer


def _one_of(what: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not one of: {', '.join(allowed)}.")


@dataclass(frozen=True)
class Site:
    """Where an intervention reads and writes: a layer, a component of it and a token position.

    Components, named as in pyvene:
    - `block_output`: the residual stream after decoder block `layer` (layer -1: the embeddings);
    - `attention_output`: the output of block `layer`'s attention module, what it adds to the
      residual stream (Gemma: before its post-attention norm, like pyvene);
    - `mlp_output`: the output of block `layer`'s MLP module (Gemma: before its post-MLP norm).

    Positions, recorded and validated here (the data gives the token indices):
    - `region`: the last token of the template region `region` (None: the task's label variable);
    - `last`: the last non-pad token;
    - `response`: every response token (steering).
    """

    layer: int
    component: str = BLOCK_OUTPUT
    position: str = "region"
    region: str | None = None

    def __post_init__(self):
        _one_of("component", self.component, COMPONENTS)
        _one_of("position", self.position, POSITIONS)
        if self.region is not None and self.position != "region":
            raise ValueError(f"region={self.region!r} is only read with position='region', not {self.position!r}.")

    def check(self, n_layers: int) -> None:
        check_layer(self.layer, n_layers)
        if self.layer == EMBEDDINGS and self.component != BLOCK_OUTPUT:
            raise ValueError(f"layer=-1 (the embeddings) has only block_output, not component={self.component!r}.")


def _holds_a_matrix(module: nn.Module) -> bool:
    """Attention and MLP modules hold weight matrices; norms (Gemma's post_attention_layernorm)
    and dropouts (GPT-NeoX's post_attention_dropout) do not."""
    return any(p.dim() == 2 for p in module.parameters())


def _child_name(block: nn.Module, component: str) -> str:
    """The name of the block's direct child that computes `component`."""
    patterns = NAME_PATTERNS[component]
    found = [
        name
        for name, child in block.named_children()
        if any(pattern in name.lower() for pattern in patterns) and _holds_a_matrix(child)
    ]
    if len(found) != 1:
        children = [name for name, _ in block.named_children()]
        raise ValueError(
            f"Cannot find the {component} module of {type(block).__name__}: {len(found)} of its children "
            f"{children} have a name containing one of {patterns} and a weight matrix ({found}); exactly one must."
        )
    return found[0]


def component_module(model: nn.Module, layer: int, component: str) -> nn.Module:
    """Block `layer`'s attention or MLP module, whose output is `component`. Found once per model."""
    blocks = decoder_layers(model)
    names = _CHILDREN.setdefault(model, {})
    if component not in names:
        names[component] = _child_name(blocks[0], component)
    return getattr(blocks[layer], names[component])


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, hidden):
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[0], device=hidden.device)


def _home(model: nn.Module, device: torch.device | None) -> torch.device | None:
    """Where hook callbacks work on a dispatched model (None: the model is on one device)."""
    if not is_dispatched(model):
        return None
    return torch.device(device) if device is not None else input_device(model)


def _at_home(on_hidden: Callable, home: torch.device | None) -> Callable:
    """`on_hidden` on `home` (a block of a dispatched model may compute elsewhere), its result
    back on the block's device."""
    if home is None:
        return on_hidden

    def moved(hidden):
        new = on_hidden(hidden.to(home))
        return None if new is None else new.to(hidden.device)

    return moved


@contextmanager
def _output_hook(module: nn.Module, on_hidden: Callable[[torch.Tensor], torch.Tensor | None]):
    """Call `on_hidden(h)` on the module's output (the first element of a tuple); a returned
    tensor replaces it."""

    def post_hook(module, args, output):
        new = on_hidden(_hidden(output))
        return _replace_hidden(output, new) if new is not None else None

    handle = module.register_forward_hook(post_hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def residual_hook(
    model: nn.Module,
    layer: int,
    on_hidden: Callable[[torch.Tensor], torch.Tensor | None],
    device: torch.device | None = None,
):
    """Call `on_hidden(h)` on the residual stream at `layer`, (batch, seq, d); a returned tensor
    replaces it. On a dispatched model, `on_hidden` works on `device` (default: where the
    inputs go) whatever device the block computes on."""
    blocks = decoder_layers(model)
    check_layer(layer, len(blocks))
    on_hidden = _at_home(on_hidden, _home(model, device))
    if layer == EMBEDDINGS:

        def pre_hook(module, args, kwargs):
            if args:
                new = on_hidden(args[0])
                return ((new,) + tuple(args[1:]), kwargs) if new is not None else None
            new = on_hidden(kwargs["hidden_states"])
            return (args, {**kwargs, "hidden_states": new}) if new is not None else None

        handle = blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
    else:
        with _output_hook(blocks[layer], on_hidden):
            yield


@contextmanager
def site_hook(
    model: nn.Module,
    layer: int,
    component: str,
    on_hidden: Callable[[torch.Tensor], torch.Tensor | None],
    device: torch.device | None = None,
):
    """Call `on_hidden(h)` on `component` of block `layer`, (batch, seq, d); a returned tensor
    replaces it. `block_output` is `residual_hook`. `device`: as `residual_hook`."""
    Site(layer, component).check(len(decoder_layers(model)))
    if component == BLOCK_OUTPUT:
        hook = residual_hook(model, layer, on_hidden, device)
    else:
        hook = _output_hook(component_module(model, layer, component), _at_home(on_hidden, _home(model, device)))
    with hook:
        yield


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
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=past,
        use_cache=past is not None,
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
) -> dict[int, torch.Tensor]:
    """The residual stream (or `component`) at every position for each of `layers`,
    {layer: (batch, seq, d)}, from one forward that stops after the highest of them. An empty
    `keys_values` cache is filled with the keys and values of the blocks that ran."""
    _block_output_only(component, keys_values=keys_values)
    blocks = decoder_layers(model)
    for layer in layers:
        Site(layer, component).check(len(blocks))
    found, top = {}, max(layers)

    def grabber(layer):
        def grab(hidden):
            found[layer] = hidden
            if layer == top:
                raise _StopForward

        return grab

    with ExitStack() as stack:
        for layer in set(layers):
            stack.enter_context(site_hook(model, layer, component, grabber(layer), input_ids.device))
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
            stack.enter_context(_skip_blocks(model, layer))
        stack.enter_context(residual_hook(model, layer, lambda h: start_states.to(h.dtype), input_ids.device))
        run_body(model, input_ids, attention_mask, past=keys_values)
    return keys_values


@dataclass
class RowPrefix:
    """Cached keys and values of each row's first columns in the blocks above a layer
    (`ActivationCache.row_prefix`), for `stacked_hidden`: row i runs from column `ends[i]` (at
    or before its site) and reads its earlier columns from `keys_values`, (n_above, 2, batch,
    heads, width, head_dim), right-aligned: `mask` (batch, width) is 1 on the row's own columns."""

    ends: list[int]
    keys_values: torch.Tensor
    mask: torch.Tensor


def _prefix_cache(model: nn.Module, layer: int, above: torch.Tensor) -> DynamicCache:
    """A cache of the first c columns from the keys and values of the blocks above `layer`,
    (n_above, 2, batch, heads, c, head_dim), each on its block's device. The skipped blocks
    0..layer get placeholders of the same length (never read), so the model counts c columns
    already seen."""
    placeholder = (above[0, 0], above[0, 1])
    if is_dispatched(model):  # a block appends its new columns to its cached ones: on its device
        blocks = decoder_layers(model)[layer + 1 :]
        above = [kv.to(execution_device(block) or kv.device) for kv, block in zip(above, blocks)]
    return DynamicCache([placeholder] * (layer + 1) + [(kv[0], kv[1]) for kv in above])


@torch.no_grad()
def read_site(
    model: nn.Module,
    layer: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    component: str = BLOCK_OUTPUT,
) -> torch.Tensor:
    """f(x): the residual stream (or `component`) at (layer, positions), (batch, d). The forward
    stops at `layer`."""
    hidden = read_layers(model, [layer], input_ids, attention_mask, component=component)[layer]
    return hidden[_rows(hidden), positions]


def _returns_tuple(model: nn.Module, block: nn.Module) -> bool:
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
def _skip_blocks(model: nn.Module, upto: int):
    """Blocks 0..upto pass their input through unchanged (their output is replaced anyway)."""
    blocks = decoder_layers(model)
    as_tuple = _returns_tuple(model, blocks[0])

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
) -> torch.Tensor:
    """Next-token logits at `logit_positions` only, (batch, vocab), or (batch, n) for the token
    ids `vocab` (batch, n) alone.

    With an intervention, the residual stream (or `component`, see `Site`) at (layer,
    site_positions) is replaced by `intervention(f(b))` during the forward, i.e. p_{f <- f*}.

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
    past = None
    if prefix is not None:
        if start_states is None:
            raise ValueError("a prefix of keys and values needs start_states: the blocks below the layer are skipped")
        c, above = prefix
        past = _prefix_cache(model, layer, above)
        positions = position_ids(attention_mask)[:, c:]
        input_ids, start_states, logit_positions = input_ids[:, c:], start_states[:, c:], logit_positions - c
        site_positions = None if site_positions is None else site_positions - c

    def write(h):
        h = (h if start_states is None else start_states.to(h.dtype)).clone()
        if intervention is not None:
            rows = _rows(h)
            h[rows, site_positions] = intervention(h[rows, site_positions]).to(h.dtype)
        return h

    with ExitStack() as stack:
        if start_states is not None and layer != EMBEDDINGS:
            stack.enter_context(_skip_blocks(model, layer))
        if intervention is not None or start_states is not None:
            stack.enter_context(site_hook(model, layer, component, write, input_ids.device))
        hidden = run_body(model, input_ids, attention_mask, past, None if past is None else positions).last_hidden_state
    return final_logits(model, hidden[_rows(hidden), logit_positions], vocab)


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
    batch, as_tuple = starts.shape[0], _returns_tuple(model, blocks[0])  # (found before the blocks change)

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
            return _replace_hidden(output, torch.cat([_hidden(output), h0[n:]]))

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
    rows = _rows(start_states)
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
    hidden = hidden[_rows(hidden), logit_positions]
    return hidden if unsort is None else hidden[unsort]
