"""Reading and writing the residual stream on tiny models of every supported architecture."""

import pytest
import torch

from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.forward import logits_at, read_site
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from tests.conftest import ARCHS, HIDDEN, LAYERS
from tests.helpers import token_batch as _batch


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_layers_found_generically(tiny_lm, arch):
    model = tiny_lm(arch)
    assert len(decoder_layers(model)) == LAYERS


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_at_matches_full_forward(tiny_lm, arch):
    """Our last-position logits equal the model's own (final norm, LM head, Gemma 2 soft-capping)."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(5, 5, 5))
    full = model(input_ids=ids, attention_mask=mask).logits
    ours = logits_at(model, ids, mask, last)
    torch.testing.assert_close(ours, full[torch.arange(3), last], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_of_chosen_tokens_equal_those_columns_of_the_full_logits(tiny_lm, arch):
    """`vocab` computes only some rows of the LM head (with Gemma's soft-capping) per example."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size)
    vocab = torch.tensor([[5, 9], [9, 5], [7, 7]])
    edit = lambda h: h + 3.0  # noqa: E731
    for kwargs in ({}, {"layer": 1, "site_positions": last - 1, "intervention": edit}):
        full = logits_at(model, ids, mask, last, **kwargs)
        chosen = logits_at(model, ids, mask, last, vocab=vocab, **kwargs)
        assert chosen.shape == (3, 2)
        torch.testing.assert_close(chosen, full.gather(1, vocab), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_and_right_padding_agree(tiny_lm, arch):
    model = tiny_lm(arch)
    right = _batch(model.config.vocab_size, padding_side="right")
    left = _batch(model.config.vocab_size, padding_side="left")
    torch.testing.assert_close(logits_at(model, *right), logits_at(model, *left), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma3"])
@pytest.mark.parametrize("layer", [-1, 0, LAYERS - 2])  # hidden_states[-1] has the final norm applied
def test_read_site_matches_hidden_states(tiny_lm, arch, layer):
    """Layer l is the output of block l; layer -1 is the embedding output (hidden_states[0])."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(5, 5, 5))
    positions = torch.tensor([1, 4, 2])
    states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    expected = states[layer + 1][torch.arange(3), positions]
    torch.testing.assert_close(read_site(model, layer, ids, mask, positions), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_direction_leaves_logits_unchanged(tiny_lm, arch):
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(5, 6, 4))
    src_ids, src_mask, _ = _batch(model.config.vocab_size, lengths=(5, 6, 4), seed=1)
    positions = torch.tensor([2, 3, 1])
    source = read_site(model, 1, src_ids, src_mask, positions)
    zero = FixedSubspaceIntervention(torch.zeros(1, HIDDEN))
    clean = logits_at(model, ids, mask, last)
    intervened = logits_at(model, ids, mask, last, 1, positions, lambda h: zero(h, source))
    torch.testing.assert_close(intervened, clean)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_swap_reproduces_the_source_run(tiny_lm, arch):
    """Interchanging the whole space at the last token makes the base compute the source's
    last-token state from there on, so with equal prefixes the logits become the source's."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(5, 5, 5))
    src = ids.clone()
    src[:, -1] = (ids[:, -1] + 1 - 3) % (model.config.vocab_size - 3) + 3  # differ in the last token only
    source = read_site(model, 0, src, mask, last)
    everything = FixedSubspaceIntervention(torch.eye(HIDDEN))
    clean = logits_at(model, ids, mask, last)
    swapped = logits_at(model, ids, mask, last, 0, last, lambda h: everything(h, source))
    torch.testing.assert_close(swapped, logits_at(model, src, mask, last), rtol=1e-4, atol=1e-5)
    assert (swapped - clean).abs().max() > 1e-3  # and the intervention really changed the output


def test_rotation_has_orthonormal_rows():
    rotation = RotatedSpaceIntervention(HIDDEN, k=4)
    basis = rotation.basis
    torch.testing.assert_close(basis @ basis.T, torch.eye(4), rtol=1e-5, atol=1e-5)


def test_layer_out_of_range_names_the_count(tiny_lm):
    model = tiny_lm("llama")
    ids, mask, last = _batch(model.config.vocab_size)
    with pytest.raises(ValueError, match=f"has {LAYERS} layers"):
        read_site(model, LAYERS, ids, mask, last)
