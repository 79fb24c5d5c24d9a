"""The parts inside a block that the fine sites read: where each component's state is, as a
module, its input or output, and the feature columns of the site among the module's.

- `block_input`: the input of decoder block `layer` (a forward pre-hook on the block);
- `attention_output`, `mlp_output`: the output of the attention / MLP module (`blocks.py`; in a
  block whose MLP is inline, OPT, the output of its down projection fc2);
- `attention_head`: the input of the attention's output projection (o_proj, c_proj, dense,
  out_proj), (heads × head_dim) features, the columns of the chosen heads;
- `query`, `key`, `value`: the output of q_proj / k_proj / v_proj, the columns of the chosen
  heads (key and value count the key/value heads of grouped-query attention). A fused projection
  (GPT-2's c_attn, GPT-NeoX's query_key_value) is split in the order q, k, v, either as three
  blocks [q | k | v] (GPT-2) or interleaved per head [q_h k_h v_h] (GPT-NeoX); which one a model
  uses is measured once (`fused_layout`);
- `mlp_neuron`: the input of the MLP's down projection (down_proj, c_proj, dense_4h_to_h, fc2),
  every hidden unit.

Modules are found by name patterns among a module's children holding a weight matrix, as
`blocks.py` finds the attention and MLP modules: no per-architecture table.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn

from lit_interventions.core.blocks import (
    ATTENTION_HEAD,
    ATTENTION_OUTPUT,
    BLOCK_INPUT,
    DOWN_PROJECTION,
    KEY,
    MLP_NEURON,
    MLP_OUTPUT,
    QUERY,
    VALUE,
    component_module,
    decoder_layers,
    find_child,
    head_counts,
    heads_of,
    intermediate_size,
    matching_children,
)
from lit_interventions.core.sharding import input_device

OUTPUT_PROJECTION = ("o_proj", "out_proj", "c_proj", "dense", "wo")  # the attention's, heads -> residual
FUSED_QKV = ("qkv", "c_attn", "query_key_value")
PROJECTIONS = {QUERY: ("q_proj", "query"), KEY: ("k_proj", "key"), VALUE: ("v_proj", "value")}
BLOCKS, PER_HEAD = "blocks", "per_head"  # the two layouts of a fused q/k/v projection's output
_LAYOUTS: WeakKeyDictionary = WeakKeyDictionary()  # model -> layout of its fused q/k/v projection


@dataclass(frozen=True)
class Tap:
    """Where a site's state is: the `side` ("input" or "output") of `module`, and among its
    `width` features the site's `columns` (None: all of them)."""

    module: nn.Module
    side: str
    width: int
    columns: torch.Tensor | None = None  # (site width,) feature indices
    where: str = ""  # the module, named for errors


def head_columns(heads: tuple[int, ...], head_dim: int, offset: int = 0, stride: int | None = None) -> torch.Tensor:
    """The feature indices of `heads`, head h at offset + h·stride (stride: head_dim), each
    head_dim wide, in the order of `heads`: (len(heads) · head_dim,)."""
    stride = head_dim if stride is None else stride
    return torch.tensor([offset + h * stride + j for h in heads for j in range(head_dim)], dtype=torch.long)


def down_projection(model: nn.Module, layer: int) -> nn.Module:
    """Block `layer`'s MLP down projection (hidden units -> residual stream): a child of its MLP
    module, or the module `mlp_output` reads itself where the MLP is inline (OPT's fc2)."""
    mlp = component_module(model, layer, MLP_OUTPUT)
    if not any(True for _ in mlp.children()) and mlp.weight.dim() == 2:  # inline: the projection itself
        return mlp
    return getattr(mlp, find_child(mlp, "down projection", DOWN_PROJECTION))


def _attention_parts(model: nn.Module, layer: int) -> tuple[nn.Module, nn.Module]:
    """Block `layer`'s attention module and its output projection."""
    attention = component_module(model, layer, ATTENTION_OUTPUT)
    return attention, getattr(attention, find_child(attention, "attention output projection", OUTPUT_PROJECTION))


class _Stop(Exception):
    pass


@torch.no_grad()
def fused_layout(model: nn.Module, fused: nn.Module, out_projection: nn.Module) -> str:
    """How a fused q/k/v projection lays out its output: `BLOCKS` ([q | k | v], GPT-2) or
    `PER_HEAD` ((heads, 3, head_dim), GPT-NeoX). Measured once per model on one position, where
    attention is a weight of 1 on that position: the output projection's input is then the values,
    head by head, and the one layout whose value part equals it is the model's."""
    if model in _LAYOUTS:
        return _LAYOUTS[model]
    n_heads, n_kv_heads, head_dim = head_counts(model.config)
    seen = {}

    def record(module, args, output):
        seen["qkv"] = (output[0] if isinstance(output, tuple) else output)[0, 0].float()

    def stop(module, args):
        seen["values"] = args[0][0, 0].float().view(n_heads, head_dim)
        raise _Stop

    embeddings = model.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, 1, embeddings.embedding_dim, generator=g).to(input_device(model), embeddings.weight.dtype)
    handles = [fused.register_forward_hook(record), out_projection.register_forward_pre_hook(stop)]
    try:
        model.base_model(inputs_embeds=inputs, attention_mask=torch.ones(1, 1, dtype=torch.long, device=inputs.device))
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    qkv, values = seen["qkv"].cpu(), seen["values"].cpu()
    group = n_heads // n_kv_heads
    candidates = {}
    if qkv.numel() == (n_heads + 2 * n_kv_heads) * head_dim:
        candidates[BLOCKS] = qkv[(n_heads + n_kv_heads) * head_dim :].view(n_kv_heads, head_dim)
    if n_kv_heads == n_heads and qkv.numel() == 3 * n_heads * head_dim:
        candidates[PER_HEAD] = qkv.view(n_heads, 3, head_dim)[:, 2]
    scale = values.abs().max().item() + 1e-12
    found = [
        name
        for name, value in candidates.items()
        if torch.allclose(value.repeat_interleave(group, 0), values, rtol=1e-3, atol=1e-4 * scale)
    ]
    if len(found) != 1:
        raise ValueError(
            f"Cannot split the fused query/key/value projection of {type(model).__name__} "
            f"({type(fused).__name__}, {qkv.numel()} features for {n_heads} query and {n_kv_heads} key/value heads "
            f"of {head_dim}): its output is neither [q | k | v] nor (heads, 3, head_dim). Use attention_head instead."
        )
    _LAYOUTS[model] = found[0]
    return found[0]


def _projection_tap(model: nn.Module, layer: int, component: str, heads: tuple[int, ...]) -> Tap:
    """The output of block `layer`'s q, k or v projection, the columns of `heads`."""
    attention, out_projection = _attention_parts(model, layer)
    n_heads, n_kv_heads, head_dim = head_counts(model.config)
    n = n_heads if component == QUERY else n_kv_heads
    fused = matching_children(attention, FUSED_QKV)
    if len(fused) != 1:
        name = find_child(attention, f"{component} projection", PROJECTIONS[component])
        where = f"{type(attention).__name__}.{name}"
        return Tap(getattr(attention, name), "output", n * head_dim, head_columns(heads, head_dim), where)
    module = getattr(attention, fused[0])
    part = (QUERY, KEY, VALUE).index(component)
    where = f"{type(attention).__name__}.{fused[0]}"
    if fused_layout(model, module, out_projection) == PER_HEAD:
        columns = head_columns(heads, head_dim, offset=part * head_dim, stride=3 * head_dim)
        return Tap(module, "output", 3 * n_heads * head_dim, columns, where)
    offset = (0, n_heads * head_dim, (n_heads + n_kv_heads) * head_dim)[part]
    return Tap(module, "output", (n_heads + 2 * n_kv_heads) * head_dim, head_columns(heads, head_dim, offset), where)


def site_tap(model: nn.Module, layer: int, component: str, head=None) -> Tap:
    """Where `component` of block `layer` is read and written (not `block_output`: see
    `hooks.residual_hook`); `head`: the heads of a head component."""
    hidden = int(model.config.get_text_config().hidden_size)
    if component == BLOCK_INPUT:
        return Tap(decoder_layers(model)[layer], "input", hidden, where=f"block {layer}")
    if component in (ATTENTION_OUTPUT, MLP_OUTPUT):
        module = component_module(model, layer, component)
        return Tap(module, "output", hidden, where=type(module).__name__)
    if component == MLP_NEURON:
        module = down_projection(model, layer)
        return Tap(module, "input", intermediate_size(model.config), where=f"the down projection of block {layer}")
    heads = heads_of(head)
    if component == ATTENTION_HEAD:
        attention, out_projection = _attention_parts(model, layer)
        n_heads, _, head_dim = head_counts(model.config)
        where = f"the output projection of {type(attention).__name__}"
        return Tap(out_projection, "input", n_heads * head_dim, head_columns(heads, head_dim), where)
    return _projection_tap(model, layer, component, heads)


# Attention output projections by architecture, in the order they are tried.
ATTENTION_OUTPUTS = ["o_proj", "out_proj", "attention.dense", "attn.c_proj", "self_attention.dense"]


def attention_output_modules(model: nn.Module) -> list[str]:
    """Suffix names of the attention output projection (the LoRA target), by architecture."""
    names = [name for name, _ in model.named_modules()]
    for suffix in ATTENTION_OUTPUTS:
        if any(name.endswith("." + suffix) for name in names):
            return [suffix]
    raise ValueError(
        f"Cannot find an attention output projection in {type(model).__name__}: "
        f"no module named like {ATTENTION_OUTPUTS}; pass target_modules."
    )
