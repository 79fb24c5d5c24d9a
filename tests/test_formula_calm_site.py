"""The CALM site (`studies/calm.py`), by hand: the state an attack edits is the residual stream
after block `layer` (default: the middle block, `core.blocks.site_layer`) at the entity's last
token, and the LM's logits change only through that one state, as docs/calm.md says.

A planted attack moves every state by one fixed δ, h′ = h + δ (δ nonzero, written at the site
alone). The study runs with it on the tiny llama; each batch it scores is caught where the study
records it (`record`: h′, the clean and the edited logits). The test recomputes both logits with
its own hook on the decoder block: the clean forward, and the forward whose state after block
`layer` at the hand-found entity token is replaced by h′ and nothing else; they must equal the
study's. The same δ written one token earlier, or one block higher, gives other logits: the
comparison sees where the edit lands."""

import torch

from lit_interventions.core.lm import load_config, load_lm, num_layers
from lit_interventions.interventions.base import Intervention
from lit_interventions.studies import calm
from tests.helpers import CALM_SMALL

DELTA_SEED = 0


class PlantedDelta(Intervention):
    """h′ = h + δ, one fixed δ (seeded, every coordinate nonzero): an attack that ignores the probe."""

    edits_base_alone = True

    def forward(self, base, source=None, *, probe, target, epsilon):
        delta = torch.randn(base.shape[-1], generator=torch.Generator().manual_seed(DELTA_SEED)) + 2.0
        return base + delta.to(base)


def _block_output(output):
    return output[0] if isinstance(output, tuple) else output


def _logits(model, ids: list[int], layer: int | None = None, at: int | None = None, state=None) -> torch.Tensor:
    """Next-token logits at the last token; with `state`, the residual stream after block
    `layer` at position `at` replaced by it (this test's own hook)."""

    def write(module, inputs, output):
        hidden = _block_output(output).clone()
        hidden[0, at] = state
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = None if state is None else model.model.layers[layer].register_forward_hook(write)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    finally:
        if handle is not None:
            handle.remove()


def test_the_default_layer_is_the_middle_block(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    n = num_layers(load_config(lm))
    plan = calm.plan_calm(calm.CalmArgs(lm=lm, tasks=["Country"], **{**CALM_SMALL, "layer": None}))
    assert plan.layer == n // 2


def test_the_attack_edits_the_entitys_last_token_after_the_layer_alone(tiny_lm_dir, tokenizer, tmp_path, monkeypatch):
    lm, layer = tiny_lm_dir("llama"), CALM_SMALL["layer"]
    seen = []
    recorded = calm.record

    def catch(t, batch, probes, prop, target, moved, clean, edited, *args, **kwargs):
        seen.append((batch, moved.clone(), clean.clone(), edited.clone()))
        return recorded(t, batch, probes, prop, target, moved, clean, edited, *args, **kwargs)

    monkeypatch.setattr(calm, "record", catch)
    planted = {"name": "planted", "model": {"class_path": f"{__name__}.PlantedDelta"}}
    calm.run_calm(lm=lm, tasks=["Country"], methods=[planted], out=str(tmp_path), **CALM_SMALL)
    delta = torch.randn(seen[0][0].h.shape[-1], generator=torch.Generator().manual_seed(DELTA_SEED)) + 2.0
    ours = [s for s in seen if torch.allclose(s[1] - s[0].h, delta.expand_as(s[0].h), atol=1e-5)]
    assert ours  # the planted attack's batches (the random control's are the others)
    model = load_lm(lm)
    checked = 0
    for batch, moved, clean, edited in ours:
        for row, prompt in enumerate(batch.prompts):
            ids = batch.ids[row, : int(batch.mask[row].sum())].tolist()
            # the site by hand: the token that completes the entity's name
            assert prompt.last == len(ids) - 1
            assert tokenizer.decode(ids[: prompt.site + 1]).endswith(prompt.entity)
            assert not tokenizer.decode(ids[: prompt.site]).endswith(prompt.entity)
            torch.testing.assert_close(clean[row], _logits(model, ids), atol=1e-4, rtol=1e-4)
            by_hand = _logits(model, ids, layer, prompt.site, moved[row])
            torch.testing.assert_close(edited[row], by_hand, atol=1e-4, rtol=1e-4)
            assert not torch.allclose(edited[row], clean[row], atol=1e-3)  # the edit does change the logits
            earlier = _logits(model, ids, layer, prompt.site - 1, moved[row])
            higher = _logits(model, ids, layer + 1, prompt.site, moved[row])
            assert not torch.allclose(edited[row], earlier, atol=1e-3)
            assert not torch.allclose(edited[row], higher, atol=1e-3)
            checked += 1
    assert checked >= CALM_SMALL["entities"]["test"]
