"""Our hooks + RotatedSpaceIntervention give the same outputs as pyvene's
LowRankRotatedSpaceIntervention for the same parameters, at every component pyvene names
(`PYVENE_NAMES`): block_output, attention_output and mlp_output (Llama, GPT-NeoX), and the fine
sites block_input, attention_head, query, key, value and mlp_neuron on each architecture pyvene
maps them for."""

import pytest
import torch

pyvene = pytest.importorskip("pyvene")

from lit_interventions.core.blocks import HEAD_COMPONENTS, PYVENE_NAMES, site_width  # noqa: E402
from lit_interventions.core.forward import logits_at, read_site  # noqa: E402
from lit_interventions.interventions.rotation import RotatedSpaceIntervention  # noqa: E402
from tests.conftest import HIDDEN  # noqa: E402

# pyvene's head_{query,key,value}_output are commented out for GPT-NeoX; its mlp_activation is the
# down projection's input only where nothing multiplies the activation (not Llama's or Gemma's gate)
FINE = [
    *[(arch, c) for arch in ("llama", "gpt_neox", "gpt2", "gemma2") for c in ("block_input", "attention_head")],
    *[(arch, c) for arch in ("llama", "gpt2", "gemma2") for c in ("query", "key", "value")],
    ("gpt2", "mlp_neuron"),
    ("gpt_neox", "mlp_neuron"),
]


def _pyvene_logits(model, layer, component, k, weight, base, source, base_pos, source_pos, heads=None):
    """pyvene's intervened logits at the last position, its rotation's weight (d, k) set to `weight`;
    `heads`: pyvene's "h.pos" unit, the same heads in every row."""
    representation = {"layer": layer, "component": PYVENE_NAMES[component], "low_rank_dimension": k}
    if heads is not None:  # its state: the heads' concatenation, max_number_of_units × head_dim wide
        representation.update(unit="h.pos", max_number_of_units=len(heads))
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(**representation)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    pv_intervention = next(iter(intervenable.interventions.values()))
    pv_intervention = pv_intervention[0] if isinstance(pv_intervention, (tuple, list)) else pv_intervention
    with torch.no_grad():  # its orthogonal parametrization keeps the weight
        pv_intervention.rotate_layer.weight = weight.clone()
    torch.testing.assert_close(pv_intervention.rotate_layer.weight, weight)

    def where(positions):
        rows = [[p] for p in positions.tolist()]
        return [[[list(heads)] * len(rows), rows]] if heads is not None else [rows]

    _, out = intervenable(
        {"input_ids": base, "attention_mask": torch.ones_like(base)},
        [{"input_ids": source, "attention_mask": torch.ones_like(source)}],
        unit_locations={"sources->base": (where(source_pos), where(base_pos))},
    )
    return out.logits[:, -1]


def _inputs(model, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, model.config.vocab_size, (3, 6), generator=g)
    source = torch.randint(3, model.config.vocab_size, (3, 6), generator=g)
    return base, source, torch.tensor([1, 3, 5]), torch.tensor([2, 0, 5])


def _our_logits(model, layer, component, ours, base, source, base_pos, source_pos, head=None):
    mask, last = torch.ones_like(base), torch.full((len(base),), base.shape[1] - 1)
    source_state = read_site(model, layer, source, mask, source_pos, component=component, head=head)
    intervened = logits_at(
        model, base, mask, last, layer, base_pos, lambda h: ours(h, source_state), component=component, head=head
    )
    return intervened, logits_at(model, base, mask, last)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("component", ["block_output", "attention_output", "mlp_output"])
@pytest.mark.parametrize("layer,k", [(0, 1), (1, 1), (2, 3)])
def test_matches_pyvene_low_rank_rotation(tiny_lm, arch, component, layer, k):
    model = tiny_lm(arch)
    base, source, base_pos, source_pos = _inputs(model, layer * 10 + k)
    ours = RotatedSpaceIntervention(HIDDEN, k)
    theirs = _pyvene_logits(model, layer, component, k, ours.basis.detach().T, base, source, base_pos, source_pos)
    our_logits, clean = _our_logits(model, layer, component, ours, base, source, base_pos, source_pos)
    torch.testing.assert_close(our_logits, theirs, rtol=1e-4, atol=1e-5)
    assert (our_logits - clean).abs().max() > 1e-4  # the intervention did something


@pytest.mark.parametrize("arch,component", FINE)
@pytest.mark.parametrize("layer,k", [(0, 1), (2, 3)])
def test_fine_sites_match_pyvene(tiny_lm, arch, component, layer, k):
    """One head (head 1) for the head components: pyvene's "h.pos" unit."""
    model = tiny_lm(arch)
    base, source, base_pos, source_pos = _inputs(model, layer * 10 + k)
    head = 1 if component in HEAD_COMPONENTS else None
    ours = RotatedSpaceIntervention(site_width(model.config, component, head), k)
    theirs = _pyvene_logits(
        model,
        layer,
        component,
        k,
        ours.basis.detach().T,
        base,
        source,
        base_pos,
        source_pos,
        None if head is None else [head],
    )
    our_logits, clean = _our_logits(model, layer, component, ours, base, source, base_pos, source_pos, head)
    torch.testing.assert_close(our_logits, theirs, rtol=1e-4, atol=1e-5)
    assert not torch.equal(our_logits, clean)  # the intervention did something


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("component,heads", [("attention_head", [2, 0]), ("query", [3, 1]), ("value", [1, 0])])
def test_several_heads_match_pyvene(tiny_lm, arch, component, heads):
    """Several heads: pyvene's state is their concatenation in the order given, as ours."""
    model = tiny_lm(arch)
    base, source, base_pos, source_pos = _inputs(model, 7)
    ours = RotatedSpaceIntervention(site_width(model.config, component, heads), 3)
    theirs = _pyvene_logits(model, 1, component, 3, ours.basis.detach().T, base, source, base_pos, source_pos, heads)
    our_logits, clean = _our_logits(model, 1, component, ours, base, source, base_pos, source_pos, heads)
    torch.testing.assert_close(our_logits, theirs, rtol=1e-4, atol=1e-5)
    assert not torch.equal(our_logits, clean)
