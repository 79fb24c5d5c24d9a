"""A CausalGym sweep stopped by SIGTERM or SIGINT (`python -m lit_interventions sweep causalgym`, in a
subprocess): one line on stderr, exit status 143 / 130, every row finished before the signal kept
in a whole results.csv and in results.sqlite, and a rerun that resumes and ends with exactly the
rows of an uninterrupted sweep. A signal whose `Stopped` a library swallows still stops the run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_interventions.core import signals
from lit_interventions.studies.causalgym_sweep import RESULT_COLUMNS
from tests.helpers import csv_rows

ROOT = Path(__file__).resolve().parents[1]
# four units (one per layer), each with a trained method: the sweep is still running after the first
SWEEP = [
    "--config=configs/sweep_causalgym.yaml",
    "--methods=[das,diffmean,vanilla]",
    "--layers=[-1,0,1,2]",
    "--layers_per_unit=1",
    "--train_pairs=10",
    "--eval_pairs=4",
]
QUIET = {"TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}  # no progress bars or warnings on stderr


def _command(lm: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "lit_interventions", "sweep", "causalgym", *SWEEP, f"--lm={lm}", f"--out={out}"]


def _environment(bars: bool) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **({} if bars else QUIET)}


@pytest.fixture(scope="module")
def uninterrupted(tiny_lm_dir, tmp_path_factory) -> list[dict]:
    """The rows of results.csv of the same sweep, run to its end."""
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    done = subprocess.run(
        _command(tiny_lm_dir("llama"), out), cwd=ROOT, capture_output=True, text=True, env=_environment(False)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return csv_rows(out / "results.csv")


def _rows_appear(process: subprocess.Popen, path: Path, timeout: float = 600) -> int:
    """Wait until results.csv holds rows (the first unit is stored); how many."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and (rows := csv_rows(path)):
            return len(rows)
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before any row: {process.stderr.read()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no row in {path} within {timeout} s")


def _stored(out: Path) -> list[dict]:
    """The rows of results.sqlite, oldest first, as results.csv writes them."""
    db = sqlite3.connect(out / "results.sqlite")
    try:
        columns = ", ".join(f'"{c}"' for c in RESULT_COLUMNS)
        return [dict(zip(RESULT_COLUMNS, row)) for row in db.execute(f"SELECT {columns} FROM results ORDER BY rowid")]
    finally:
        db.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum,code,bars,rerun",
    [(signal.SIGTERM, 143, False, True), (signal.SIGINT, 130, True, False)],  # the rerun is the same after either
    ids=["SIGTERM", "SIGINT-with-progress-bars"],
)
def test_a_signal_keeps_the_finished_rows_and_the_rerun_ends_as_an_uninterrupted_sweep(
    tmp_path, tiny_lm_dir, uninterrupted, signum, code, bars, rerun
):
    out, lm = tmp_path / "out", tiny_lm_dir("llama")
    process = subprocess.Popen(
        _command(lm, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_environment(bars)
    )
    try:
        seen = _rows_appear(process, out / "results.csv")
        process.send_signal(signum)
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    line = f"stopped by {signal.Signals(signum).name}: what finished before it is kept (results written so far, checkpoints)"
    assert process.returncode == code, err[-3000:]
    if bars:  # the progress bar is closed on its own line before the one line
        assert "Traceback" not in err and err.rstrip("\n").splitlines()[-1] == line, err[-3000:]
    else:
        assert err == line + "\n"
    kept = csv_rows(out / "results.csv")
    assert list(kept[0]) == RESULT_COLUMNS
    assert seen <= len(kept) < len(uninterrupted) and kept == uninterrupted[: len(kept)]
    assert _stored(out) == kept
    assert not list(out.rglob("*.tmp")) and not (out / "summary.csv").exists()
    if not rerun:
        return

    again = subprocess.run(_command(lm, out), cwd=ROOT, capture_output=True, text=True, env=_environment(False))
    assert again.returncode == 0, again.stderr[-3000:]
    assert csv_rows(out / "results.csv") == uninterrupted
    assert sorted(p.name for p in (out / "heatmaps").iterdir()) == [
        f"agr_sv_num_pp_{m}.png" for m in ("das", "diffmean", "vanilla")
    ]


def test_a_swallowed_signal_still_ends_the_block_with_its_status(capsys):
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        with signals.stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises `Stopped` here
            except signals.Stopped:
                pass  # what a library's `except BaseException` does
            assert signals.pending_signal() == signal.SIGTERM
    assert stopped.value.code == 143
    assert capsys.readouterr().err == (
        "stopped by SIGTERM: what finished before it is kept (results written so far, checkpoints)\n"
    )
    assert signal.getsignal(signal.SIGTERM) == previous and signals.pending_signal() is None


def test_a_sweep_loop_raises_a_swallowed_signal_at_its_next_unit():
    signals.raise_pending()  # nothing received: nothing raised
    with pytest.raises(SystemExit) as stopped:
        with signals.stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except signals.Stopped:
                pass
            with pytest.raises(signals.Stopped) as again:
                signals.raise_pending()  # what the sweeps call between units
            assert again.value.code == 130
    assert stopped.value.code == 130


def test_a_signal_inside_a_deferred_block_waits_for_its_end(capsys):
    ended = []
    with pytest.raises(SystemExit) as stopped:
        with signals.stop_on_signals():
            with signals.deferred():  # what the results store does around a unit's rows and CSV
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here, and records the signal
                ended.append("the block ran to its end")
            ended.append("after the block")
    assert ended == ["the block ran to its end"] and stopped.value.code == 143
    assert capsys.readouterr().err.count("\n") == 1
