"""Forward hooks at a site: hand the hidden states of a block's output (or its input, its
attention or MLP module, some heads of its attention, its MLP's hidden units, or the embeddings)
to a callback, and write back the tensor it returns. Where each component is: `parts.py`.

A model spread over devices by a device map (`sharding.py`) computes each block on its own
device: the hooks hand the callback its tensor on the device of the inputs and put what it
returns back on the block's device.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from lit_interventions.core.blocks import BLOCK_OUTPUT, EMBEDDINGS, check_component, check_layer, decoder_layers
from lit_interventions.core.parts import Tap, site_tap
from lit_interventions.core.sharding import input_device, is_dispatched


def hidden_of(output):
    """A module's hidden states: its output, or the first element of a tuple output."""
    return output[0] if isinstance(output, tuple) else output


def with_hidden(output, hidden):
    """`output` with its hidden states (see `hidden_of`) replaced by `hidden`."""
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


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
        new = on_hidden(hidden_of(output))
        return with_hidden(output, new) if new is not None else None

    handle = module.register_forward_hook(post_hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _input_hook(module: nn.Module, on_hidden: Callable[[torch.Tensor], torch.Tensor | None]):
    """Call `on_hidden(h)` on the module's input (its first argument, or `hidden_states`); a
    returned tensor replaces it."""

    def pre_hook(module, args, kwargs):
        if args:
            new = on_hidden(args[0])
            return ((new,) + tuple(args[1:]), kwargs) if new is not None else None
        new = on_hidden(kwargs["hidden_states"])
        return (args, {**kwargs, "hidden_states": new}) if new is not None else None

    handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _block_shape(block: nn.Module, shape: dict):
    """Record (batch, seq) of the block's input in `shape["rows"]` on every forward: a module that
    sees the tokens flattened (OPT's fc1 and fc2: (batch · seq, d)) is viewed by it."""

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        shape["rows"] = tuple(hidden.shape[:2])

    handle = block.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _on_columns(on_hidden: Callable, tap: Tap, shape: dict) -> Callable:
    """`on_hidden` on the tap's columns of the module's features, (batch, seq, site width); what
    it returns is written back into those columns, the others kept. Flattened tokens (batch · seq,
    width) are viewed as (batch, seq, width) by the block's input shape (`_block_shape`)."""

    def picked(hidden):  # (batch, seq, tap.width) or (batch · seq, tap.width)
        if hidden.dim() == 2:
            new = picked(hidden.view(*shape["rows"], hidden.shape[-1]))
            return None if new is None else new.reshape(hidden.shape)
        if hidden.shape[-1] != tap.width:
            raise ValueError(
                f"{tap.where} has {hidden.shape[-1]} features, not the {tap.width} the model's config gives: "
                "this site cannot be read on this architecture."
            )
        if tap.columns is None:
            return on_hidden(hidden)
        columns = tap.columns.to(hidden.device)
        new = on_hidden(hidden[..., columns])
        if new is None:
            return None
        hidden = hidden.clone()
        hidden[..., columns] = new.to(hidden.dtype)
        return hidden

    return picked


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
    with _input_hook(blocks[0], on_hidden) if layer == EMBEDDINGS else _output_hook(blocks[layer], on_hidden):
        yield


@contextmanager
def site_hook(
    model: nn.Module,
    layer: int,
    component: str,
    on_hidden: Callable[[torch.Tensor], torch.Tensor | None],
    device: torch.device | None = None,
    head=None,
):
    """Call `on_hidden(h)` on `component` of block `layer`, (batch, seq, d), d the site's width
    (`blocks.site_width`: head_dim × heads for a head component, the MLP's hidden units for
    `mlp_neuron`); a returned tensor replaces it. `head`: the head or heads of a head component.
    `block_output` is `residual_hook`. `device`: as `residual_hook`."""
    check_component(layer, component, len(decoder_layers(model)), head, model.config)
    if component == BLOCK_OUTPUT:
        with residual_hook(model, layer, on_hidden, device):
            yield
        return
    tap, shape = site_tap(model, layer, component, head), {}
    on_tap = _on_columns(_at_home(on_hidden, _home(model, device)), tap, shape)
    with (
        _block_shape(decoder_layers(model)[layer], shape),
        (_input_hook if tap.side == "input" else _output_hook)(tap.module, on_tap),
    ):
        yield
