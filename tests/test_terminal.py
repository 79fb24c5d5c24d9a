"""In a terminal, the final metrics table is the last thing on screen: `train.py fit`, `test` and
`validate` run on a pseudo-terminal (120 columns), with rich's progress bar (Lightning's default
when rich is installed) and with tqdm's (its default otherwise), and nothing is written after the
table: no redrawn bar, no cursor movement."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")

SMALL = ["--model.layer=1", "--data.train_pairs=12", "--data.eval_pairs=4", "--trainer.val_check_interval=1.0"]
# `train.py` with Lightning's choice of progress bar made as on a machine without rich: tqdm
WITHOUT_RICH = (
    "import sys, runpy; import lightning.pytorch.trainer.connectors.callback_connector as c; "
    "c._RICH_AVAILABLE = False; sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')"
)
METRIC = re.compile(r"\S+ +-?\d+\.\d{4}|\S+ +(nan|inf|-inf)")


def _on_terminal(*args: str, timeout: float = 300) -> str:
    """`python ARGS` from the repository root with stdin, stdout and stderr on a pseudo-terminal;
    every byte it wrote there, decoded."""
    import termios

    master, slave = os.openpty()
    termios.tcsetwinsize(slave, (40, 120))
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not data:
                    break
                out.extend(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    return out.decode()


def _table_last(out: str, title: str, directory: Path) -> None:
    """The output ends with the table: its title, metric lines and `files in DIR`, written after
    everything else and followed by nothing."""
    tail = out[out.rindex(f"\r\n{title}\r\n") + 2 :]
    assert "\x1b" not in tail and tail.endswith("\r\n"), repr(tail)
    lines = tail[:-2].split("\r\n")
    assert lines[0] == title and lines[-1] == f"files in {directory}", lines
    assert all(METRIC.fullmatch(line) for line in lines[1:-1]) and len(lines) > 2, lines


@pytest.fixture(scope="module")
def fitted_on_terminal(tmp_path_factory, tiny_lm_dir):
    root = tmp_path_factory.mktemp("terminal")
    out = _on_terminal(
        "train.py", "fit", "--config", "das.yaml", f"--model.lm={tiny_lm_dir('gpt2')}", *SMALL,
        f"--trainer.default_root_dir={root}", "--trainer.accelerator=cpu",
    )  # fmt: skip
    run_dir = root / "agr_sv_num_pp" / "layer1" / "version_0"
    return out, run_dir, next((run_dir / "checkpoints").glob("*.ckpt"))


def test_fit_ends_with_the_table_below_the_finished_bar(fitted_on_terminal):
    out, run_dir, _ = fitted_on_terminal
    assert out.rindex("Epoch 0/0 ") < out.rindex("\r\nfit: final metrics\r\n")  # rich's bar was drawn, before
    assert "6/6" in out[out.rindex("Epoch 0/0 ") :]  # ... finished
    _table_last(out, "fit: final metrics", run_dir)


@pytest.mark.parametrize("bar", ["rich", "tqdm"])
@pytest.mark.parametrize("subcommand", ["test", "validate"])
def test_test_and_validate_end_with_the_table(fitted_on_terminal, bar, subcommand):
    _, run_dir, checkpoint = fitted_on_terminal
    launcher = ["train.py"] if bar == "rich" else ["-c", WITHOUT_RICH]
    out = _on_terminal(*launcher, subcommand, f"--ckpt_path={checkpoint}")
    drawn = {"rich": "Testing ", "tqdm": "Testing DataLoader 0: 100%"}[bar]
    if subcommand == "validate":
        drawn = drawn.replace("Testing", "Validation")
    title = f"{subcommand}: metrics"
    assert out.rindex(drawn) < out.rindex(f"\r\n{title}\r\n"), out[-3000:]
    _table_last(out, title, run_dir / subcommand)
