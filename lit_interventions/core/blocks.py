"""The parts of a decoder-only HF causal LM that a site names, and the checks of a site's layer
and component against them.

Decoder blocks, and their attention and MLP modules, are found generically (`decoder_layers`,
`component_module`), not from a per-architecture table, so GPT-NeoX, GPT-2, Llama, Gemma 2 and
Gemma 3 all work. Layers follow pyvene's `block_output`: `layer = l` for 0 <= l < L is the
residual stream after decoder block l, `layer = -1` (`EMBEDDINGS`) the embedding output.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from torch import nn

from lit_interventions.core.lm import num_layers

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


def check_component(layer: int, component: str, n_layers: int) -> None:
    """`Site(layer, component).check(n_layers)`: the component's name, then the layer and
    whether it has that component."""
    one_of("component", component, COMPONENTS)
    check_layer_component(layer, component, n_layers)


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
