"""The parts of a decoder-only HF causal LM that a site names, and the checks of a site's layer,
component and heads against them.

Decoder blocks, and their attention and MLP modules, are found generically (`decoder_layers`,
`component_module`), not from a per-architecture table, so GPT-NeoX, GPT-2, Llama, Gemma 2,
Gemma 3 and OPT all work. Layers follow pyvene's `block_output`: `layer = l` for 0 <= l < L is
the residual stream after decoder block l, `layer = -1` (`EMBEDDINGS`) the embedding output.
The parts inside the attention and MLP modules (projections, heads) are found in `parts.py`.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from torch import nn

from lit_interventions.core.lm import num_layers

EMBEDDINGS = -1
BLOCK_OUTPUT, ATTENTION_OUTPUT, MLP_OUTPUT = "block_output", "attention_output", "mlp_output"
BLOCK_INPUT, ATTENTION_HEAD, MLP_NEURON = "block_input", "attention_head", "mlp_neuron"
QUERY, KEY, VALUE = "query", "key", "value"
COMPONENTS = (BLOCK_OUTPUT, ATTENTION_OUTPUT, MLP_OUTPUT, BLOCK_INPUT, ATTENTION_HEAD, QUERY, KEY, VALUE, MLP_NEURON)
HEAD_COMPONENTS = (ATTENTION_HEAD, QUERY, KEY, VALUE)  # the components a site reads per head
# each component's name in pyvene's `IntervenableConfig` (mlp_neuron: pyvene's `mlp_activation` is
# the down projection's input only where nothing multiplies the activation: GPT-2, GPT-NeoX)
PYVENE_NAMES = {
    BLOCK_OUTPUT: "block_output",
    ATTENTION_OUTPUT: "attention_output",
    MLP_OUTPUT: "mlp_output",
    BLOCK_INPUT: "block_input",
    ATTENTION_HEAD: "head_attention_value_output",
    QUERY: "head_query_output",
    KEY: "head_key_output",
    VALUE: "head_value_output",
    MLP_NEURON: "mlp_activation",
}
POSITIONS = ("region", "last", "response")
# a block's child whose name holds one of these (and a weight matrix) computes the component
NAME_PATTERNS = {ATTENTION_OUTPUT: ("attn", "attention"), MLP_OUTPUT: ("mlp", "feed_forward", "ffn")}
# an MLP's down projection (hidden units -> residual stream): its input is `mlp_neuron`; a block
# with no MLP module (OPT) holds it directly, and its output is then `mlp_output`
DOWN_PROJECTION = ("down_proj", "c_proj", "4h_to_h", "fc2", "fc_out", "w2")
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
    """A ValueError unless `layer` is -1 (the embeddings) or a block index of a model of `n_layers`."""
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


def one_of(what: str, value, allowed: tuple) -> None:
    """A ValueError naming `what` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not one of: {', '.join(allowed)}.")


def check_layer_component(layer: int, component: str, n_layers: int) -> None:
    """A ValueError unless `component` is known and block `layer` of `n_layers` has it: the
    embeddings (layer -1) have only `block_output`."""
    check_layer(layer, n_layers)
    if layer == EMBEDDINGS and component != BLOCK_OUTPUT:
        raise ValueError(f"layer=-1 (the embeddings) has only block_output, not component={component!r}.")


def check_component(layer: int, component: str, n_layers: int, head=None, config=None) -> None:
    """`Site(layer, component, head=head).check(n_layers, config)`: the component's name, then the
    layer and whether it has that component, then the heads (`check_head`)."""
    one_of("component", component, COMPONENTS)
    check_layer_component(layer, component, n_layers)
    check_head(component, head, config)


def head_counts(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dimension) of a model's attention, from its config:
    `num_attention_heads`, `num_key_value_heads` (grouped-query attention; default: as many as
    the query heads) and `head_dim` (default: hidden size / heads)."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return heads, kv_heads, head_dim


def heads_of(head) -> tuple[int, ...]:
    """A site's `head` (an int or a list of ints) as a tuple of distinct head indices."""
    heads = (head,) if isinstance(head, int) and not isinstance(head, bool) else tuple(head or ())
    if not heads or any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in heads):
        raise ValueError(f"head={head!r} must be a head index (an int >= 0) or a non-empty list of them")
    if len(set(heads)) != len(heads):
        raise ValueError(f"head={head!r} names a head twice: each head is read once")
    return heads


def check_head(component: str, head, config=None) -> None:
    """A ValueError unless `head` fits `component`: None for a component without heads, one head
    or a list of them for `HEAD_COMPONENTS`, each below the model's count when `config` is given
    (query heads; key/value heads for `key` and `value`)."""
    if component not in HEAD_COMPONENTS:
        if head is not None:
            raise ValueError(
                f"head={head!r} is given for component={component!r}, which has no heads: head is only "
                f"for {', '.join(HEAD_COMPONENTS)}."
            )
        return
    if head is None:
        raise ValueError(f"component={component!r} needs head: a head index or a list of them (--model.head 0).")
    heads = heads_of(head)
    head = list(head) if isinstance(head, tuple) else head  # named as given (a Site keeps a tuple)
    if config is None:
        return
    n_heads, n_kv_heads, _ = head_counts(config)
    n, kind = (n_kv_heads, "key/value") if component in (KEY, VALUE) else (n_heads, "query")
    bad = [h for h in heads if h >= n]
    if bad:
        raise ValueError(
            f"head={head!r} is out of range for component={component!r}: this model has {n} {kind} heads, "
            f"so a head must be in 0..{n - 1}."
        )


def intermediate_size(config) -> int:
    """The number of an MLP's hidden units (`mlp_neuron`'s width), from the config: the first of
    `intermediate_size`, `n_inner`, `ffn_dim` or `ffn_hidden_size` it sets, else 4 × hidden size
    (GPT-2's default). The hook checks it against the down projection it reads."""
    text = config.get_text_config()
    for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * int(text.hidden_size)


def site_width(config, component: str, head=None) -> int:
    """d, the size of the state an intervention at `component` sees: the hidden size; head_dim ×
    the number of heads for `HEAD_COMPONENTS`; the MLP's hidden units for `mlp_neuron`."""
    if component in HEAD_COMPONENTS:
        return head_counts(config)[2] * len(heads_of(head))
    if component == MLP_NEURON:
        return intermediate_size(config)
    return int(config.get_text_config().hidden_size)


def _holds_a_matrix(module: nn.Module) -> bool:
    """Attention and MLP modules hold weight matrices; norms (Gemma's post_attention_layernorm)
    and dropouts (GPT-NeoX's post_attention_dropout) do not."""
    return any(p.dim() == 2 for p in module.parameters())


def matching_children(module: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The names of the module's direct children that hold a weight matrix and whose name
    contains one of `patterns`."""
    return [
        name
        for name, child in module.named_children()
        if any(pattern in name.lower() for pattern in patterns) and _holds_a_matrix(child)
    ]


def find_child(module: nn.Module, what: str, patterns: tuple[str, ...]) -> str:
    """The name of the module's one direct child that computes `what` (`matching_children`)."""
    found = matching_children(module, patterns)
    if len(found) != 1:
        children = [name for name, _ in module.named_children()]
        raise ValueError(
            f"Cannot find the {what} module of {type(module).__name__}: {len(found)} of its children "
            f"{children} have a name containing one of {patterns} and a weight matrix ({found}); exactly one must."
        )
    return found[0]


def _child_name(block: nn.Module, component: str) -> str:
    """The name of the block's direct child that computes `component`."""
    return find_child(block, component, NAME_PATTERNS[component])


def _mlp_name(block: nn.Module) -> str:
    """The block's child whose output is `mlp_output`: its MLP module, or, in a block whose MLP is
    inline (OPT: fc1 and fc2 on the block), its down projection."""
    if not matching_children(block, NAME_PATTERNS[MLP_OUTPUT]) and len(matching_children(block, DOWN_PROJECTION)) == 1:
        return find_child(block, "down projection", DOWN_PROJECTION)
    return _child_name(block, MLP_OUTPUT)


def component_module(model: nn.Module, layer: int, component: str) -> nn.Module:
    """Block `layer`'s attention or MLP module, whose output is `component` (a block with an inline
    MLP: its down projection). Found once per model."""
    blocks = decoder_layers(model)
    names = _CHILDREN.setdefault(model, {})
    if component not in names:
        names[component] = _mlp_name(blocks[0]) if component == MLP_OUTPUT else _child_name(blocks[0], component)
    return getattr(blocks[layer], names[component])
