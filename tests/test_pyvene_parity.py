"""Our hooks + RotatedSpaceIntervention give the same outputs as pyvene's
LowRankRotatedSpaceIntervention for the same parameters (Llama and GPT-NeoX), at pyvene's
block_output, attention_output and mlp_output."""

import pytest
import torch

pyvene = pytest.importorskip("pyvene")

from lit_interventions.core.sites import logits_at, read_site  # noqa: E402
from lit_interventions.interventions import RotatedSpaceIntervention  # noqa: E402
from tests.conftest import HIDDEN  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("component", ["block_output", "attention_output", "mlp_output"])
@pytest.mark.parametrize("layer,k", [(0, 1), (1, 1), (2, 3)])
def test_matches_pyvene_low_rank_rotation(tiny_lm, arch, component, layer, k):
    model = tiny_lm(arch)
    g = torch.Generator().manual_seed(layer * 10 + k)
    base = torch.randint(3, model.config.vocab_size, (3, 6), generator=g)
    source = torch.randint(3, model.config.vocab_size, (3, 6), generator=g)
    mask = torch.ones_like(base)
    base_pos, source_pos = torch.tensor([1, 3, 5]), torch.tensor([2, 0, 5])

    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(layer=layer, component=component, low_rank_dimension=k)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    pv_intervention = next(iter(intervenable.interventions.values()))
    pv_intervention = pv_intervention[0] if isinstance(pv_intervention, (tuple, list)) else pv_intervention

    ours = RotatedSpaceIntervention(HIDDEN, k)
    with torch.no_grad():  # pyvene's weight is (d, k) = Wᵀ; its orthogonal parametrization keeps it
        pv_intervention.rotate_layer.weight = ours.basis.detach().T.clone()
    torch.testing.assert_close(pv_intervention.rotate_layer.weight, ours.basis.detach().T)

    locations = {"sources->base": ([[[p] for p in source_pos.tolist()]], [[[p] for p in base_pos.tolist()]])}
    _, pv_out = intervenable(
        {"input_ids": base, "attention_mask": mask},
        [{"input_ids": source, "attention_mask": mask}],
        unit_locations=locations,
    )
    last = torch.full((3,), 5)
    source_state = read_site(model, layer, source, mask, source_pos, component=component)
    our_logits = logits_at(
        model, base, mask, last, layer, base_pos, lambda h: ours(h, source_state), component=component
    )
    torch.testing.assert_close(our_logits, pv_out.logits[:, -1], rtol=1e-4, atol=1e-5)
    clean = logits_at(model, base, mask, last)
    assert (our_logits - clean).abs().max() > 1e-4  # the intervention did something
