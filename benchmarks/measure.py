"""What every speed benchmark measures: one side's wall time and peak memory, in a process of its own.

Peak RSS only grows within a process, so each side (ours, the reference) runs in a fresh spawned
process: its `ru_maxrss` is that side's own peak (the interpreter, torch and the LM included, the
same for both), and on CUDA `torch.cuda.max_memory_allocated` is read there too. The function a
benchmark runs must be importable (defined at the top level of the script or a module), and it
returns what the equality check compares (metrics, surprisals) as plain Python or tensors.

`alternate` runs the two sides in turn `repeat` times, so that a change in a shared machine's load
falls on both; each side's figure is its fastest run.

Beside the clock, what the benchmark scripts share: their one-line argument errors
(`OneLineParser`), the `train.py` objects both sides of a Lightning benchmark start from
(`built_cli`), the exit status when the two sides disagree (`exit_if_unequal`), and the pyvene
interchange forward of the reference loops (`pyvene_last_logits`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_interventions.cli.lightning import train_main
from lit_interventions.cli.parsing import fail


@dataclass
class Measured:
    """One side of a benchmark: seconds, peak RSS (MiB), peak CUDA memory (MiB, 0 on CPU), and
    what the side returned."""

    seconds: float
    peak_rss_mib: float
    peak_cuda_mib: float
    result: Any


def timed_in_child(function: Callable, *args, **kwargs) -> Measured:
    """`function(*args, **kwargs)` in this process, timed (the child side of `isolated`).

    `function` returns (setup_seconds, result): the seconds it spent on what the benchmark does
    not time (loading the LM), which are taken off its wall time."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    setup, result = function(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start - setup
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    return Measured(seconds, rss, cuda, result)


def isolated(function: Callable, *args, **kwargs) -> Measured:
    """`function(*args, **kwargs)` in a fresh spawned process: its time and its own peak memory."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(timed_in_child, (function, *args), kwargs)


def alternate(ours: Callable, reference: Callable, repeat: int, *args, **kwargs) -> tuple[Measured, Measured]:
    """Ours and the reference in turn, `repeat` times, each in its own process; the fastest run of
    each (its peak memory is the largest seen)."""
    runs: dict[str, list[Measured]] = {"ours": [], "reference": []}
    for _ in range(repeat):
        runs["ours"].append(isolated(ours, *args, **kwargs))
        runs["reference"].append(isolated(reference, *args, **kwargs))
    best = {}
    for side, measured in runs.items():
        fastest = min(measured, key=lambda m: m.seconds)
        fastest.peak_rss_mib = max(m.peak_rss_mib for m in measured)
        fastest.peak_cuda_mib = max(m.peak_cuda_mib for m in measured)
        best[side] = fastest
    return best["ours"], best["reference"]


def report(name: str, ours: Measured, reference: Measured, units: int = 1, unit: str = "") -> None:
    """The lines every benchmark ends with: seconds (per `unit` when there are `units` of them),
    peak memory, and `NAME ratio=X` last."""
    per = f" per {unit}" if unit else ""
    print(f"seconds{per}: reference {reference.seconds / units:.2f}, ours {ours.seconds / units:.2f}")
    print(f"peak RSS (MiB): reference {reference.peak_rss_mib:.0f}, ours {ours.peak_rss_mib:.0f}")
    if reference.peak_cuda_mib or ours.peak_cuda_mib:
        print(f"peak CUDA memory (MiB): reference {reference.peak_cuda_mib:.0f}, ours {ours.peak_cuda_mib:.0f}")
    print(f"{name} ratio={reference.seconds / ours.seconds:.2f}")


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad argument as one `error: ...` line on stderr (exit status 2)."""

    def error(self, message: str):
        fail(message)


def built_cli(cli_args: list[str], device: str):
    """`train.py`'s model, data module and trainer for `cli_args` (not run), the data set up and the
    LM loaded on `device`: what both sides of a Lightning benchmark start from."""
    cli = train_main(cli_args, run=False)
    cli.datamodule.setup("fit")
    _ = cli.model.to(device).lm
    return cli


def exit_if_unequal(unequal: list[str], what: str, tolerance: float) -> None:
    """Exit status 1, with one error line, when the methods in `unequal` gave other `what` than the
    reference."""
    if unequal:
        print(
            f"error: {what} of ours and the reference differ by more than {tolerance} for {', '.join(unequal)}",
            file=sys.stderr,
        )
        raise SystemExit(1)


def pyvene_last_logits(intervenable, base, source) -> torch.Tensor:
    """A pyvene interchange as the official loops run it: a full base and a full source forward,
    the source's state at its site written at the base's site; the logits at each base row's last
    token, (batch, vocab). `base` and `source` are `core.batch.Side`s."""
    locations = {"sources->base": ([[[p] for p in source.sites]], [[[p] for p in base.sites]])}
    _, out = intervenable(
        {"input_ids": base.input_ids, "attention_mask": base.attention_mask},
        [{"input_ids": source.input_ids, "attention_mask": source.attention_mask}],
        unit_locations=locations,
    )
    return out.logits[torch.arange(len(base.input_ids), device=out.logits.device), base.last]
