"""The studies' progress when stdout is not a terminal: plain lines, each level with its count,
total, elapsed time and ETA, before the final table; `LIT_INTERVENTIONS_PROGRESS_SECONDS` sets how
often (0: every update, `off`: none); and the results equal a run that shows no progress."""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from lit_interventions.datamodules.ravel import RavelDataModule

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core import progress
from lit_interventions.core.progress import ENV, Progress, TokenSteps, current, line_seconds, stage
from lit_interventions.interventions.feature_selection import feature_sweep
from lit_interventions.studies import calm, causalgym_sweep, causalgym_training, ravel_sweep, steer
from tests.helpers import CALM_SMALL, run_command
from tests.test_ravel_data import oracle

INSTRUCTIONS = ["The dog is here.", "The dog is not here.", "Is the dog here?", "The dog was here."]
LEVEL = re.compile(
    r"(?P<desc>[^|]+?) (?P<n>\d+)/(?P<total>\d+|\?)(?: \((?P<note>[^)]*)\))?  "
    r"elapsed (?P<elapsed>\d+:\d\d(?::\d\d)?)  eta (?P<eta>\d+:\d\d(?::\d\d)?|\?)$"
)


def _levels(line: str) -> list[dict] | None:
    """The levels of a progress line ([{desc, n, total, note, elapsed, eta}], outermost first), or
    None for any other line."""
    found = [LEVEL.fullmatch(part) for part in line.split("  |  ")]
    return [m.groupdict() for m in found] if all(found) else None


def _progress(stdout: str, table_header: str) -> list[list[dict]]:
    """The progress lines of a command's stdout, each parsed, checked to come before the table."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == table_header.split())
    parsed = [(i, _levels(line)) for i, line in enumerate(lines)]
    shown = [(i, levels) for i, levels in parsed if levels is not None]
    assert shown and all(i < header for i, _ in shown), stdout
    return [levels for _, levels in shown]


def _counts(shown: list[list[dict]], desc: str, step: int = 1) -> list[list[int]]:
    """The counts of the level `desc` in successive lines (a count shown again left out), split
    where a new stage of it starts; each run checked to rise by `step` a line (every update is a
    line at 0 seconds) and the last to end at its total; an ETA once anything is done."""
    runs, last = [], None
    for levels in shown:
        for level in levels:
            if level["desc"] == desc:
                n = int(level["n"])
                assert level["eta"] != "?" or n == 0, level
                total = int(level["total"])
                if n == last:  # an outer level, shown again in its stages' lines
                    continue
                if last is None or n < last:
                    runs.append([])
                runs[-1].append(n)
                last = n
    assert runs, f"no {desc!r} line"
    for run in runs:
        assert run == list(range(run[0], run[0] + step * len(run), step)), run
    assert runs[-1][-1] == total
    return runs


# --- the helper ----------------------------------------------------------------------------------
def test_lines_every_update_at_zero_seconds(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    with Progress(2, "sites", "site") as sites:
        sites.note("agr_sv_num_pp: das")
        with stage(3, "training batches", "batch") as inner:
            assert current() is inner
            for _ in range(3):
                inner.update()
        sites.update(2)
    lines = capsys.readouterr().out.splitlines()
    assert [[(lv["desc"], lv["n"], lv["total"], lv["note"]) for lv in _levels(line)] for line in lines] == [
        [("sites", "0", "2", None)],
        [("sites", "0", "2", "agr_sv_num_pp: das"), ("training batches", "1", "3", None)],
        [("sites", "0", "2", "agr_sv_num_pp: das"), ("training batches", "2", "3", None)],
        [("sites", "0", "2", "agr_sv_num_pp: das"), ("training batches", "3", "3", None)],
        [("sites", "2", "2", "agr_sv_num_pp: das")],  # closing as the last update left it: no line more
    ]
    assert _levels(lines[0])[0]["eta"] == "?" and _levels(lines[1])[1]["eta"] == "00:00"


def test_lines_at_most_every_interval_and_none_when_off(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "3600")
    with Progress(100, "cells", "cell") as cells:
        for _ in range(100):
            cells.update()
    assert [_levels(line)[0]["n"] for line in capsys.readouterr().out.splitlines()] == ["0", "100"]
    monkeypatch.setenv(ENV, "off")
    with Progress(100, "cells", "cell") as cells, stage(5, "tokens") as inner:
        cells.update()
        inner.update()
    assert capsys.readouterr().out == ""


def test_a_stage_outside_a_study_shows_nothing_and_resumed_work_is_not_in_the_rate(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    with stage(4, "scoring forwards") as inner:
        inner.update(4)
    current().update()
    assert capsys.readouterr().out == ""
    shown = Progress(10, "cells", "cell", initial=6)
    shown.start -= 8.0  # 8 s for the first 2 cells done here: 4 s a cell, 2 left
    shown.update(2)
    shown.close()
    assert _levels(capsys.readouterr().out.splitlines()[1])[0]["eta"] == "00:08"


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_interval_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}='{value}' must be a number of seconds >= 0"):
        line_seconds()


def test_token_steps_count_every_step_and_the_steps_an_early_stop_skips(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    with Progress(2 * 5, "generated tokens", "token") as shown:
        streamer = TokenSteps(shown, 5)
        for _ in range(2):  # two batches: the prompt, then 5 steps; then the prompt and 2 steps
            streamer.put("prompt")
            for _ in range(5 if shown.n == 0 else 2):
                streamer.put("step")
            streamer.end()
    counts = [int(_levels(line)[0]["n"]) for line in capsys.readouterr().out.splitlines()]
    assert counts == [0, 1, 2, 3, 4, 5, 6, 7, 10]


# --- the studies, as a user runs them ------------------------------------------------------------
def _same_files(a, b, names):
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_causalgym_sweep_progress(tmp_path, tiny_lm_dir, monkeypatch):
    lm, out = tiny_lm_dir("llama"), tmp_path / "shown"
    args = ["--config", "configs/sweep_causalgym.yaml", f"--lm={lm}", "--methods=[das, diffmean]", "--layers=[0, 1]"]
    args += ["--train_pairs=10", "--eval_pairs=4"]
    done = run_command("sweep", "causalgym", *args, f"--out={out}", env={ENV: "0"})
    assert done.returncode == 0, done.stderr
    shown = _progress(done.stdout, "task method")
    assert [lv["n"] for lv in shown[0]] == ["0"] and shown[0][0]["total"] == "10"  # 2 layers × 5 regions
    assert [lv["n"] for lv in shown[-1]] == ["10"]
    assert [len(run) for run in _counts(shown, "training batches")] == [5]  # 20 train rows, batches of 4
    _counts(shown, "fitted sites")
    _counts(shown, "scoring forwards")
    assert {lv["note"] for levels in shown for lv in levels[:1]} >= {"agr_sv_num_pp: das", "agr_sv_num_pp: scoring"}
    # the same sweep with no progress at all: the same files
    monkeypatch.setenv(ENV, "off")
    monkeypatch.setattr(causalgym_training, "LoopProgress", Callback)
    causalgym_sweep.main([*args, f"--out={tmp_path / 'quiet'}"])
    _same_files(out, tmp_path / "quiet", ["results.csv", "summary.csv"])


def test_calm_progress(tmp_path, tiny_lm_dir, monkeypatch):
    lm, out = tiny_lm_dir("llama"), tmp_path / "shown"
    args = [
        f"--lm={lm}",
        "--tasks=[Country]",
        *(f"--{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in CALM_SMALL.items()),
    ]
    done = run_command("calm", *args, f"--out={out}", env={ENV: "0"})
    assert done.returncode == 0, done.stderr
    shown = _progress(done.stdout, "task method")
    _counts(shown, "site states")
    assert [len(run) for run in _counts(shown, "probes")] == [4]  # 0, then each of the 3 properties
    _counts(shown, "training batches")
    assert _counts(shown, "interventions") == [[0, 1, 2, 3]]  # 6 test prompts: 1 batch × 3 properties
    # no progress, reusing the probes it trained (the first probe's initial weights come from the unseeded
    # global generator, so a second training would differ from the first with or without progress)
    monkeypatch.setenv(ENV, "off")
    calm.main([*args, f"--out={tmp_path / 'quiet'}", f"--probes={out / 'probes'}"])
    _same_files(out, tmp_path / "quiet", ["results.csv", "summary.csv"])


def test_steering_progress(tiny_lm_dir, tmp_path, monkeypatch):
    lm, out = tiny_lm_dir("llama"), tmp_path / "shown"
    torch.manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(2, 32), dim=-1)
    concepts = Dictionary(vectors, torch.tensor([4.0, 8.0]), ["dogs", "rivers"], model=lm, layer=1, method="diffmean")
    dictionary = str(concepts.save(tmp_path / "dict"))
    instructions = tmp_path / "instructions.json"
    instructions.write_text(json.dumps(INSTRUCTIONS))
    judge = {"backend": "local", "lm": lm, "max_new_tokens": 3, "batch_size": 2}  # 2 generations a judge call
    options = dict(factors=[0.5, 2.0], instructions=len(INSTRUCTIONS), max_new_tokens=4, batch_size=2)
    done = run_command(
        *("steer", "--dictionary", dictionary, "--instruction_file", str(instructions), "--out", str(out)),
        *(f"--{k}={json.dumps(v)}" for k, v in options.items()),
        *("--judge", json.dumps(judge)),
        env={ENV: "0"},
    )
    assert done.returncode == 0, done.stderr
    shown = _progress(done.stdout, "method concept")
    assert _counts(shown, "steering cells") == [[0, 1, 2, 3, 4]]  # 2 concepts × 2 factors
    tokens = _counts(shown, "generated tokens")  # 2 batches of 2 × 4 steps, a cell
    assert len(tokens) == 4 and all(run[-1] == 8 for run in tokens)
    assert _counts(shown, "judged generations", step=2) == [[2, 4]] * 4
    # no progress, the judge called once a cell (as before it was split): the same generations and scores
    monkeypatch.setenv(ENV, "off")
    monkeypatch.setattr(steer, "TokenSteps", lambda *args: None)
    monkeypatch.setattr(steer, "_judged", lambda judge, *texts: judge.score(*texts))
    steer.run_steer_eval(
        dictionary=dictionary, instruction_file=str(instructions), judge=judge, out=str(tmp_path / "quiet"), **options
    )
    _same_files(out, tmp_path / "quiet", ["generations.jsonl", "factors.csv", "summary.csv"])


def test_ravel_sweep_progress(tmp_path, tiny_lm_dir, monkeypatch, capsys):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    lm = tiny_lm_dir("llama")
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    args = ["--config", "configs/sweep_ravel.yaml", f"--lm={lm}", "--layer=1", "--k=4", "--train_size=16"]
    args += ["--eval_size=12", "--max_candidates=40", "--methods=[das]", "--attributes=[Country]"]
    monkeypatch.setenv(ENV, "0")
    ravel_sweep.main([*args, f"--out={tmp_path / 'shown'}"])
    shown = _progress(capsys.readouterr().out, "method attribute")
    assert _counts(shown, "RAVEL cells") == [[0, 1]]
    _counts(shown, "training batches")
    _counts(shown, "test batches")
    monkeypatch.setenv(ENV, "off")
    monkeypatch.setattr(ravel_sweep, "LoopProgress", Callback)
    ravel_sweep.main([*args, f"--out={tmp_path / 'quiet'}"])
    _same_files(tmp_path / "shown", tmp_path / "quiet", ["summary.csv", "changes.csv"])


def test_feature_selection_counts_each_C_in_the_study_progress(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 60)
    features = rng.normal(size=(60, 8)) + 3 * np.eye(3, 8)[labels]
    with Progress(1, "RAVEL cells", "cell"):
        sweep = feature_sweep(features, labels, C=(10.0, 0.1, 1.0))
    assert [r["C"] for r in sweep] == [0.1, 1.0, 10.0]
    shown = [levels for levels in map(_levels, capsys.readouterr().out.splitlines()) if levels]
    assert _counts(shown, "feature selection") == [[1, 2, 3]]
    notes = [levels[1]["note"] for levels in shown if len(levels) == 2]
    assert notes == ["C=0.1", "C=1", "C=10"]


@pytest.mark.parametrize(
    "main,args",
    [
        (causalgym_sweep.main, ["--config", "configs/sweep_causalgym.yaml"]),
        (ravel_sweep.main, ["--config", "configs/sweep_ravel.yaml"]),
        (calm.main, ["--config", "configs/calm_ravel.yaml"]),
        (steer.main, ["--config", "configs/steer_eval.yaml", "--dictionary", "d.safetensors"]),
    ],
)
def test_a_bad_interval_stops_each_study_before_any_work(main, args, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(SystemExit) as stopped:
        main([*args, f"--out={tmp_path / 'out'}"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {ENV}='soon' must be a number of seconds >= 0 (between two progress lines) or 'off'"
    )
    assert not (tmp_path / "out").exists()


def test_a_level_on_stderr_and_its_heartbeat_lines_while_nothing_counts(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    monkeypatch.setattr(progress, "HEARTBEAT_MIN_SECONDS", 0.05)
    shown = Progress(100, "converting tiny.gguf", "%", file=sys.stderr, note="reading")
    with shown, progress.heartbeat(shown):
        time.sleep(0.4)  # one library call that counts nothing: the line comes again, counts unchanged
        shown.update(100)
    out, err = capsys.readouterr()
    assert out == ""
    parsed = [_levels(line) for line in err.splitlines()]
    assert all(parsed), err
    assert parsed[0] == [dict(parsed[0][0], desc="converting tiny.gguf", n="0", total="100", note="reading", eta="?")]
    beats = [levels[0] for levels in parsed[1:] if levels[0]["n"] == "0"]
    assert len(beats) >= 3 and {b["note"] for b in beats} == {"reading"}  # 0.4 s / 0.05 s, some slack
    assert [levels[0]["n"] for levels in parsed if levels[0]["n"] != "0"] == ["100"]
    monkeypatch.setenv(ENV, "off")
    quiet = Progress(3, "converting", file=sys.stderr)
    with quiet, progress.heartbeat(quiet):
        time.sleep(0.1)
    assert capsys.readouterr() == ("", "")
