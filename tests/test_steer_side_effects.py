"""The steering evaluation's side effects (kl_neutral and capability_delta, `--side_effects true`)
and its suppression mode (`--mode suppress`), on the tiny llama with a planted steering vector
and the local judge."""

from __future__ import annotations

import csv
import json
from contextlib import contextmanager
from itertools import permutations

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, load_instructions
from matplotlib.image import imread

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.files import FILE_DIGESTS
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.surprisal import region_surprisals
from lit_interventions.inference.apply import load_artifact
from lit_interventions.metrics.judge_prompts import harmonic_mean, mode_scores
from lit_interventions.studies import side_effects, steer
from lit_interventions.studies.syntaxgym.score import evaluate_suite, evaluate_suite_forward
from lit_interventions.studies.syntaxgym.suites import load_suite, suite_paths
from tests.helpers import run_command
from tests.test_steer_eval import INSTRUCTIONS

WIDTH, LAYER = 32, 1
MAX_ACTIVATION = 4.0  # the planted concept's: α = factor × 4
NEUTRAL = load_instructions(BUILTIN_DIR / "neutral_prompts.json")


@pytest.fixture
def planted(tiny_lm_dir, tmp_path):
    """(the LM, the dictionary's directory, its planted unit vector for "dogs", an instruction file)."""
    lm = tiny_lm_dir("llama")
    torch.manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(2, WIDTH), dim=-1)
    path = Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([MAX_ACTIVATION, 8.0]),
        concepts=["dogs", "rivers"],
        model=lm,
        layer=LAYER,
        method="diffmean",
    ).save(tmp_path / "dict")
    (tmp_path / "instructions.json").write_text(json.dumps(INSTRUCTIONS))
    return lm, str(path), vectors[0], str(tmp_path / "instructions.json")


@contextmanager
def _added(model, vector: torch.Tensor, alpha: float):
    """The LM steered by a hook of our own: `vector`·alpha added after block LAYER."""

    def add(module, inputs, output):
        if isinstance(output, tuple):
            return (output[0] + alpha * vector, *output[1:])
        return output + alpha * vector

    handle = model.model.layers[LAYER].register_forward_hook(add)
    try:
        yield model
    finally:
        handle.remove()


def _kl_by_hand(model, tokenizer, vector: torch.Tensor, alpha: float, prompts: list[str]) -> float:
    """KL(p_unsteered ‖ p_steered), the steered LM being `vector`·alpha added after block LAYER
    by a hook of our own; per prompt the mean over its positions, then the mean over prompts."""

    def log_probs(text: str) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)

    per_prompt = []
    for text in prompts:
        log_p = log_probs(text)
        with _added(model, vector, alpha):
            log_q = log_probs(text)
        per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        per_prompt.append(per_position.mean())
    return float(sum(per_prompt) / len(per_prompt))


def test_kl_neutral_equals_the_hand_computation_and_is_0_at_factor_0(planted):
    lm, path, vector, _ = planted
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    artifact = load_artifact(path)
    baseline = side_effects.neutral_log_probs(model, tokenizer, NEUTRAL)
    assert len(NEUTRAL) == 20
    assert [t.shape[0] for t in baseline] == [len(tokenizer(text)["input_ids"]) for text in NEUTRAL]
    for factor in (0.5, 2.0, -1.0):
        measured = steer.cell_side_effect(model, tokenizer, artifact, "dogs", factor, NEUTRAL, baseline)
        by_hand = _kl_by_hand(model, tokenizer, vector, factor * MAX_ACTIVATION, NEUTRAL)
        assert by_hand > 1e-4  # the planted vector moves the distributions
        assert measured == pytest.approx(by_hand, rel=1e-4, abs=1e-9)
    assert steer.cell_side_effect(model, tokenizer, artifact, "dogs", 0.0, NEUTRAL, baseline) == 0.0
    # the prompt baseline has no edit
    source = steer.PromptBaseline(("dogs",))
    assert steer.cell_side_effect(model, tokenizer, source, "dogs", 0.0, NEUTRAL, baseline) == 0.0


def test_kl_neutral_of_two_planted_distributions():
    """One prompt of two positions over two tokens: KL(p ‖ q) = Σ p (log p − log q), the positions averaged."""
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]]).log()
    first = 0.5 * (torch.tensor(0.5 / 0.25).log()) + 0.5 * (torch.tensor(0.5 / 0.75).log())
    assert side_effects.kl_neutral([p], [q]) == pytest.approx(float(first) / 2, rel=1e-6)
    assert side_effects.kl_neutral([p, p], [q, p]) == pytest.approx(float(first) / 4, rel=1e-6)


def _csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _steer(lm, path, instructions, out, *extra):
    options = dict(concepts=["dogs"], factors=[0.0, 2.0], instructions=2, max_new_tokens=3, batch_size=2)
    return run_command(
        *("steer", "--dictionary", path, "--lm", lm, "--instruction_file", instructions, "--out", str(out)),
        *(f"--{k}={json.dumps(v)}" for k, v in options.items()),
        *("--judge", json.dumps({"backend": "local", "lm": lm, "max_new_tokens": 3})),
        *extra,
    )


def test_the_side_effect_columns_from_the_command_line(planted, tmp_path):
    """`steer --side_effects true`: factors.csv and summary.csv end in kl_neutral and
    capability_delta; each factor's is the hand computation with the planted vector (0 at factor
    0; capability_delta on the built-in suites), the same in both halves, and the summary's is its
    chosen factor's."""
    lm, path, vector, instructions = planted
    out = tmp_path / "out"
    done = _steer(lm, path, instructions, out, "--side_effects", "true")
    assert done.returncode == 0, done.stderr
    factors, summary = _csv(out / "factors.csv"), _csv(out / "summary.csv")
    assert list(factors[0]) == [*steer.FACTOR_COLUMNS, "kl_neutral", "capability_delta"]
    assert list(summary[0]) == [*steer.SUMMARY_COLUMNS, "kl_neutral", "capability_delta"]
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    kl = {0.0: 0.0, 2.0: _kl_by_hand(model, tokenizer, vector, 2.0 * MAX_ACTIVATION, NEUTRAL)}
    builtin = _suites(side_effects.CAPABILITY_SUITES)
    capability = {0.0: 0.0, 2.0: _capability_by_hand(model, tokenizer, vector, 2.0 * MAX_ACTIVATION, builtin)}
    assert kl[2.0] > 1e-4
    assert sorted((float(r["factor"]), r["half"]) for r in factors) == [
        (f, h) for f in (0.0, 2.0) for h in ("report", "select")
    ]
    for row in factors:
        assert float(row["kl_neutral"]) == pytest.approx(kl[float(row["factor"])], rel=1e-4, abs=1e-9)
        assert float(row["capability_delta"]) == pytest.approx(capability[float(row["factor"])], abs=1e-9)
    chosen = summary[0]
    assert float(chosen["kl_neutral"]) == pytest.approx(kl[float(chosen["factor"])], rel=1e-4, abs=1e-9)
    assert float(chosen["capability_delta"]) == pytest.approx(capability[float(chosen["factor"])], abs=1e-9)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["side_effects"] is True and "neutral_prompts" in meta[FILE_DIGESTS]
    assert meta["capability_suites"] == ["agreement_pp", "npi_ever", "reflexive_number"]
    assert {f"capability_suite:{n}.json" for n in meta["capability_suites"]} <= set(meta[FILE_DIGESTS])
    assert imread(out / "steering.png").shape[0] == round(6.8 * 110)  # the Pareto row below the scores
    with pytest.raises(ValueError, match="holds a steering evaluation with --side_effects=true, this run has"):
        _rerun_in_steer_mode(lm, path, instructions, out)


def test_suppression_prompts_for_the_concept_and_steers_against_it(planted, tmp_path):
    """`steer --mode suppress`: every generation is prompted with AxBench's suppression input
    (`AlpacaEval_Suppress`: " " + T_PROMPT_STEERING % concept + "\\n\\nQuestion: " + instruction),
    its factor is the negated one, the rows and CSVs carry the mode, and the reply is judged on
    the bare instruction."""
    lm, path, _, instructions = planted
    out = tmp_path / "out"
    done = _steer(lm, path, instructions, out, "--mode", "suppress")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert sorted({r["factor"] for r in rows}) == [-2.0, 0.0]
    assert all(r["mode"] == "suppress" and r["instruction"] in INSTRUCTIONS for r in rows)
    for row in rows:  # the suppression score, from the row's own ratings
        absent = 2.0 - row["concept_score"]
        assert row["overall"] == pytest.approx(harmonic_mean(absent, row["instruct_score"], row["fluency_score"]))
    for row in rows:
        assert row["prompt"] == (
            " You must answer the question with content related to dogs even if it is not related to the "
            f"question or it does not make sense.\n\nQuestion: {row['instruction']}"
        )
    factors, summary = _csv(out / "factors.csv"), _csv(out / "summary.csv")
    assert list(factors[0]) == ["method", "mode", *steer.FACTOR_COLUMNS[1:]]
    assert list(summary[0]) == ["method", "mode", *steer.SUMMARY_COLUMNS[1:]]
    assert {r["mode"] for r in factors + summary} == {"suppress"}
    assert sorted({float(r["factor"]) for r in factors}) == [-2.0, 0.0]
    assert json.loads((out / "meta.json").read_text())["mode"] == "suppress"
    # the directory resumes in its own mode only, refused before any LM loads
    with pytest.raises(ValueError, match=r"holds a steering evaluation with --mode=\"suppress\", this run has"):
        _rerun_in_steer_mode(lm, path, instructions, out)


def _rerun_in_steer_mode(lm, path, instructions, out):
    """`run_steer_eval` on `out` in `steer` mode without side effects (refused before the LM loads)."""
    steer.run_steer_eval(
        dictionary=path,
        lm=lm,
        concepts=["dogs"],
        factors=[0.0, 2.0],
        instructions=2,
        instruction_file=instructions,
        out=str(out),
        judge={"backend": "local", "lm": "no-such-lm"},
    )


def test_the_suppression_overall_is_axbenchs_harmonic_mean_of_the_concepts_absence():
    """AxBench's `LMJudgeEvaluator` on `AlpacaEvalSuppress`: H(2 − concept, instruction, fluency)."""
    row = {"concept_score": 0.0, "instruct_score": 2.0, "fluency_score": 1.0, "overall": 0.0}
    assert mode_scores(row, "steer") == row
    suppressed = mode_scores(row, "suppress")
    assert suppressed["overall"] == pytest.approx(1.5) and suppressed["concept_score"] == 0.0  # 3 / (1/2 + 1/2 + 1)
    assert mode_scores(row | {"concept_score": 2.0}, "suppress")["overall"] == 0.0  # the concept fully present
    other = {"judge": "x", **row, "concept_score": 1.0}
    assert mode_scores(row | {"compared": other}, "suppress")["compared"]["overall"] == pytest.approx(1.2)


def test_suppression_factors_are_negative():
    assert steer.applied_factors([0.2, 1.0, 5.0], "suppress") == [-0.2, -1.0, -5.0]
    assert steer.applied_factors([0.2, 1.0, 5.0], "steer") == [0.2, 1.0, 5.0]


def test_a_suppression_row_with_the_smaller_magnitude_wins_a_tie():
    rows = [
        {"method": "m", "mode": "suppress", "concept": "a", "factor": f, "half": h, **dict.fromkeys(steer.SCORES, 1.0)}
        for f in (-1.0, -2.0)
        for h in ("select", "report")
    ]
    summary, _ = steer.choose_and_report(rows)
    assert [(r["factor"], r["mode"]) for r in summary] == [(-1.0, "suppress")]


def test_an_unknown_mode_is_one_line_before_any_lm_loads(planted, tmp_path):
    lm, path, _, instructions = planted
    done = _steer("no-such-lm", path, instructions, tmp_path / "out", "--mode", "boost")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --mode='boost' is not a steering mode; allowed: 'steer' (toward the concept) or 'suppress' "
        "(the prompt asks for the concept and the artifact steers against it)"
    ]
    assert not (tmp_path / "out").exists()


# --- capability_delta: SyntaxGym suite accuracy under the cell's edit ------------------------------
def _suites(where) -> list:
    return [load_suite(path) for path in suite_paths([str(where)])]


def _mean_accuracy(model, tokenizer, suites) -> float:
    """The mean suite accuracy by `evaluate_suite` (the LM's body, then its head on the wanted tokens)."""
    return sum(evaluate_suite(suite, model, tokenizer).accuracy for suite in suites) / len(suites)


def _capability_by_hand(model, tokenizer, vector: torch.Tensor, alpha: float, suites) -> float:
    """Mean suite accuracy with `vector`·alpha added after block LAYER by our own hook, minus without."""
    unsteered = _mean_accuracy(model, tokenizer, suites)
    with _added(model, vector, alpha):
        return _mean_accuracy(model, tokenizer, suites) - unsteered


CONTEXTS = ["The dog", "The dogs", "The man", "The keys", "A river", "The cat", "My friends", "The child"]
WORDS = [("is", "are"), ("was", "were"), ("has", "have")]


def _planted_suite(model, tokenizer, directory) -> str:
    """A 2×2 suite the unsteered tiny LM gets right on every item, by construction: an item is
    two contexts c1, c2 and two words w1, w2 where the LM prefers w1 after c1 and w2 after c2,

        [S(w1 | c1) < S(w2 | c1)] & [S(w2 | c2) < S(w1 | c2)],

    so an LM blind to the context (its preference the same after both) fails every item."""
    surprisal = {
        (c, w): values[1]
        for (c, w), values in zip(
            [(c, w) for c in CONTEXTS for pair in WORDS for w in pair],
            region_surprisals(model, tokenizer, [[c, w, "here."] for c in CONTEXTS for pair in WORDS for w in pair]),
        )
    }
    items = []
    for (c1, c2), (w1, w2) in ((cs, ws) for cs in permutations(CONTEXTS, 2) for ws in WORDS):
        if surprisal[c1, w1] < surprisal[c1, w2] and surprisal[c2, w2] < surprisal[c2, w1] and len(items) < 6:
            conditions = {"a_match": (c1, w1), "a_mismatch": (c1, w2), "b_match": (c2, w2), "b_mismatch": (c2, w1)}
            items.append(
                {
                    "item_number": len(items) + 1,
                    "conditions": [
                        {
                            "condition_name": name,
                            "regions": [
                                {"region_number": k, "content": text} for k, text in enumerate([c, w, "here."], 1)
                            ],
                        }
                        for name, (c, w) in conditions.items()
                    ],
                }
            )
    assert len(items) == 6
    suite = {
        "meta": {"name": "planted", "metric": "sum"},
        "predictions": [
            {"type": "formula", "formula": "[(2;%a_match%) < (2;%a_mismatch%)] & [(2;%b_match%) < (2;%b_mismatch%)]"}
        ],
        "items": items,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "planted.json").write_text(json.dumps(suite))
    return str(directory)


def test_suite_accuracy_through_the_forward_is_evaluate_suites(planted):
    """`evaluate_suite_forward` (the LM's own forward, which `apply` follows) gives the region
    surprisals and item results of `evaluate_suite` (its body and head), unsteered."""
    lm = planted[0]
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    for suite in _suites(side_effects.CAPABILITY_SUITES):
        ours, theirs = evaluate_suite_forward(suite, model, tokenizer, 5), evaluate_suite(suite, model, tokenizer)
        assert ours.item_correct == theirs.item_correct
        for mine, reference in zip(ours.item_values, theirs.item_values):
            assert mine.keys() == reference.keys()
            assert list(mine.values()) == pytest.approx([reference[k] for k in mine], rel=1e-4, abs=1e-4)
    accuracy = side_effects.suite_accuracy(model, tokenizer, _suites(side_effects.CAPABILITY_SUITES))
    assert accuracy == pytest.approx(_mean_accuracy(model, tokenizer, _suites(side_effects.CAPABILITY_SUITES)))


def test_capability_delta_equals_the_hand_computation_and_is_0_at_factor_0(planted, tmp_path):
    lm, path, vector, _ = planted
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    artifact = load_artifact(path)
    suites = [*_suites(side_effects.CAPABILITY_SUITES), *_suites(_planted_suite(model, tokenizer, tmp_path / "s"))]
    unsteered = side_effects.suite_accuracy(model, tokenizer, suites)
    assert unsteered == pytest.approx(_mean_accuracy(model, tokenizer, suites))
    measured = {}
    for factor in (0.5, 2.0, -1.0, 8.0):
        measured[factor] = steer.cell_capability_delta(model, tokenizer, artifact, "dogs", factor, suites, unsteered)
        by_hand = _capability_by_hand(model, tokenizer, vector, factor * MAX_ACTIVATION, suites)
        assert measured[factor] == pytest.approx(by_hand, abs=1e-12)
    assert any(abs(value) >= 1 / 12 / len(suites) for value in measured.values())  # at least one item flips
    assert steer.cell_capability_delta(model, tokenizer, artifact, "dogs", 0.0, suites, unsteered) == 0.0
    source = steer.PromptBaseline(("dogs",))  # no edit
    assert steer.cell_capability_delta(model, tokenizer, source, "dogs", 3.0, suites, unsteered) == 0.0


def test_an_edit_that_destroys_the_lm_loses_every_item(planted, tmp_path):
    """Planted: a suite the unsteered LM gets right on every item (accuracy 1); a huge factor
    drowns every hidden state in the concept vector, the LM no longer reads the context, and every
    item is lost: capability_delta = 0 − 1 = −1."""
    lm, path, _, _ = planted
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    suites = _suites(_planted_suite(model, tokenizer, tmp_path / "s"))
    assert _mean_accuracy(model, tokenizer, suites) == 1.0
    unsteered = side_effects.suite_accuracy(model, tokenizer, suites)
    assert unsteered == 1.0
    artifact = load_artifact(path)
    assert steer.cell_capability_delta(model, tokenizer, artifact, "dogs", 1e4, suites, unsteered) == -1.0
    assert steer.cell_capability_delta(model, tokenizer, artifact, "dogs", 0.0, suites, unsteered) == 0.0


def test_capability_suites_from_the_command_line(planted, tmp_path):
    """`--capability_suites DIR` replaces the built-in suites: capability_delta is the hand
    computation on them, meta.json names them, and a suite changed in place is refused on resume."""
    lm, path, vector, instructions = planted
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    where = _planted_suite(model, tokenizer, tmp_path / "suites")
    out = tmp_path / "out"
    done = _steer(lm, path, instructions, out, "--side_effects", "true", "--capability_suites", where)
    assert done.returncode == 0, done.stderr
    expected = {0.0: 0.0, 2.0: _capability_by_hand(model, tokenizer, vector, 2.0 * MAX_ACTIVATION, _suites(where))}
    assert expected[2.0] != 0.0  # the planted vector at factor 2 loses items of the planted suite
    factors = _csv(out / "factors.csv")
    assert len(factors) == 4
    for row in factors:
        assert float(row["capability_delta"]) == pytest.approx(expected[float(row["factor"])], abs=1e-12)
    assert json.loads((out / "meta.json").read_text())["capability_suites"] == ["planted"]
    suite = tmp_path / "suites" / "planted.json"
    suite.write_text(suite.read_text().replace("here.", "there."))
    again = _steer(lm, path, instructions, out, "--side_effects", "true", "--capability_suites", where)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"error: {suite} changed since {out} was written (its sha256 is not the one meta.json records); restore "
        "the file to resume, or give a new --out to start over on it"
    ]


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "missing",
            "error: --capability_suites='{where}' not found: give a directory of SyntaxGym *.json suites or one "
            "suite file (default: the built-in suites)",
        ),
        ("not json", "error: {where}/bad.json is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("without side effects", "error: --capability_suites='{where}' is measured only with --side_effects true"),
    ],
)
def test_bad_capability_suites_are_one_line_before_any_lm_loads(planted, tmp_path, case, expected):
    _, path, _, instructions = planted
    where = tmp_path / "suites"
    if case != "missing":
        where.mkdir()
        (where / "bad.json").write_text("no json here")
    side = [] if case == "without side effects" else ["--side_effects", "true"]
    done = _steer("no-such-lm", path, instructions, tmp_path / "out", *side, "--capability_suites", str(where))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [expected.format(where=where)]
    assert not (tmp_path / "out").exists()


def test_an_empty_or_invalid_suite_directory_is_refused_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^no \*\.json suite files in directory .*; fetch the SyntaxGym"):
        side_effects.side_effect_inputs(str(tmp_path), True)
    item = {"conditions": [{"condition_name": "a", "regions": [{"region_number": 1, "content": "x"}]}]}
    (tmp_path / "bad.json").write_text(json.dumps({"meta": {"name": "bad"}, "items": [item]}))
    with pytest.raises(ValueError, match=r"^suite 'bad' \(.*bad\.json\) has no predictions; a suite needs a non-empty"):
        side_effects.side_effect_inputs(str(tmp_path), True)
    files, suites = side_effects.side_effect_inputs(None, True)  # the built-in suites and the neutral prompts
    assert [s.name for s in suites] == ["agreement_pp", "npi_ever", "reflexive_number"]
    assert [len(s.items) for s in suites] == [12, 12, 12]
    assert sorted(files) == [
        "capability_suite:agreement_pp.json",
        "capability_suite:npi_ever.json",
        "capability_suite:reflexive_number.json",
        "neutral_prompts",
    ]
    assert side_effects.side_effect_inputs(None, False) == ({}, [])


# --- steering.png's Pareto panels ------------------------------------------------------------------
def _factor_rows(side: bool) -> list[dict]:
    """Two methods × two factors × two concepts × two halves; concept score = factor, fluency =
    2 − factor/2 + the half's offset, capability_delta = −factor/10 for diffmean, −factor/5 for reft_r1."""
    rows = []
    for method, slope in (("diffmean", 10), ("reft_r1", 5)):
        for concept in ("dogs", "rivers"):
            for factor in (0.5, 2.0):
                for half, offset in (("select", 0.0), ("report", 0.2)):
                    row = {"method": method, "concept": concept, "factor": factor, "half": half, "n": 1}
                    row |= {"concept_score": factor, "instruct_score": 1.0, "fluency_score": 2 - factor / 2 + offset}
                    row |= {"overall": 1.0} | (
                        {"kl_neutral": factor, "capability_delta": -factor / slope} if side else {}
                    )
                    rows.append(row)
    return rows


def _flat(points) -> list[float]:
    return [float(v) for point in points for v in point]


def test_the_figure_gains_two_pareto_panels_with_side_effects():
    assert len(steer.factor_figure(_factor_rows(side=False)).axes) == 4
    fig = steer.factor_figure(_factor_rows(side=True))
    assert len(fig.axes) == 6
    fluency, capability = fig.axes[4], fig.axes[5]
    assert fluency.get_title() == "concept_score against fluency_score (labels: factor)"
    assert capability.get_title() == "concept_score against capability_delta (labels: factor)"
    # one point per method × factor: (fluency, concept) means over concepts and halves
    diffmean, reft = (_flat(c.get_offsets()) for c in fluency.collections)
    assert diffmean == pytest.approx([1.85, 0.5, 1.1, 2.0]) and reft == pytest.approx([1.85, 0.5, 1.1, 2.0])
    diffmean, reft = (_flat(c.get_offsets()) for c in capability.collections)
    assert diffmean == pytest.approx([-0.05, 0.5, -0.2, 2.0]) and reft == pytest.approx([-0.1, 0.5, -0.4, 2.0])
    # the front: diffmean's two points (reft_r1's are dominated: lower capability_delta at the same concept score)
    assert _flat(capability.get_lines()[0].get_xydata()) == pytest.approx([-0.2, 2.0, -0.05, 0.5])


def test_the_pareto_front_of_planted_points():
    points = [(0.0, 2.0), (1.0, 1.0), (0.5, 0.5), (2.0, 0.0), (1.0, 1.0), (-1.0, 2.0)]
    assert side_effects.pareto_front(points) == [0, 1, 3, 4]  # (0.5, 0.5) and (-1, 2) dominated; ties both kept


def test_write_report_draws_the_pareto_panels(tmp_path):
    rows = [r | {"instruction_index": 0} for r in _factor_rows(side=True)]
    cells = {(c, f) for c in ("dogs", "rivers") for f in (0.5, 2.0)}
    steer.write_report(tmp_path, rows, cells)
    assert imread(tmp_path / "steering.png").shape[0] == round(6.8 * 110)
    assert list(_csv(tmp_path / "factors.csv")[0])[-2:] == ["kl_neutral", "capability_delta"]
    plain = tmp_path / "plain"
    plain.mkdir()
    steer.write_report(plain, [r | {"instruction_index": 0} for r in _factor_rows(side=False)], cells)
    assert imread(plain / "steering.png").shape[0] == round(3.2 * 110)
