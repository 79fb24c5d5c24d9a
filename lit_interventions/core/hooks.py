"""Forward hooks at a site: hand the hidden states of a block's output (or of its attention or
MLP module, or the embeddings) to a callback, and write back the tensor it returns.

A model spread over devices by a device map (`sharding.py`) computes each block on its own
device: the hooks hand the callback its tensor on the device of the inputs and put what it
returns back on the block's device.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from lit_interventions.core.blocks import (
    BLOCK_OUTPUT,
    EMBEDDINGS,
    check_component,
    check_layer,
    component_module,
    decoder_layers,
)
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
    check_component(layer, component, len(decoder_layers(model)))
    if component == BLOCK_OUTPUT:
        hook = residual_hook(model, layer, on_hidden, device)
    else:
        hook = _output_hook(component_module(model, layer, component), _at_home(on_hidden, _home(model, device)))
    with hook:
        yield
