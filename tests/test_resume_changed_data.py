"""A study resumed after its data file changed in place is refused in one line naming the file,
before any LM loads: the RAVEL sweep (`sweep ravel`, its entity type's files) and the steering
evaluation (`steer`, its instruction file). Each test runs the study on the tiny llama, changes
the file, reruns it (refused, exit status 2, the results as they were), restores the file and
reruns it again (resumed, nothing redone)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.ravel import RavelDataModule
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL
from transformers import AutoModelForCausalLM

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.metrics.judge_base import Judge, JudgeScore
from lit_interventions.studies import ravel_sweep, steer
from tests.helpers import oracle

ENTITIES = "ravel_city_entity_attributes.json"
INSTRUCTIONS = ["The dog is here.", "The dog is not here.", "Is the dog here?", "The dog was here."]


def _refused_before_any_lm_loads(main, args: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of `main(args)`, with every LM load an error."""

    def no_lm(*args, **kwargs):
        raise AssertionError("an LM loaded")

    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", no_lm)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(args)
    return exit_info.value.code, capsys.readouterr().err.splitlines()


def _refusal(path: Path, out: Path) -> str:
    return (
        f"error: {path} changed since {out} was written (its sha256 is not the one meta.json records); "
        "restore the file to resume, or give a new --out to start over on it"
    )


def test_a_ravel_sweep_resumed_on_a_changed_data_file_is_refused(tmp_path, tiny_lm_dir, monkeypatch, capsys):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    ravel_dir = tmp_path / "ravel"
    ravel_dir.mkdir()
    for file in BUILTIN_RAVEL.glob("*_city_*.json"):
        shutil.copy(file, ravel_dir / file.name)
    lm, out = tiny_lm_dir("llama"), tmp_path / "out"
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    args = [
        "--config", "configs/sweep_ravel.yaml", f"--lm={lm}", "--layer=1", "--k=4", "--train_size=16",
        "--eval_size=12", "--max_candidates=40", "--methods=[full_swap]", "--attributes=[Country]",
        f"--ravel_dir={ravel_dir}", f"--out={out}",
    ]  # fmt: skip
    ravel_sweep.main(args)
    summary = (out / "summary.csv").read_bytes()
    original = (ravel_dir / ENTITIES).read_text()
    entities = json.loads(original)
    first = next(iter(entities))
    entities[first]["Country"] = "Atlantis"  # one value edited, the file rewritten where it is
    (ravel_dir / ENTITIES).write_text(json.dumps(entities))

    code, lines = _refused_before_any_lm_loads(ravel_sweep.main, args, capsys, monkeypatch)
    assert code == 2 and lines == [_refusal(ravel_dir / ENTITIES, out)]
    assert (out / "summary.csv").read_bytes() == summary

    (ravel_dir / ENTITIES).write_text(original)  # restored: the run resumes, with nothing left to do
    monkeypatch.setattr(ravel_sweep, "run_cell", lambda *a, **k: pytest.fail("a finished cell ran again"))
    ravel_sweep.main(args)
    assert (out / "summary.csv").read_bytes() == summary


class ConstantJudge(Judge):
    """Scores every reply (2, 1, 2)."""

    name = "constant"

    def score(self, concepts, instructions, responses):
        return [JudgeScore(2.0, 1.0, 2.0, 1.5) for _ in responses]


def test_a_steering_evaluation_resumed_on_a_changed_instruction_file_is_refused(
    tmp_path, tiny_lm_dir, monkeypatch, capsys
):
    lm, out = tiny_lm_dir("llama"), tmp_path / "out"
    vectors = torch.nn.functional.normalize(torch.randn(2, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    dictionary = Dictionary(vectors, torch.tensor([4.0, 8.0]), ["dogs", "rivers"], lm, 1, "diffmean")
    path = str(dictionary.save(tmp_path / "dict"))
    instructions = tmp_path / "instructions.json"
    instructions.write_text(json.dumps(INSTRUCTIONS))
    settings = dict(factors=[0.5, 2.0], instructions=2, max_new_tokens=3, batch_size=2)
    steer.run_steer_eval(
        dictionary=path, instruction_file=str(instructions), judge=ConstantJudge(), out=str(out), **settings
    )
    generations = (out / "generations.jsonl").read_bytes()
    instructions.write_text(json.dumps(list(reversed(INSTRUCTIONS))))  # the same name, other instructions drawn

    args = [
        "--dictionary", path, "--instruction_file", str(instructions), "--factors", "[0.5, 2.0]",
        "--instructions", "2", "--max_new_tokens", "3", "--batch_size", "2", "--out", str(out),
        "--judge", json.dumps({"backend": "local", "lm": lm}),
    ]  # fmt: skip
    code, lines = _refused_before_any_lm_loads(steer.main, args, capsys, monkeypatch)
    assert code == 2 and lines == [_refusal(instructions, out)]
    assert (out / "generations.jsonl").read_bytes() == generations

    instructions.write_text(json.dumps(INSTRUCTIONS))  # restored: every cell is done, none is redone
    monkeypatch.setattr(steer, "_run_cell", lambda *a, **k: pytest.fail("a finished cell ran again"))
    steer.run_steer_eval(
        dictionary=path, instruction_file=str(instructions), judge=ConstantJudge(), out=str(out), **settings
    )
    assert (out / "generations.jsonl").read_bytes() == generations
