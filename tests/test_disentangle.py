"""RAVEL's objective and metrics: DBM's mask against pyvene, Cause / Iso / Disentangle by hand,
the multi-task loss by hand, and the interchange module with RAVEL's objective on a tiny model."""

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_interventions.callbacks.metrics import DisentangleCallback
from lit_interventions.core.batch import CAUSE, ISO, PairBatch, Side
from lit_interventions.interventions.featurizers import FeatureInterchange, FullVectorSwap
from lit_interventions.interventions.fitted import FeatureInterchangeFit
from lit_interventions.interventions.mask import SigmoidMaskIntervention, linear_temperature
from lit_interventions.metrics.disentangle import Disentanglement
from lit_interventions.modules.generation import greedy_answers
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.objectives import CauseIsoLoss, multitask_loss


def test_mask_matches_pyvene_sigmoid_mask():
    from pyvene import SigmoidMaskIntervention as PyveneMask

    torch.manual_seed(0)
    ours = SigmoidMaskIntervention(8, temperature=0.5)
    theirs = PyveneMask(embed_dim=8)
    mask = torch.randn(8)
    ours.mask.data.copy_(mask)
    theirs.mask.data.copy_(mask)
    theirs.set_temperature(torch.tensor(0.5))
    base, source = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(ours(base, source), theirs(base, source))


def test_mask_starts_half_and_anneals_to_binary():
    mask = SigmoidMaskIntervention(4)
    base, source = torch.zeros(1, 4), torch.ones(1, 4)
    assert torch.allclose(mask(base, source), torch.full((1, 4), 0.5))  # m = 0: σ = ½
    mask.mask.data = torch.tensor([1e-3, -1e-3, 2e-3, -5e-4])
    mask.temperature.fill_(1e-7)
    assert mask(base, source).tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert mask.penalty().item() == pytest.approx(2.0)
    assert linear_temperature(0, 11) == pytest.approx(1e-2)
    assert linear_temperature(10, 11) == pytest.approx(1e-7)
    assert linear_temperature(5, 11) == pytest.approx((1e-2 + 1e-7) / 2)


@pytest.mark.parametrize("average", ["templates", "examples"])
def test_disentanglement_by_hand(average):
    metric = Disentanglement(3, average=average)  # one group per attribute: both averages agree
    predicted = torch.tensor([1, 2, 0, 3, 3, 1])  # first-token rule: one generated token each
    label = torch.tensor([1, 1, 0, 3, 2, 1])  # correct: yes, no, yes, yes, no, yes
    base_label = torch.tensor([0, 0, 0, 3, 2, 2])  # changed: yes, yes, no, no, yes, yes
    attribute = torch.tensor([0, 0, 1, 1, 2, 2])
    kind = torch.tensor([CAUSE, CAUSE, ISO, ISO, ISO, ISO])
    metric.update(predicted[:3], label[:3], base_label[:3], attribute[:3], kind[:3])
    metric.update(predicted[3:], label[3:], base_label[3:], attribute[3:], kind[3:])
    values = metric.compute()
    assert values["cause"].item() == pytest.approx(1 / 2)
    # Iso: attribute 1 has 2/2 right, attribute 2 has 1/2: mean 0.75
    assert values["iso_per_attribute"][1:].tolist() == pytest.approx([1.0, 0.5])
    assert values["iso"].item() == pytest.approx(0.75)
    assert values["disentangle"].item() == pytest.approx((0.5 + 0.75) / 2)
    assert values["change_rate"].tolist() == pytest.approx([1.0, 0.0, 1.0])


def test_disentanglement_states_merge_like_ddp():
    torch.manual_seed(0)
    generated, label, base_label = torch.randint(3, (20, 3)), torch.randint(3, (20, 2)), torch.randint(3, (20, 2))
    group, kind = torch.randint(5, (20,)), torch.randint(2, (20,))
    groups = [0, 0, 1, 2, 2]  # the attribute of each of 5 templates
    attribute = torch.tensor(groups)[group]
    whole, half_a, half_b = (Disentanglement(3, groups) for _ in range(3))
    whole.update(generated, label, base_label, attribute, kind, group)
    half_a.update(generated[:7], label[:7], base_label[:7], attribute[:7], kind[:7], group[:7])
    half_b.update(generated[7:], label[7:], base_label[7:], attribute[7:], kind[7:], group[7:])
    half_a.merge_state(half_b)
    for key, value in whole.compute().items():
        torch.testing.assert_close(value, half_a.compute()[key], equal_nan=True)


def test_multitask_loss_by_hand():
    torch.manual_seed(0)
    logits, label = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 4])
    attribute, kind = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([CAUSE, CAUSE, ISO, ISO, ISO])
    ce = F.cross_entropy(logits, label, reduction="none")
    cause = ce[:2].mean()
    iso = (ce[2:4].mean() + ce[4]) / 2  # mean over attributes, not examples
    assert multitask_loss(logits, label, attribute, kind, multitask=False).item() == pytest.approx(cause.item())
    assert multitask_loss(logits, label, attribute, kind, multitask=True).item() == pytest.approx((cause + iso).item())


def test_bad_options(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match="featurizer='sae' needs sae=PATH"):
        InterchangeModule(lm=lm, layer=1, intervention=partial(FeatureInterchangeFit, featurizer="sae"))
    with pytest.raises(ValueError, match="featurizer='rlap' is not one of pca, sae"):
        FeatureInterchangeFit(8, featurizer="rlap")
    with pytest.raises(ValueError, match="sparsity=-1"):
        CauseIsoLoss(sparsity=-1)
    with pytest.raises(ValueError, match="start >= end > 0"):
        SigmoidMaskIntervention(8, temperature=1e-7, temperature_end=1e-2)
    with pytest.raises(ValueError, match="out of range"):
        InterchangeModule(lm=lm, layer=9)


def test_sparsity_needs_a_mask():
    side = Side.of(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="needs an intervention with a penalty"):
        CauseIsoLoss(sparsity=1e-3)(
            torch.zeros(1, 4),
            PairBatch(side, side, torch.tensor([0]), torch.tensor([CAUSE]), torch.tensor([0])),
            FullVectorSwap(),
        )


def test_mask_temperature_anneals_linearly():
    mask = SigmoidMaskIntervention(4, temperature=1e-2, temperature_end=1e-7)
    mask.anneal(0, 11)
    assert mask.temperature.item() == pytest.approx(1e-2)
    mask.anneal(5, 11)
    assert mask.temperature.item() == pytest.approx((1e-2 + 1e-7) / 2)
    mask.anneal(10, 11)
    assert mask.temperature.item() == pytest.approx(1e-7)


def _batch(tokenizer):
    """Two Cause and two Iso examples over made-up sentences (token ids from the tiny tokenizer)."""
    texts = ["The dog is here.", "the keys to the cabinet", "The dog is", "the author"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in ids])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in ids])
    last = torch.tensor([len(seq) - 1 for seq in ids])
    base = Side(input_ids, mask, last, last, label=torch.tensor([9, 10, 7, 8]))
    source = Side(input_ids.flip(0), mask.flip(0), last.flip(0), last.flip(0))
    return PairBatch(
        base,
        source,
        target=torch.tensor([5, 6, 7, 8]),
        kind=torch.tensor([CAUSE, CAUSE, ISO, ISO]),
        attribute=torch.tensor([0, 0, 1, 2]),
    )


def test_full_swap_equals_vanilla_interchange_and_das_changes_output(tiny_lm_dir, tokenizer):
    lm = tiny_lm_dir("gemma3")
    batch = _batch(tokenizer)
    swap = InterchangeModule(
        lm=lm, layer=2, intervention=FullVectorSwap, objective=CauseIsoLoss(), cache=False
    )  # the last block
    assert isinstance(swap.intervention, FullVectorSwap)
    das = InterchangeModule(lm=lm, layer=0, k=4, objective=CauseIsoLoss(), cache=False)
    clean = swap.clean_logits(batch)
    swapped, rotated = swap.intervened_logits(batch), das.intervened_logits(batch)
    assert (swapped - clean).abs().max() > 1e-4 and (rotated - clean).abs().max() > 1e-4
    # the site is the last token after the last block, so f* = f(s) gives exactly the source's
    # own next-token logits
    source_batch = PairBatch(batch.source, batch.source, batch.target, batch.kind, batch.attribute)
    torch.testing.assert_close(swapped, swap.clean_logits(source_batch))


@pytest.mark.parametrize("method,multitask", [("das", False), ("das", True), ("dbm", True)])
def test_training_steps_lower_the_loss(tiny_lm_dir, tokenizer, method, multitask):
    torch.manual_seed(0)
    intervention = partial(SigmoidMaskIntervention) if method == "dbm" else None
    module = InterchangeModule(
        lm=tiny_lm_dir("llama"),
        layer=0,
        intervention=intervention,
        k=8,
        objective=CauseIsoLoss(multitask, sparsity=1e-3 if method == "dbm" else 0.0),
        cache=False,
    )
    batch = _batch(tokenizer)
    optimizer = torch.optim.Adam(module.intervention.parameters(), lr=0.5 if method == "dbm" else 0.05)
    losses = []
    if method == "dbm":
        module.intervention.temperature.fill_(1.0)
    for _ in range(15):
        logits = module.intervened_logits(batch)
        loss = module.objective(logits, batch, module.intervention)
        expected = multitask_loss(logits, batch.target, batch.attribute, batch.kind, multitask)
        if method == "dbm":
            expected = expected + 1e-3 * module.intervention.penalty()
        assert loss.item() == pytest.approx(expected.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # a mask only mixes the two states per dimension, so it reaches less than a subspace
    assert losses[-1] < losses[0] - (0.2 if method == "dbm" else 0.5), losses
    metric = Disentanglement(3)
    module.eval_outputs.add("generated")  # what the DisentangleCallback asks for
    outputs = module.validation_step(batch, 0)  # the standard output the DisentangleCallback reads
    DisentangleCallback().update(metric, outputs, batch)
    assert torch.equal(outputs["generated"], outputs["intervened"].argmax(-1)[:, None])  # no answers: 1 token
    expected = (outputs["intervened"].argmax(-1) == batch.target).float()
    assert metric.compute()["cause"].item() == pytest.approx(expected[:2].mean().item())
    assert metric.count.sum().item() == 4


def _plant_answers(monkeypatch) -> list:
    """A tiny random model answers no RAVEL query (Cause = Iso = 0, which a broken metric matches
    too), so plant a signal: in each validation batch, rows 1, 2, 4, 5, ... get the module's own
    intervened 3-token generation as their label, every third row of those its first token only
    (a label shorter than 3 tokens). Returns the (generated, label, attribute, kind, template) of
    every row of the last validation epoch, for Cause / Iso by hand."""
    seen = []
    original = InterchangeModule.validation_step

    def validation_step(self, batch, batch_idx):
        generated = greedy_answers(self, batch)
        assert generated.shape[1] == batch.answers.shape[-1]  # as many tokens as the widest label
        rows = torch.arange(len(generated), device=generated.device)
        short = torch.where(rows[:, None] % 6 == 1, torch.tensor([0, -100, -100], device=rows.device), 0)
        planted = torch.where(short < 0, short, generated)
        batch.answers[:, 0] = torch.where((rows % 3 != 0)[:, None], planted, batch.answers[:, 0])
        if batch_idx == 0:
            seen.clear()
        if not self.trainer.sanity_checking:
            fields = (generated, batch.answers[:, 0], batch.attribute, batch.kind, batch.group)
            seen.extend(zip(*(t.tolist() for t in fields)))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(InterchangeModule, "validation_step", validation_step)
    return seen


def _official_hit(generated, label) -> bool:
    """The official `compute_metrics` on one row: every label token (−100: padding, a match)
    equals the generated token at its place."""
    return all(t < 0 or t == g for g, t in zip(generated, label))


def _cause_iso_by_hand(seen, attributes) -> dict:
    """The official `compute_disentangle_score`: accuracy per template, the mean over an
    attribute's templates, Cause the mean over the attributes with Cause rows (one: the target),
    Iso the mean over the attributes with Iso rows."""
    per_template = {}
    for generated, label, attribute, kind, template in seen:
        per_template.setdefault((kind, attribute, template), []).append(_official_hit(generated, label))
    per_attribute = {}
    for (kind, attribute, _), hits in per_template.items():
        per_attribute.setdefault((kind, attributes[attribute]), []).append(sum(hits) / len(hits))
    mean = {key: sum(v) / len(v) for key, v in per_attribute.items()}
    cause = [v for (kind, _), v in mean.items() if kind == CAUSE]
    iso = {a: v for (kind, a), v in mean.items() if kind == ISO}
    return {"cause": sum(cause) / len(cause), "iso": sum(iso.values()) / len(iso), "iso_per_attribute": iso}


@pytest.mark.parametrize("config", ["das", "mdas", "dbm", "mdbm", "pca_features", "full_swap"])
def test_ravel_configs_run_through_train_py(config, tmp_path, tiny_lm_dir, monkeypatch):
    """Each RAVEL method's config fits (or validates) end to end on a tiny model, with the data
    filter answered by an oracle that knows every city, and logs Cause / Iso / Disentangle."""
    import json

    from lit_interventions.datamodules.ravel import RavelDataModule

    import train
    from tests.helpers import oracle

    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=tiny_lm_dir("llama")).data.entities))
    )
    subcommand = "validate" if config == "full_swap" else "fit"
    args = [
        subcommand,
        "--config",
        f"configs/ravel/{config}.yaml",
        f"--model.lm={tiny_lm_dir('llama')}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.train_size=32",
        "--data.eval_size=16",
        "--data.max_candidates=40",
        "--trainer.enable_progress_bar=false",
    ]
    if subcommand == "fit":
        args += ["--trainer.max_epochs=1", "--model.k=4"] if "das" in config else ["--trainer.max_epochs=1"]
    seen = _plant_answers(monkeypatch)
    cli = train.main(args=args)
    metrics = cli.trainer.callback_metrics
    # Cause / Iso recomputed by hand from the module's own intervened predictions on the val rows
    by_hand = _cause_iso_by_hand(seen, cli.datamodule.attributes)
    assert 0 < by_hand["cause"] < 1 and 0 < by_hand["iso"] < 1  # the planted signal, not all or nothing
    assert set(by_hand["iso_per_attribute"]) >= {"Continent", "Language"}
    assert metrics["val/cause"].item() == pytest.approx(by_hand["cause"], abs=1e-6)
    assert metrics["val/iso"].item() == pytest.approx(by_hand["iso"], abs=1e-6)
    for attribute, value in by_hand["iso_per_attribute"].items():
        assert metrics[f"val/iso/{attribute}"].item() == pytest.approx(value, abs=1e-6), attribute
    assert metrics["val/disentangle"].item() == pytest.approx((metrics["val/cause"] + metrics["val/iso"]).item() / 2)
    assert cli.datamodule.hparams.multitask == config.startswith("m")  # linked from the model
    if config == "pca_features":  # fitted on the train states, C chosen by the dev Disentangle of each C's swap
        intervention = cli.model.intervention
        fitted = intervention.fitted
        assert isinstance(fitted, FeatureInterchange) and fitted.featurizer.n_features == 32
        dev = {row["C"]: row["dev"]["disentangle"] for row in intervention.sweep}
        assert len(dev) >= 2 and intervention.C == min(c for c in dev if dev[c] == max(dev.values()))  # ties: smaller C
        assert fitted.selected.tolist() == next(
            r["selected"].tolist() for r in intervention.sweep if r["C"] == intervention.C
        )
    elif subcommand == "fit":
        card = json.loads((Path(cli.trainer.log_dir) / "config.json").read_text())
        expected = "RotatedSpaceIntervention" if "das" in config else "SigmoidMaskIntervention"
        assert card["class_path"].endswith(expected) and card["data"]["target_attribute"] == "Country"
