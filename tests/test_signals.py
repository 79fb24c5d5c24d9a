"""A run stopped by SIGTERM or SIGINT says so in one line, exits 128 + the signal, and keeps what
it finished; as the console script and as `python train.py`, in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model.layer=1", "--data.train_pairs=12", "--data.eval_pairs=4", "--trainer.max_epochs=1000"]


def _started(process: subprocess.Popen, marker: str, timeout: float = 300) -> None:
    """Wait until `marker` appears on the process's stdout (the run is in its loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if marker in line:
            return
        if not line and process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {marker!r}: {process.stderr.read()[-2000:]}")
    raise AssertionError(f"no {marker!r} within {timeout} s")


@pytest.mark.parametrize(
    "command,signum,code",
    [
        ([sys.executable, "-m", "lit_interventions", "fit"], signal.SIGTERM, 143),
        ([sys.executable, "-m", "lit_interventions", "fit"], signal.SIGINT, 130),
        ([sys.executable, "train.py", "fit"], signal.SIGTERM, 143),
    ],
)
def test_a_signal_during_fit_is_one_line_and_its_exit_status(tmp_path, tiny_lm_dir, command, signum, code):
    process = subprocess.Popen(
        [
            *command,
            "--config",
            "configs/das.yaml",
            f"--model.lm={tiny_lm_dir('gpt2')}",
            *SMALL,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=true",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _started(process, "epoch 1 validation")  # epoch 0 and its checkpoint are done
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped by {signal.Signals(signum).name}: what finished before it is kept (results written so far, checkpoints)"
    )
    assert list(tmp_path.glob("**/checkpoints/*.ckpt"))  # the finished epochs' checkpoint stays
