"""A sweep over many processes: torchrun or srun starts them, each takes the next unit of work
left whenever it is free and writes its own results, and rank 0 merges them into the one output
directory.

    torchrun --standalone --nproc_per_node 4 -m lit_interventions sweep causalgym --config ... --out DIR

Rank, world size and local rank come from Lightning's cluster environments
(`TorchElasticEnvironment` under torchrun, `SLURMEnvironment` under srun, which also names the
main address and port). A gloo process group exists only while the ranks coordinate (rank 0
claims DIR and shares the plan; at the end they wait for each other and rank 0 shares the
summary): during the work each process runs alone, so the metrics (torchmetrics, which sync over
any process group there is) of one rank's unit never mix with another rank's.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import socket
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment, TorchElasticEnvironment
from torch.distributed.rendezvous import rendezvous

from lit_interventions.artifacts.results import ResultsStore, open_results, rank_dirs, rank_store

T = TypeVar("T")
MEET = timedelta(minutes=10)  # how long the ranks wait for each other at the start (they start together)
WAIT = timedelta(days=7)  # how long a rank that finished its share waits for the slowest one


@dataclass
class Ranks:
    """This process's place among the sweep's processes (rank 0 of 1 when run alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    environment: ClusterEnvironment | None = field(default=None, repr=False, compare=False)
    _store: Any = field(default=None, repr=False, compare=False)  # the rendezvous store, once the ranks have met
    _phases: int = field(default=0, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def take(self, units: Sequence[T], cost: Callable[[T], float] | None, queue: str) -> Iterator[T]:
        """This rank's units, one at a time: whichever rank is free takes the next unit (a counter
        `queue` in the store the ranks met on: one name per run, `ShardedRun.take`), the costliest
        first (`cost`, e.g. a unit's sites: longest-processing-time-first), so no rank idles while
        another still has a queue, and a slower node takes fewer. Alone: every unit, in order."""
        if self.world_size == 1:
            yield from units
            return
        order = sorted(units, key=cost, reverse=True) if cost else list(units)  # stable: ties keep their order
        self._meet()
        while (taken := self._store.add(f"lit_interventions/queue/{queue}", 1)) <= len(order):
            yield order[taken - 1]

    def from_main(self, work: Callable[[], T]) -> T:
        """`work()` on rank 0; every rank returns its result, or raises its error (so a refused
        --out stops every rank before any work)."""
        if self.world_size == 1:
            return work()
        self._meet()  # every rank is there before rank 0 starts
        message = [None]
        if self.is_main:  # before the group exists: no collective runs inside `work`
            try:
                message = [("ok", work())]
            except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
                message = [("error", _picklable(err))]
        with self._together():
            dist.broadcast_object_list(message, src=0)
        kind, value = message[0]
        if kind == "error":
            raise value
        return value

    def everywhere(self, check: Callable[[], None]) -> None:
        """`check()` on every rank; if it fails on any, every rank raises the lowest failing rank's
        error (a file one node cannot read stops all of them, before any work)."""
        if self.world_size == 1:
            return check()
        error = None
        try:
            check()
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = _picklable(err)
        with self._together():
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error)
        failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
        if failed:
            rank, err = failed[0]
            raise type(err)(f"rank {rank}: {err}") if isinstance(err, ValueError) and rank != self.rank else err

    def wait_for_all(self) -> None:
        """Return once every rank has called it (a rank done early waits up to `WAIT`)."""
        if self.world_size > 1:
            with self._together():
                dist.barrier()

    def _meet(self) -> None:
        if self._store is None:
            self._store = _meet(self)

    @contextmanager
    def _together(self) -> Iterator[None]:
        """A gloo process group for one coordination step, on a fresh key prefix of the store the
        ranks met on; destroyed at the end of the step."""
        self._meet()
        if self._phases == 1:
            self._store.set_timeout(WAIT)  # they have worked together once: from now on one may wait long for another
        self._phases += 1
        store = dist.PrefixStore(f"lit_interventions/{self._phases}", self._store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=WAIT)
        try:
            yield
        finally:
            dist.destroy_process_group()


def detect() -> Ranks:
    """The ranks as torchrun (TorchElasticEnvironment) or srun (SLURMEnvironment) set them; a
    plain process is rank 0 of 1. torchrun inside a SLURM job counts as torchrun."""
    for kind in (TorchElasticEnvironment, SLURMEnvironment):
        if kind.detect():
            try:
                environment = kind()
            except RuntimeError as err:  # e.g. SLURM's --ntasks without --ntasks-per-node
                raise ValueError(f"{kind.__name__}: {err}") from None
            ranks = Ranks(environment.global_rank(), environment.world_size(), environment.local_rank(), environment)
            if not 0 <= ranks.rank < ranks.world_size:
                raise ValueError(f"{kind.__name__}: rank {ranks.rank} is outside world size {ranks.world_size}")
            return ranks
    return Ranks()


def _meet(ranks: Ranks):
    """The store every rank connects to: torchrun's own (its agent's), or under srun one that
    rank 0 serves at the main address and port SLURMEnvironment names."""
    os.environ.setdefault("MASTER_ADDR", ranks.environment.main_address)
    os.environ.setdefault("MASTER_PORT", str(ranks.environment.main_port))
    try:
        store, _, _ = next(rendezvous("env://", rank=ranks.rank, world_size=ranks.world_size, timeout=MEET))
        store.set(f"lit_interventions/met/{ranks.rank}", "1")
        store.wait([f"lit_interventions/met/{rank}" for rank in range(ranks.world_size)])
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise ValueError(
            f"rank {ranks.rank} of {ranks.world_size} waited {MEET} for the others at {where} and gave up "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}); start all "
            f"{ranks.world_size} processes with torchrun or srun (not a bare python in a SLURM batch script)"
        ) from None
    return store


def pin_device(ranks: Ranks) -> str | None:
    """With GPUs, this rank's one: GPU LOCAL_RANK (mod the GPUs of the node) becomes the only one
    the process sees (CUDA_VISIBLE_DEVICES, set before CUDA starts), so `cuda` and Lightning's
    `devices=1` both mean it. Returns the physical GPU chosen, or None (no GPU, or one process)."""
    if ranks.world_size == 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else None
    count = len(gpus) if gpus is not None else torch.cuda.device_count()  # NVML: CUDA is not started
    if count <= 1:
        return gpus[0] if gpus else ("0" if count == 1 else None)
    chosen = gpus[ranks.local_rank % count] if gpus is not None else str(ranks.local_rank % count)
    if torch.cuda.is_initialized():  # too late to hide the others: at least make it the current one
        torch.cuda.set_device(ranks.local_rank % count)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def printed_by_rank_zero(function: Callable[..., list]) -> Callable[..., list]:
    """`function`, returning no rows on ranks other than 0 (so a command prints its table once)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        rows = function(*args, **kwargs)
        return rows if detect().is_main else []

    return wrapper


def _picklable(err: Exception) -> Exception:
    """`err` if it survives pickling (to be sent to the other ranks), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")


class ShardedRun:
    """One run of a sweep over the ranks, into DIR:

        with ShardedRun(ranks, out, meta, tables) as run:
            todo, _ = run.start(plan)         # rank 0: claim DIR, merge what ranks left, plan
            for unit in run.take(todo, cost): # the next unit left, whichever rank is free
                run.store.add(...)            # this rank's store
            rows = run.finish(position, summarise)  # rank 0: merge the ranks', summarise

    Rank 0 holds DIR/.lock (`open_results`) from `start` to the end, so one run per DIR stays the
    rule whatever the world size. Alone (world size 1), `run.store` is DIR's own store; otherwise
    each rank writes DIR/ranks/rank-R/ (`results.rank_store`), which rank 0 merges at the end in
    the order `position(table, row)` gives, as one process would have written it, and at the next
    start if the run was interrupted: a rerun with any world size skips what any rank finished."""

    def __init__(self, ranks: Ranks, out, meta: dict, tables: list, what: str = "results", ignore: tuple = ()):
        self.ranks, self.out, self.meta, self.tables, self.what, self.ignore = ranks, out, meta, tables, what, ignore
        self.main = self.store = None  # DIR's store (rank 0 only); the store this rank writes
        self.queue = None  # the name of this run's queue of units (`start`)
        self._stack = ExitStack()

    def __enter__(self) -> ShardedRun:
        return self

    def __exit__(self, *exc) -> None:
        if self.store is not None and self.store is not self.main:
            self.store.close()
        self._stack.close()  # DIR's store, then its lock

    def start(self, plan: Callable[[ResultsStore], tuple[list, Any]], hint: str = "") -> tuple[list, Any]:
        """Rank 0 claims DIR (or every rank raises its refusal), merges the ranks' stores an
        interrupted run left, and returns `plan(store)`: (the units with work left, anything else
        the ranks need), which every rank receives. Every rank then checks that it sees DIR as
        rank 0 wrote it (one filesystem), and opens its store. Fewer units than ranks is a
        warning (`hint`: how to make more)."""

        def claim() -> tuple[list, Any, str]:
            self.main = self._stack.enter_context(
                open_results(self.out, self.meta, self.tables, self.what, self.ignore)
            )
            self.main.absorb(rank_dirs(self.out))
            return *plan(self.main), uuid.uuid4().hex  # the run's own queue in the store

        todo, context, self.queue = self.ranks.from_main(claim)
        if self.ranks.is_main and 0 < len(todo) < self.ranks.world_size:
            warnings.warn(
                f"{self.ranks.world_size} ranks for {len(todo)} units of work left: "
                f"{self.ranks.world_size - len(todo)} ranks have nothing to do{hint}",
                stacklevel=2,
            )
        self.ranks.everywhere(self._check_shared)
        self.store = self.main if self.ranks.world_size == 1 else rank_store(self.out, self.ranks.rank, self.tables)
        return todo, context

    def take(self, todo: Sequence[T], cost: Callable[[T], float] | None = None) -> Iterator[T]:
        """This rank's units of `todo` (`Ranks.take`), from this run's queue."""
        return self.ranks.take(todo, cost, self.queue)

    def finish(self, position: Callable[[str, dict], int], summarise: Callable[[ResultsStore], T]) -> T:
        """Once every rank is done, rank 0 merges their stores into DIR's and returns
        `summarise(store)` to every rank."""
        if self.ranks.world_size > 1:
            self.store.close()  # this rank's share is whole on disk
            self.store = None
            self.ranks.wait_for_all()

        def merge() -> T:
            if self.ranks.world_size > 1:
                self.main.absorb(rank_dirs(self.out), position)
            return summarise(self.main)

        return self.ranks.from_main(merge)

    def _check_shared(self) -> None:
        meta = Path(self.out) / "meta.json"
        try:
            seen = json.loads(meta.read_text())
        except (OSError, ValueError):
            seen = None
        if seen != json.loads(json.dumps(self.meta)):
            raise ValueError(
                f"rank {self.ranks.rank} (on {socket.gethostname()}) does not see {meta} as rank 0 wrote it: "
                "--out must be a directory every rank shares (one filesystem)"
            )
