"""The DataLoader every data module builds: shuffled for training (`EpochSampler`; under DDP each
rank its shard, as Lightning would inject it); for evaluation under DDP, each example exactly once
(Lightning's default sampler pads uneven shards with repeats, which would bias the synced
metrics); and `ResumableLoader`, which a fit resumed mid-epoch picks up where the interrupted one
stopped."""

from __future__ import annotations

import os
from collections.abc import Callable
from itertools import islice

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler


class EpochSampler(Sampler[int]):
    """`RandomSampler`'s order, drawn afresh for every pass exactly as `RandomSampler` draws it
    (`generator` None: from a seed taken from torch's global generator; else from `generator`),
    with what the pass's order was drawn from kept in `order` ({"seed": int} or
    {"generator": the generator's state}). `restore(order)` makes the next pass draw that same
    order, and a seeded generator go on from there as it did."""

    def __init__(self, data_source, generator: torch.Generator | None = None):
        self.data_source, self.generator = data_source, generator
        self.order: dict | None = None
        self._restore: dict | None = None

    def __len__(self) -> int:
        return len(self.data_source)

    def restore(self, order: dict) -> None:
        self._restore = order

    def __iter__(self):
        restore, self._restore = self._restore, None
        if self.generator is None:
            seed = restore["seed"] if restore else int(torch.empty((), dtype=torch.int64).random_().item())
            self.order = {"seed": seed}
            generator = torch.Generator()
            generator.manual_seed(seed)
        else:
            if restore:
                self.generator.set_state(restore["generator"])
            self.order = {"generator": self.generator.get_state()}
            generator = self.generator
        yield from RandomSampler(self.data_source, generator=generator)


def split_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable | None,
    trainer=None,
    shuffle: bool = False,
    seed: int | None = None,
) -> DataLoader:
    """Batches of one split; `seed` fixes the shuffling order; `collate_fn` None: torch's default."""
    generator = torch.Generator().manual_seed(seed) if shuffle and seed is not None else None
    sampler = EpochSampler(dataset, generator) if shuffle else None
    if trainer is not None and trainer.world_size > 1:
        ranks = {"num_replicas": trainer.world_size, "rank": trainer.global_rank}
        if shuffle:  # what Lightning injects into a shuffled loader (seeded by seed_everything)
            sampler = DistributedSampler(dataset, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", 0)), **ranks)
        else:
            sampler = UnrepeatedDistributedSampler(dataset, shuffle=False, **ranks)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=generator, collate_fn=collate_fn)


class ResumableLoader:
    """`loader`, resumable mid-epoch: its state (Lightning's `state_dict` / `load_state_dict`,
    saved with the fit's checkpoint) is the number of batches the training steps have used so far
    in this pass (`used()`), and the first pass after loading a state skips that many.

    `exact=True` also keeps what the pass's order was drawn from (an `EpochSampler`'s `order`) and
    torch's global random state at the save: the resumed pass draws the same order whatever the
    global generator holds, and the global state is set back as it was at the save once the used
    batches are skipped (at the start of the next pass when the save came at the end of one), so
    the passes after it (and anything else drawing from it) go on as in an uninterrupted run.
    Without it, the batches are the ones an uninterrupted pass gives when the shuffling is seeded
    (`split_loader(seed=...)`) and the save came in the first pass."""

    def __init__(self, loader: DataLoader, used: Callable[[], int], exact: bool = False):
        self.loader, self.used, self.exact = loader, used, exact
        self.skip, self._rng = 0, None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def collate_fn(self) -> Callable | None:
        return self.loader.collate_fn

    @property
    def sampler(self) -> Sampler | None:  # Lightning calls a DistributedSampler's set_epoch through it
        return getattr(self.loader, "sampler", None)

    def __iter__(self):  # a generator: nothing is drawn until the first batch (Lightning calls iter() to check)
        skip, self.skip = self.skip, 0
        rng, self._rng = self._rng, None
        if rng is not None and not skip:
            torch.set_rng_state(rng)
        batches = iter(self.loader)
        if skip:
            for _ in islice(batches, skip):
                pass
            if rng is not None:
                torch.set_rng_state(rng)
        yield from batches

    def state_dict(self) -> dict:
        state = {"batches": self.used()}
        if self.exact:
            state["rng"] = torch.get_rng_state()
            order = getattr(self.sampler, "order", None)  # an EpochSampler's (a DistributedSampler's is its epoch)
            if order is not None:
                state["order"] = order
        return state

    def load_state_dict(self, state: dict) -> None:
        batches = state["batches"]
        self.skip = batches if batches < len(self) else 0
        if self.exact and "rng" in state:
            self._rng = state["rng"]
            if "order" in state and 0 < batches < len(self):
                self.sampler.restore(state["order"])
