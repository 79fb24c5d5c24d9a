"""CALM: gradient-based interventions against probes, the competence score and the study runner."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from lit_interventions.core.forward import logits_at, read_layers
from lit_interventions.interventions.attacks import epsilon_scale, fgsm, pgd, random_sign
from lit_interventions.interventions.capabilities import intervene
from lit_interventions.interventions.registry import method_entry
from lit_interventions.metrics.competence import Competence, competence_scores, topk_overlaps
from lit_interventions.modules.probe import ProbeModule, probe_predict, train_probe
from lit_interventions.studies.calm import _written, build_attack
from tests.helpers import CALM_SMALL


# --- attacks ----------------------------------------------------------------------------------------
class Window(nn.Module):
    """A nonlinear 2-class probe of coordinate 0: class 1 iff |h₀ − c| < w (logit 1: w² − (h₀ − c)²).

    From h₀ = 0 with ε = 1 and c = 0.5, w = 0.2, FGSM's single full step lands at h₀ = ±1, outside the
    window; PGD's small projected steps walk into it."""

    def __init__(self, c: float = 0.5, w: float = 0.2):
        super().__init__()
        self.c, self.w = c, w

    def forward(self, h):
        score = self.w**2 - (h[:, :1] - self.c) ** 2  # (batch, 1)
        return torch.cat([torch.zeros_like(score), 10 * score], dim=-1)  # (batch, 2)


def attack(name, probe, h, target, epsilon):
    """h′ of the registered attack `name`, built and called as a CALM run builds and calls it."""
    return intervene(build_attack(method_entry(name)), h, probe=probe, target=target, epsilon=epsilon)


def _mlp_probe_on_blobs(seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (300,), generator=g)
    centers = torch.randn(3, 16, generator=g) * 2
    x = centers[y] + torch.randn(300, 16, generator=g)
    probe = ProbeModule(["a", "b", "c"], "toy", 0, 16, kind="mlp", hidden=32, lr=1e-2)
    return train_probe(probe, (x[:200], y[:200]), (x[200:], y[200:]), epochs=8, batch_size=32), x[200:], y[200:]


@pytest.mark.parametrize("method", ["fgsm", "pgd"])
def test_attack_stays_in_the_epsilon_ball(method):
    probe, x, y = _mlp_probe_on_blobs()
    eps = 0.3
    delta = {"fgsm": fgsm, "pgd": pgd}[method](probe, x, (y + 1) % 3, eps)
    assert delta.shape == x.shape
    torch.testing.assert_close(attack(method, probe, x, (y + 1) % 3, eps), x + delta, rtol=0, atol=0)  # h′ = h + δ
    assert (delta.abs() <= torch.tensor(eps)).all()  # every coordinate, exactly (ε as float32, the states' dtype)
    assert ((x + delta) - x).abs().max().item() <= eps * (1 + 1e-6)
    if method == "fgsm":  # FGSM moves every coordinate with a gradient by exactly ε
        moved = delta != 0
        assert moved.float().mean() > 0.9
        assert torch.allclose(delta[moved].abs(), torch.tensor(eps))


def test_pgd_reaches_what_fgsm_overshoots():
    probe, h, target = Window(), torch.zeros(8, 4), torch.ones(8, dtype=torch.long)
    assert (probe_predict(probe(h)) == 0).all()
    one_step = fgsm(probe, h, target, epsilon=1.0)
    projected = pgd(probe, h, target, epsilon=1.0)  # α = 0.1, T = 40
    assert torch.allclose(one_step[:, 0], torch.ones(8))  # FGSM jumps the whole radius
    assert (probe_predict(probe(h + one_step)) == 0).all()  # ... past the window: the probe never flips
    assert (probe_predict(probe(h + projected)) == 1).all()  # PGD lands inside it every time
    assert (projected[:, 0] - 0.5).abs().max() < 0.2


def test_pgd_flips_a_trained_mlp_probe_more_often_than_fgsm():
    probe, x, y = _mlp_probe_on_blobs()
    target = (y + 1) % 3
    eps = 1.5 * epsilon_scale(x)  # measured: FGSM 0.65, PGD 1.0 (seed 1: 0.72 / 1.0)
    success = {
        m: (probe.predict(attack(m, probe, x, target, eps)) == target).float().mean().item() for m in ("fgsm", "pgd")
    }
    assert success["pgd"] > success["fgsm"] + 0.1
    assert success["pgd"] > 0.9
    random = (probe.predict(x + random_sign(x, eps, torch.Generator().manual_seed(0))) == target).float().mean().item()
    assert success["pgd"] > random


def test_targeted_attack_moves_toward_the_target_only():
    probe, x, y = _mlp_probe_on_blobs()
    target = (y + 1) % 3
    delta = pgd(probe, x, target, epsilon=2.0)
    from lit_interventions.modules.probe import probe_loss

    with torch.no_grad():
        assert probe_loss(probe(x + delta), target) < probe_loss(probe(x), target)


def test_attack_leaves_probe_mode_and_weights_alone():
    probe, x, y = _mlp_probe_on_blobs()
    probe.train()
    before = [p.clone() for p in probe.parameters()]
    pgd(probe, x, y, epsilon=0.1, steps=3)
    assert probe.training  # restored
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, probe.parameters()))


def test_random_sign_is_plus_or_minus_epsilon():
    delta = random_sign(torch.zeros(50, 20), 0.25, torch.Generator().manual_seed(0))
    assert set(delta.unique().tolist()) == {-0.25, 0.25}
    assert 0.4 < (delta > 0).float().mean() < 0.6


@pytest.mark.parametrize("eps", [0, -0.1, float("nan")])
def test_attacks_refuse_a_non_positive_epsilon(eps):
    probe, x, y = _mlp_probe_on_blobs()
    for call in (lambda: fgsm(probe, x, y, eps), lambda: pgd(probe, x, y, eps), lambda: random_sign(x, eps)):
        with pytest.raises(ValueError, match="epsilon"):
            call()


def test_attack_bad_inputs():
    probe, x, y = _mlp_probe_on_blobs()
    with pytest.raises(ValueError, match="Unknown method 'cw'"):
        method_entry("cw")
    with pytest.raises(ValueError, match="steps"):
        pgd(probe, x, y, steps=0)
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        fgsm(probe, x, y[:3])
    with pytest.raises(ValueError, match="size 8"):  # a probe of another site's width
        fgsm(probe, x[:, :8], y)


def test_edited_state_changes_the_lm_output(tiny_lm, tokenizer):
    model = tiny_lm("gemma3")
    ids = torch.tensor([tokenizer("<bos>The dog is here.").input_ids])
    mask, last, site = torch.ones_like(ids), torch.tensor([ids.shape[1] - 1]), torch.tensor([2])
    clean = logits_at(model, ids, mask, last)
    states = read_layers(model, [1], ids, mask)[1]
    h = states[0, 2:3]  # (1, 32)
    zero = logits_at(model, ids, mask, last, layer=1, site_positions=site, intervention=_written(h))
    assert torch.allclose(zero, clean, atol=1e-5)  # writing h itself is the clean forward
    moved = h + random_sign(h, 1.0 * epsilon_scale(states[0]), torch.Generator().manual_seed(0))
    edited = logits_at(model, ids, mask, last, layer=1, site_positions=site, intervention=_written(moved))
    assert (edited - clean).abs().max() > 1e-3
    cached = logits_at(
        model, ids, mask, last, layer=1, site_positions=site, intervention=_written(moved), start_states=states
    )
    assert torch.allclose(cached, edited, atol=1e-5)  # same edit when the forward starts at the layer


# --- competence -------------------------------------------------------------------------------------
def _ranking(*order, vocab=12):
    """Logits whose descending order is `order` (then the rest)."""
    logits = torch.zeros(vocab)
    for rank, token in enumerate(order):
        logits[token] = 100.0 - rank
    return logits


def test_topk_overlap_by_hand():
    clean = _ranking(0, 1, 2, 3)[None]
    swapped = _ranking(1, 0, 3, 2)[None]
    overlaps = topk_overlaps(clean, swapped, k_max=4)
    assert overlaps[0].tolist() == pytest.approx([0.0, 1.0, 2 / 3, 1.0])  # {0}∩{1}; {0,1}∩{1,0}; ...
    scores = competence_scores(clean, swapped, torch.tensor([False]), k_max=4)
    assert scores.item() == pytest.approx((0 + 1 + 2 / 3 + 1) / 4)
    assert competence_scores(clean, swapped, torch.tensor([True]), k_max=4).item() == pytest.approx(1 - (8 / 3) / 4)


def test_do_nothing_competence_is_m_minus_one_over_m():
    """m = 3 properties, one causal: the causal one scores 1 − 1 = 0, the two others 1 → 2/3."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    metric = Competence(k_max=10)
    for prop in range(3):
        metric.update(logits, logits.clone(), torch.full((5,), prop == 0))
    scores = metric.compute()
    assert scores["competence"].item() == pytest.approx(2 / 3)
    assert scores["causal"].item() == 0.0 and scores["environmental"].item() == 1.0


def test_a_model_that_always_changes_scores_one_over_m():
    """The paper's random baseline R (its prediction always changes): 1/m, with m = 4 here."""
    clean = torch.stack([_ranking(*range(10), vocab=30)] * 2)
    changed = torch.stack([_ranking(*range(10, 20), vocab=30)] * 2)  # top-10 disjoint from the clean top-10
    metric = Competence()
    for prop in range(4):
        metric.update(clean, changed, torch.full((2,), prop == 1))
    assert metric.compute()["competence"].item() == pytest.approx(1 / 4)


def test_competence_with_candidate_vocabulary():
    clean = _ranking(5, 0, 1, vocab=8)[None]
    edited = _ranking(0, 5, 1, vocab=8)[None]
    # restricted to tokens {0, 1}: both rank 0 before 1, so nothing changed there
    restricted = Competence(k_max=2, candidates=torch.tensor([0, 1]))
    restricted.update(clean, edited, torch.tensor([False]))
    assert restricted.compute()["competence"].item() == 1.0
    full = Competence(k_max=2)
    full.update(clean, edited, torch.tensor([False]))
    assert full.compute()["competence"].item() == pytest.approx((0 + 1) / 2)


def test_competence_within_candidates_by_hand():
    # vocabulary of 8; the answer vocabulary is {2, 4, 6}. Clean ranking 7 > 2 > 0 > 4 > 6 ...,
    # intervened 4 > 7 > 2 > 6 ...: within the candidates, clean 2 > 4 > 6 and intervened 4 > 2 > 6.
    clean = _ranking(7, 2, 0, 4, 6, vocab=8)[None]
    edited = _ranking(4, 7, 2, 6, vocab=8)[None]
    candidates = torch.tensor([2, 4, 6])
    # k = 1: {2} vs {4} -> 0; k = 2: {2, 4} vs {4, 2} -> 1; k = 3: all three -> 1 (k_max=10 stops at 3)
    environmental = competence_scores(clean, edited, torch.tensor([False]), k_max=10, candidates=candidates)
    assert environmental.item() == pytest.approx(2 / 3)
    causal = competence_scores(clean, edited, torch.tensor([True]), k_max=10, candidates=candidates)
    assert causal.item() == pytest.approx(1 / 3)
    # over the full vocabulary the non-answer token 7 counts
    full = competence_scores(clean, edited, torch.tensor([False]), k_max=3)
    assert full.item() == pytest.approx((0 + 1 / 2 + 2 / 3) / 3)  # {7}/{4}; {7,2}/{4,7}; {7,2,0}/{4,7,2}


def test_competence_bad_inputs():
    with pytest.raises(ValueError, match="k_max"):
        Competence(k_max=0)
    with pytest.raises(ValueError, match="must match"):
        competence_scores(torch.zeros(2, 5), torch.zeros(3, 5), torch.zeros(2, dtype=torch.bool))
    assert math.isnan(Competence().compute()["causal"].item())  # nothing seen


# --- the study ----------------------------------------------------------------------------------------
SMALL = CALM_SMALL


def test_study_on_a_tiny_model(tiny_lm_dir, tmp_path):
    from lit_interventions.studies.calm import run_calm

    summary = run_calm(lm=tiny_lm_dir("llama"), tasks=["Country"], out=str(tmp_path), **SMALL)
    assert [row["method"] for row in summary] == ["fgsm", "pgd", "random_sign"]
    for row in summary:
        assert 0.0 <= row["competence"] <= 1.0
        assert row["random_model"] == pytest.approx(1 / 3) and row["do_nothing"] == pytest.approx(2 / 3)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["config"]["layer"] == 1 and len(saved["results"]) == 3 * 3
    assert (tmp_path / "results.csv").is_file() and (tmp_path / "probes" / "Language.ckpt").is_file()
    results = {(r["method"], r["property"]): r for r in saved["results"]}
    assert results[("pgd", "Country")]["causal"] and not results[("pgd", "Language")]["causal"]
    # reusing the probes at the same site works; at another layer it is refused
    again = run_calm(
        lm=tiny_lm_dir("llama"),
        tasks=["Country"],
        out=str(tmp_path / "again"),
        probes=str(tmp_path / "probes"),
        **SMALL,
    )
    assert again[0]["competence"] == pytest.approx(summary[0]["competence"])
    with pytest.raises(ValueError, match="layer=2"):
        run_calm(
            lm=tiny_lm_dir("llama"), out=str(tmp_path / "x"), probes=str(tmp_path / "probes"), **(SMALL | {"layer": 2})
        )
    with pytest.raises(ValueError, match="gpt2"):
        run_calm(lm=tiny_lm_dir("gpt2"), out=str(tmp_path / "y"), probes=str(tmp_path / "probes"), **SMALL)


def test_study_ranks_within_each_task_answer_vocabulary(tiny_lm_dir, tmp_path, monkeypatch):
    """Every Competence of a task gets the first tokens of the queried attribute's values."""
    from lit_interventions.datamodules.ravel_files import load_ravel, value_separator

    from lit_interventions.core.lm import load_tokenizer
    from lit_interventions.studies import calm

    seen = []

    class Recording(calm.Competence):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.candidates)

    monkeypatch.setattr(calm, "Competence", Recording)
    lm = tiny_lm_dir("llama")
    summary = calm.run_calm(lm=lm, tasks=["Country", "Continent"], methods=["fgsm"], out=str(tmp_path), **SMALL)
    tokenizer, data = load_tokenizer(lm), load_ravel(None, "city")
    templates = json.loads((tmp_path / "summary.json").read_text())["config"]["templates"]
    for task, candidates in zip(["Country", "Country", "Continent", "Continent"], seen):  # fgsm, random_sign per task
        seps = {value_separator(t) for t in templates[task]}
        expected = sorted(
            {
                tokenizer(sep + v, add_special_tokens=False).input_ids[0]
                for v in {a[task] for a in data.entities.values() if a.get(task)}
                for sep in seps
            }
        )
        assert candidates is not None and candidates.tolist() == expected
    assert len(seen) == 4 and len(seen[0]) != len(seen[2])  # countries and continents differ
    assert [row["answer_vocabulary"] for row in summary] == [len(seen[0])] * 2 + [len(seen[2])] * 2


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(epsilon=0), "epsilon=0"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(properties=["Country", "Altitude"]), "Altitude.*available: Country, Continent, Language"),
        (dict(tasks=["Timezone"]), "Timezone"),
        (dict(methods=["cw"]), "cw"),
        (dict(layer=7), "layer=7"),
        (dict(probe="svm"), "svm"),
        (dict(alpha=0.0), "alpha"),
        (dict(steps=0), "steps"),
        (dict(entities={"train": 0, "val": 1, "test": 1}), "entities"),
        (dict(entity_type="planet"), "planet"),
    ],
)
def test_study_bad_input(tiny_lm_dir, tmp_path, bad, match):
    from lit_interventions.studies.calm import run_calm

    with pytest.raises(ValueError, match=match):
        run_calm(lm=tiny_lm_dir("llama"), out=str(tmp_path), **(SMALL | bad))


@pytest.mark.slow
def test_study_on_gemma(tmp_path):
    """A few minutes at most: gemma-3-270m, the built-in cities, one task; PGD beats the random control."""
    from lit_interventions.studies.calm import run_calm

    summary = run_calm(
        lm="gemma-3-270m",
        layer=6,
        tasks=["Country"],
        entities={"train": 40, "val": 20, "test": 8},
        templates_per_property=1,
        probe_epochs=8,
        epsilon=0.5,
        epsilon_relative=True,
        steps=10,
        out=str(tmp_path),
    )
    rows = {row["method"]: row for row in summary}
    assert set(rows) == {"fgsm", "pgd", "random_sign"}
    assert rows["pgd"]["target_success"] > rows["random_sign"]["target_success"]
    assert all(0.0 <= row["competence"] <= 1.0 for row in summary)
    probes = json.loads((tmp_path / "summary.json").read_text())["probes"]
    assert probes["Continent"]["test_acc"] > probes["Continent"]["test_majority"]


def test_the_study_repeats_exactly_with_fresh_probes(tiny_lm_dir, tmp_path):
    """Two runs of one command train the same probes (the first one's initial weights seeded too),
    after unrelated use of the global random generator in between."""
    from lit_interventions.studies.calm import run_calm

    first = run_calm(lm=tiny_lm_dir("llama"), tasks=["Country"], out=str(tmp_path / "a"), **SMALL)
    torch.rand(7)  # the global generator moved, as any earlier work in a process moves it
    second = run_calm(lm=tiny_lm_dir("llama"), tasks=["Country"], out=str(tmp_path / "b"), **SMALL)
    assert first == second
    assert (tmp_path / "a" / "results.csv").read_bytes() == (tmp_path / "b" / "results.csv").read_bytes()
