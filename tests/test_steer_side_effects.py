"""The steering evaluation's side effects (kl_neutral, `--side_effects true`) and its suppression
mode (`--mode suppress`), on the tiny llama with a planted steering vector and the local judge."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, load_instructions

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.files import FILE_DIGESTS
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.inference.apply import load_artifact
from lit_interventions.studies import steer
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


def _kl_by_hand(model, tokenizer, vector: torch.Tensor, alpha: float, prompts: list[str]) -> float:
    """KL(p_unsteered ‖ p_steered), the steered LM being `vector`·alpha added after block LAYER
    by a hook of our own; per prompt the mean over its positions, then the mean over prompts."""

    def add(module, inputs, output):
        if isinstance(output, tuple):
            return (output[0] + alpha * vector, *output[1:])
        return output + alpha * vector

    def log_probs(text: str) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)

    per_prompt = []
    for text in prompts:
        log_p = log_probs(text)
        handle = model.model.layers[LAYER].register_forward_hook(add)
        try:
            log_q = log_probs(text)
        finally:
            handle.remove()
        per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        per_prompt.append(per_position.mean())
    return float(sum(per_prompt) / len(per_prompt))


def test_kl_neutral_equals_the_hand_computation_and_is_0_at_factor_0(planted):
    lm, path, vector, _ = planted
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    artifact = load_artifact(path)
    baseline = steer.neutral_log_probs(model, tokenizer, NEUTRAL)
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
    assert steer.kl_neutral([p], [q]) == pytest.approx(float(first) / 2, rel=1e-6)
    assert steer.kl_neutral([p, p], [q, p]) == pytest.approx(float(first) / 4, rel=1e-6)


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


def test_the_kl_neutral_column_from_the_command_line(planted, tmp_path):
    """`steer --side_effects true`: factors.csv and summary.csv end in kl_neutral; each factor's is
    the hand computation with the planted vector (0 at factor 0), the same in both halves, and the
    summary's is its chosen factor's."""
    lm, path, vector, instructions = planted
    out = tmp_path / "out"
    done = _steer(lm, path, instructions, out, "--side_effects", "true")
    assert done.returncode == 0, done.stderr
    factors, summary = _csv(out / "factors.csv"), _csv(out / "summary.csv")
    assert list(factors[0]) == [*steer.FACTOR_COLUMNS, "kl_neutral"]
    assert list(summary[0]) == [*steer.SUMMARY_COLUMNS, "kl_neutral"]
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    expected = {0.0: 0.0, 2.0: _kl_by_hand(model, tokenizer, vector, 2.0 * MAX_ACTIVATION, NEUTRAL)}
    assert expected[2.0] > 1e-4
    assert sorted((float(r["factor"]), r["half"]) for r in factors) == [
        (f, h) for f in (0.0, 2.0) for h in ("report", "select")
    ]
    for row in factors:
        assert float(row["kl_neutral"]) == pytest.approx(expected[float(row["factor"])], rel=1e-4, abs=1e-9)
    chosen = summary[0]
    assert float(chosen["kl_neutral"]) == pytest.approx(expected[float(chosen["factor"])], rel=1e-4, abs=1e-9)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["side_effects"] is True and "neutral_prompts" in meta[FILE_DIGESTS]
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
