"""Helpers shared by several test files (fixtures stay in conftest.py)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch


def token_batch(vocab_size, lengths=(6, 4, 5), seed=0, padding_side="right"):
    """(input_ids, attention_mask, last) of random token rows of the given lengths, padded with 0
    on the given side; ids are drawn from 3.. (past the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    last = torch.zeros(len(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        start = width - n if padding_side == "left" else 0
        ids[i, start : start + n] = torch.randint(3, vocab_size, (n,), generator=g)
        mask[i, start : start + n] = 1
        last[i] = start + n - 1
    return ids, mask, last


def oracle(known):
    """A stand-in for RavelDataModule.predict_next (the model's answers, n tokens): correct exactly
    on the entities in `known` (the value's answer tokens, then filler)."""

    def predict_next(self, model, queries):
        return [
            (
                list(self.value_tokens(q.template, self.data.entities[q.entity][q.attribute]))
                if q.entity in known
                else [-1]
            )
            + [0] * self.n_tokens
            for q in queries
        ]

    return predict_next


ROOT = Path(__file__).resolve().parents[1]


def run_command(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """A command as a user runs it, in a subprocess from the repository root, its output
    captured: `python -m lit_interventions ARGS`, or `python train.py ARGS` when ARGS starts with
    train.py. `env`: variables set on top of this process's environment."""
    head = [sys.executable] if args[0] == "train.py" else [sys.executable, "-m", "lit_interventions"]
    return subprocess.run(
        [*head, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a .jsonl file, one JSON object a line."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict], fields: list[str]) -> Path:
    """`rows` as a .csv file with the header `fields` (a row's missing field is an empty cell)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def csv_rows(path: Path) -> list[dict]:
    """A CSV file's rows as dicts."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def free_port() -> int:
    """A loopback port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CALM_SMALL = dict(  # the tiny CALM setup of tests/test_calm.py and tests/test_calm_seam.py
    entities={"train": 30, "val": 12, "test": 6},
    templates_per_property=1,
    probe_epochs=2,
    steps=3,
    k_max=3,
    layer=1,
    probe="linear",
    max_tokens=60,
)


# train.py options of a quick test fit: one epoch, validated at its end, no bar, checkpoint or logger
ONE_QUIET_EPOCH = [
    "--trainer.max_epochs=1",
    "--trainer.val_check_interval=1.0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.logger=false",
]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(monkeypatch, name: str):
    """The script `benchmarks/NAME.py` as a module registered under its name (a dataclass it defines
    looks its module up), with `benchmarks/` on the path for the `measure` it imports."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT *args`, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=120
    )


@contextmanager
def time_limit(seconds: int):
    """Fail (not hang) what runs inside past `seconds`: a TimeoutError from SIGALRM."""

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
