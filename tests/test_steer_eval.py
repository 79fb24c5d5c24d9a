"""Steering evaluation end to end on a tiny llama: files, resume, validation, factor selection."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.metrics.judge_base import Judge, JudgeScore
from lit_interventions.metrics.judge_prompts import harmonic_mean
from lit_interventions.modules.steering_loreft import LoReFTModule
from lit_interventions.modules.steering_registry import load_steering_checkpoint
from lit_interventions.studies.steer import choose_and_report, generate, main, run_steer_eval
from tests.helpers import free_port as _free_port
from tests.helpers import run_command

INSTRUCTIONS = ["The dog is here.", "The dog is not here.", "Is the dog here?", "The dog was here."]


@pytest.fixture
def setup(tiny_lm_dir, tmp_path):
    lm = tiny_lm_dir("llama")
    torch.manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(2, 32), dim=-1)
    path = Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([4.0, 8.0]),
        concepts=["dogs", "rivers"],
        model=lm,
        layer=1,
        method="diffmean",
    ).save(tmp_path / "dict")
    (tmp_path / "instructions.json").write_text(json.dumps(INSTRUCTIONS))
    return lm, str(path), str(tmp_path / "instructions.json")


class ScriptedJudge(Judge):
    """Scores by (factor, instruction): known answers, counts calls."""

    name = "scripted"

    def __init__(self, table):
        self.table, self.calls = table, 0

    def score(self, concepts, instructions, responses):
        self.calls += len(responses)
        out = []
        for concept, instruction in zip(concepts, instructions):
            c, i, f = self.table(concept, instruction, self.factor)
            out.append(JudgeScore(c, i, f, harmonic_mean(c, i, f)))
        return out


def _run(setup, out, judge, factors=(0.5, 2.0), **kw):
    lm, path, instructions = setup
    return run_steer_eval(
        dictionary=path,
        factors=list(factors),
        instructions=2,
        instruction_file=instructions,
        max_new_tokens=4,
        batch_size=2,
        judge=judge,
        out=str(out),
        **kw,
    )


def test_end_to_end_writes_all_files_and_resumes(setup, tmp_path, monkeypatch, tiny_lm_dir):
    lm = setup[0]
    out = tmp_path / "run"
    calls = []
    import lit_interventions.studies.steer as steer

    real_generate = steer.generate
    monkeypatch.setattr(steer, "generate", lambda *a, **k: calls.append(1) or real_generate(*a, **k))
    judge = {"backend": "local", "lm": lm, "max_new_tokens": 3}  # the offline backend, on the tiny model
    summary = _run(setup, out, judge)
    assert len(calls) == 4  # 2 concepts × 2 factors
    lines = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2
    assert {(r["concept"], r["factor"], r["half"]) for r in lines} == {
        (c, f, h) for c in ("dogs", "rivers") for f in (0.5, 2.0) for h in ("select", "report")
    }
    assert all(
        set(r["replies"]) == {"concept", "instruct", "fluency"} and isinstance(r["response"], str) for r in lines
    )
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "method",
        "concept",
        "factor",
        "concept_score",
        "instruct_score",
        "fluency_score",
        "overall",
    ]
    assert [r["concept"] for r in rows] == ["dogs", "rivers"] and rows[0]["method"] == "diffmean"
    assert len(summary) == 2
    with (out / "factors.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2 * 2 * 2
    assert (out / "steering.png").stat().st_size > 1000
    # resume: nothing is generated again; a new factor generates only its own cells
    _run(setup, out, judge)
    assert len(calls) == 4
    _run(setup, out, judge, factors=(0.5, 2.0, 3.0))
    assert len(calls) == 6
    assert len((out / "generations.jsonl").read_text().splitlines()) == 12
    # the same directory with other settings is refused
    with pytest.raises(ValueError, match="seed"):
        _run(setup, out, judge, seed=1)


def test_a_cell_cut_short_is_redone_whole_and_no_row_is_written_twice(setup, tmp_path):
    out = tmp_path / "run"
    judge = ScriptedJudge(lambda concept, instruction, factor: (1, 1, 1))
    judge.factor = None  # the scores do not depend on it
    _run(setup, out, judge)
    path = out / "generations.jsonl"
    whole = path.read_text().splitlines(keepends=True)
    assert len(whole) == 8  # 2 concepts × 2 factors × 2 instructions
    path.write_text("".join(whole[:-1]) + whole[-1][:20] + "\x00garbage")  # the last line cut, garbage after
    with pytest.warns(UserWarning, match="cells redone"):
        _run(setup, out, judge)
    again = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [(r["concept"], r["factor"], r["half"]) for r in again]
    assert len(again) == 8 and len(set(keys)) == 8  # every (concept, factor, half) once
    assert again[:6] == [json.loads(line) for line in whole[:6]]  # the whole cells kept as they were


def test_steering_changes_generation(setup):
    lm, path, _ = setup
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    dictionary = Dictionary.load(path)
    plain = generate(model, tokenizer, INSTRUCTIONS[:2], 6, 0.0, 2, seed=0)
    with dictionary.steer(model, "rivers", 5.0):
        steered = generate(model, tokenizer, INSTRUCTIONS[:2], 6, 0.0, 2, seed=0)
    assert plain != steered
    # left padding: a prompt's reply does not depend on its batch mates
    alone = generate(model, tokenizer, INSTRUCTIONS[1:2], 6, 0.0, 1, seed=0)
    assert alone[0] == plain[1]


def test_factor_chosen_on_select_half_and_reported_on_the_other(setup, tmp_path, monkeypatch):
    """Select half (instruction 0) is best at factor 2.0; the report half (instruction 1) is best at
    0.5. The summary must pick 2.0 and report instruction 1's scores at 2.0."""
    import random

    import lit_interventions.studies.steer as steer

    order = {c: random.Random(f"0:{c}").sample(INSTRUCTIONS, 2) for c in ("dogs", "rivers")}  # run_steer_eval's draw
    scores = {(0, 0.5): (1, 1, 1), (0, 2.0): (2, 2, 2), (1, 0.5): (2, 2, 2), (1, 2.0): (1, 2, 2)}
    judge = ScriptedJudge(lambda concept, instruction, factor: scores[(order[concept].index(instruction), factor)])

    real_apply = steer.apply

    def spy(model, artifact, **options):  # tells the judge which factor it is scoring
        judge.factor = options["factor"]
        return real_apply(model, artifact, **options)

    monkeypatch.setattr(steer, "apply", spy)
    summary = _run(setup, tmp_path / "sel", judge)
    assert [(r["concept"], r["factor"]) for r in summary] == [("dogs", 2.0), ("rivers", 2.0)]
    for row in summary:
        assert (row["concept_score"], row["instruct_score"], row["fluency_score"]) == (1, 2, 2)
        assert row["overall"] == pytest.approx(1.5)
    lines = [json.loads(x) for x in (tmp_path / "sel" / "generations.jsonl").read_text().splitlines()]
    for line in lines:  # the order in the file is the order assumed above
        assert order[line["concept"]][line["instruction_index"]] == line["instruction"]


def test_choose_and_report_by_hand():
    def row(concept, factor, half, overall):
        return {
            "method": "m",
            "concept": concept,
            "factor": factor,
            "half": half,
            "concept_score": overall,
            "instruct_score": overall,
            "fluency_score": overall,
            "overall": overall,
        }

    rows = [
        row("a", 1.0, "select", 1.0),
        row("a", 1.0, "select", 2.0),
        row("a", 1.0, "report", 0.0),
        row("a", 2.0, "select", 1.0),
        row("a", 2.0, "report", 2.0),  # best on report, not on select
        row("b", 1.0, "select", 1.0),
        row("b", 3.0, "select", 1.0),
        row("b", 1.0, "report", 0.5),
        row("b", 3.0, "report", 2.0),
    ]
    summary, factors = choose_and_report(rows)
    assert [(r["concept"], r["factor"], r["overall"]) for r in summary] == [
        ("a", 1.0, 0.0),
        ("b", 1.0, 0.5),
    ]  # tie: smaller
    a_select = next(r for r in factors if r["concept"] == "a" and r["factor"] == 1.0 and r["half"] == "select")
    assert a_select["overall"] == 1.5 and a_select["n"] == 2


def test_validation_before_generation(setup, tmp_path, monkeypatch, tiny_lm_dir):
    import lit_interventions.studies.steer as steer

    monkeypatch.setattr(steer, "generate", lambda *a, **k: pytest.fail("generated before validating"))
    judge = ScriptedJudge(lambda *a: (2, 2, 2))
    with pytest.raises(ValueError, match="Unknown concept 'cats'"):
        _run(setup, tmp_path / "a", judge, concepts=["cats"])
    with pytest.raises(ValueError, match="out of range"):
        _run(setup, tmp_path / "a", judge, concepts=[5])
    port = _free_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        _run(setup, tmp_path / "a", {"backend": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "m"})
    with pytest.raises(ValueError, match="differs from the model"):
        _run(setup, tmp_path / "a", judge, lm=tiny_lm_dir("gpt2"))
    with pytest.raises(ValueError, match="only 4 instructions"):
        run_steer_eval(dictionary=setup[1], instructions=6, instruction_file=setup[2], judge=judge, out=str(tmp_path))
    with pytest.raises(ValueError, match="exactly one"):
        run_steer_eval(judge=judge, out=str(tmp_path))
    assert not (tmp_path / "a" / "generations.jsonl").exists()


def test_cli_reports_bad_input_in_one_line(setup, tmp_path, capsys):
    lm, path, instructions = setup
    with pytest.raises(SystemExit) as err:
        main(
            [
                "--dictionary",
                path,
                "--concepts",
                "[cats]",
                "--instruction_file",
                instructions,
                "--judge",
                '{"backend": "local", "lm": "' + lm + '"}',
                "--out",
                str(tmp_path / "cli"),
            ]
        )
    assert err.value.code == 2 and "Unknown concept 'cats'" in capsys.readouterr().err


def test_checkpoint_steering_end_to_end(tiny_lm_dir, tmp_path, setup):
    lm = tiny_lm_dir("llama")
    module = LoReFTModule(lm=lm, layer=1, rank=2, concept="dogs")
    module.save(tmp_path / "loreft")
    judge = ScriptedJudge(lambda *a: (2, 1, 2))
    judge.factor = None
    summary = run_steer_eval(
        checkpoint=str(tmp_path / "loreft"),
        factors=[1.0],
        instructions=2,
        instruction_file=setup[2],
        max_new_tokens=3,
        judge=judge,
        out=str(tmp_path / "ck"),
    )
    assert [(r["method"], r["concept"], r["factor"]) for r in summary] == [("loreft", "dogs", 1.0)]
    assert summary[0]["overall"] == pytest.approx(1.5) and judge.calls == 2


def _loreft(lm: str, directory) -> str:
    torch.manual_seed(0)
    LoReFTModule(lm=lm, layer=1, rank=2, concept="dogs").save(directory)
    return str(directory)


def test_steer_artifact_from_the_command_line_runs_every_factor(tiny_lm_dir, tmp_path, setup):
    """`lit-interventions steer --artifact DIR` (a LoReFT run) as a user runs it: exit 0, every
    factor generated and judged; greedy at factor 0 the LM's own replies, at factor 1 LoReFT's."""
    lm, _, instructions = setup
    artifact = _loreft(lm, tmp_path / "loreft")
    out = tmp_path / "out"
    options = dict(factors=[0.0, 1.0, 2.0], instructions=2, max_new_tokens=4, batch_size=2, temperature=0.0)
    done = run_command(
        *("steer", "--artifact", artifact, "--instruction_file", instructions, "--out", str(out)),
        *(f"--{k}={json.dumps(v)}" for k, v in options.items()),
        *("--judge", json.dumps({"backend": "local", "lm": lm, "max_new_tokens": 3})),
    )
    assert done.returncode == 0, done.stderr
    assert "mean overall over 1 concepts: " in done.stdout
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert sorted({(r["method"], r["concept"], r["factor"]) for r in rows}) == [
        ("loreft", "dogs", f) for f in (0.0, 1.0, 2.0)
    ]
    assert json.loads((out / "meta.json").read_text())["artifact"] == [artifact]
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    by_factor = {f: [r for r in rows if r["factor"] == f] for f in (0.0, 1.0)}
    texts = [r["instruction"] for r in by_factor[0.0]]
    assert [r["response"] for r in by_factor[0.0]] == generate(model, tokenizer, texts, 4, 0.0, 2, seed=0)
    with load_steering_checkpoint(artifact).steer(model) as steered:  # the run's own steering
        own = generate(steered, tokenizer, [r["instruction"] for r in by_factor[1.0]], 4, 0.0, 2, seed=0)
    assert [r["response"] for r in by_factor[1.0]] == own
    assert own != [r["response"] for r in by_factor[0.0]]  # LoReFT changes what is generated
    with (out / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert [(r["method"], r["concept"]) for r in summary] == [("loreft", "dogs")]
    assert float(summary[0]["factor"]) in (0.0, 1.0, 2.0)


def test_an_interchange_artifact_is_refused_in_one_line_before_the_lm_loads(tmp_path, setup):
    """A DAS needs a source text: `steer --artifact DIR` exits 2 with one line naming it. Its
    config names an LM that does not exist (and so does the judge's): reading that LM's config,
    loading it, or building the judge would end in another error."""
    missing = str(tmp_path / "no-such-lm")
    das = save_pretrained(tmp_path / "das", RotatedSpaceIntervention(32, 1), {"model": missing, "layer": 1})
    out = tmp_path / "out"
    done = run_command(
        *("steer", "--artifact", str(das), "--instruction_file", setup[2], "--out", str(out)),
        *("--judge", json.dumps({"backend": "local", "lm": missing})),
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {das} holds a RotatedSpaceIntervention, an interchange intervention: it needs a source text, "
        "and the steering evaluation has none; steer takes artifacts that edit the LM alone (a concept "
        "dictionary, LoReFT, LoRA, a steering intervention)"
    ]
    assert not out.exists()  # refused before the output directory is claimed


def test_dictionary_and_checkpoint_are_spellings_of_artifact(setup, tmp_path, monkeypatch):
    """--dictionary and --checkpoint take the path --artifact takes, on the same path: the same
    rows; a LoReFT run is judged at every factor."""
    lm, path, instructions = setup
    judge = ScriptedJudge(lambda *a: (1, 2, 2))
    judge.factor = None
    options = dict(factors=[0.5, 2.0], instructions=2, instruction_file=instructions, max_new_tokens=3, judge=judge)
    by_name = {
        name: run_steer_eval(**{name: path}, out=str(tmp_path / name), **options) for name in ("artifact", "dictionary")
    }
    assert by_name["artifact"] == by_name["dictionary"]
    texts = {
        name: (tmp_path / name / "generations.jsonl").read_text().replace(name, "")
        for name in ("artifact", "dictionary")
    }
    assert texts["artifact"] == texts["dictionary"]
    loreft = _loreft(lm, tmp_path / "loreft")
    summary = run_steer_eval(checkpoint=[loreft], out=str(tmp_path / "ck"), **options)
    assert [(r["method"], r["concept"]) for r in summary] == [("loreft", "dogs")]
    rows = [json.loads(x) for x in (tmp_path / "ck" / "generations.jsonl").read_text().splitlines()]
    assert sorted({r["factor"] for r in rows}) == [0.5, 2.0] and judge.calls == 2 * 2 + 2 * 2 * 2 * 2
