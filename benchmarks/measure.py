"""What every speed benchmark measures: one side's wall time and peak memory, in a process of its own.

Peak RSS only grows within a process, so each side (ours, the reference) runs in a fresh spawned
process: its `ru_maxrss` is that side's own peak (the interpreter, torch and the LM included, the
same for both), and on CUDA `torch.cuda.max_memory_allocated` is read there too. The function a
benchmark runs must be importable (defined at the top level of the script or a module), and it
returns what the equality check compares (metrics, surprisals) as plain Python or tensors.

`alternate` runs the two sides in turn `repeat` times, so that a change in a shared machine's load
falls on both; each side's figure is its fastest run.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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
