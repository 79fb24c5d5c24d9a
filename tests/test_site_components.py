"""Sites at a block's attention and MLP outputs, not only the residual stream: the modules are
found generically, checked here against each architecture's real submodule, and DAS there agrees
with pyvene."""

import pytest
import torch
from torch import nn

from lit_interventions.core.blocks import _child_name
from lit_interventions.core.forward import logits_at, position_ids, read_site
from lit_interventions.core.sites import Site
from tests.conftest import ARCHS, HIDDEN, LAYERS
from tests.helpers import token_batch as _batch

SUB_BLOCK = ["attention_output", "mlp_output"]


def _real_module(model, arch, layer, component):
    """The submodule named by hand for each architecture, to check the generic finder against."""
    blocks = {"gpt_neox": "gpt_neox.layers", "gpt2": "transformer.h"}.get(arch, "model.layers")
    blocks = model.get_submodule(blocks)
    attention = {"gpt_neox": "attention", "gpt2": "attn"}.get(arch, "self_attn")
    return getattr(blocks[layer], attention if component == "attention_output" else "mlp")


def test_site_defaults_to_the_residual_stream_at_a_region():
    site = Site(2)
    assert (site.component, site.position, site.region) == ("block_output", "region", None)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"component": "mlp_out"},
            r"component='mlp_out' is not one of: block_output, attention_output, mlp_output, block_input, attention_head",
        ),
        ({"position": "first"}, r"position='first' is not one of: region, last, response"),
        ({"position": "last", "region": "object"}, r"region='object' is only read with position='region'"),
    ],
)
def test_site_names_the_bad_value_and_the_allowed_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Site(0, **kwargs)


def test_site_check_allows_the_embeddings_only_for_the_residual_stream():
    Site(-1).check(LAYERS)
    with pytest.raises(
        ValueError, match=r"layer=-1 \(the embeddings\) has only block_output, not component='mlp_output'"
    ):
        Site(-1, "mlp_output").check(LAYERS)
    with pytest.raises(ValueError, match=f"has {LAYERS} layers"):
        Site(LAYERS, "attention_output").check(LAYERS)


def test_finder_refuses_a_block_without_exactly_one_match():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_a, self.attn_b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.attn_norm = nn.LayerNorm(2)  # a norm is never the attention module

    with pytest.raises(ValueError, match=r"attention_output module of Block: 2 of its children"):
        _child_name(Block(), "attention_output")
    with pytest.raises(ValueError, match=r"mlp_output module of Block: 0 of its children"):
        _child_name(Block(), "mlp_output")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("component", SUB_BLOCK)
def test_read_site_equals_a_hook_on_the_real_submodule(tiny_lm, arch, padding_side, component):
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, padding_side=padding_side)
    for layer in range(LAYERS):
        captured = {}

        def capture(module, args, output):  # returns None: the output is kept
            captured["h"] = output[0] if isinstance(output, tuple) else output  # (batch, seq, d)

        handle = _real_module(model, arch, layer, component).register_forward_hook(capture)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
        handle.remove()
        for positions in (last, last - 1):
            expected = captured["h"][torch.arange(3), positions]  # (batch, d)
            torch.testing.assert_close(read_site(model, layer, ids, mask, positions, component=component), expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("component", SUB_BLOCK)
def test_writing_back_the_own_state_changes_nothing_and_a_source_state_does(tiny_lm, arch, component):
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(5, 6, 4))
    src_ids, src_mask, _ = _batch(model.config.vocab_size, lengths=(5, 6, 4), seed=1)
    positions, layer = last - 1, 1
    clean = logits_at(model, ids, mask, last)
    identity = logits_at(model, ids, mask, last, layer, positions, lambda h: h, component=component)
    torch.testing.assert_close(identity, clean)
    own = read_site(model, layer, ids, mask, positions, component=component)
    torch.testing.assert_close(
        logits_at(model, ids, mask, last, layer, positions, lambda h: own, component=component), clean
    )
    source = read_site(model, layer, src_ids, src_mask, positions, component=component)
    swapped = logits_at(model, ids, mask, last, layer, positions, lambda h: source, component=component)
    assert (swapped - clean).abs().max() > 1e-3


def test_the_cached_fast_path_is_for_the_residual_stream_only(tiny_lm):
    model = tiny_lm("llama")
    ids, mask, last = _batch(model.config.vocab_size)
    states = torch.zeros(3, ids.shape[1], HIDDEN)
    with pytest.raises(ValueError, match="start_states need component='block_output', not 'mlp_output'"):
        logits_at(model, ids, mask, last, 1, last, lambda h: h, start_states=states, component="mlp_output")
