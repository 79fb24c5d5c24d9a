"""The DataLoader every data module builds: shuffled for training; for evaluation under DDP, each
example exactly once (Lightning's default sampler pads uneven shards with repeats, which would
bias the synced metrics); and `ResumableLoader`, which a fit resumed mid-epoch picks up where the
interrupted one stopped."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset


def split_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable | None,
    trainer=None,
    shuffle: bool = False,
    seed: int | None = None,
) -> DataLoader:
    """Batches of one split; `seed` fixes the shuffling order; `collate_fn` None: torch's default."""
    sampler = None
    if not shuffle and trainer is not None and trainer.world_size > 1:
        sampler = UnrepeatedDistributedSampler(
            dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
        )
    generator = torch.Generator().manual_seed(seed) if shuffle and seed is not None else None
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, generator=generator, collate_fn=collate_fn
    )


class ResumableLoader:
    """`loader`, resumable mid-epoch: its state (Lightning's `state_dict` / `load_state_dict`,
    saved with the fit's checkpoint) is the number of batches the training steps have used so far
    (`used()`), and the first pass after loading a state skips that many. Counted by the steps,
    not by the iterator, which Lightning reads one batch ahead. The batches are the ones an
    uninterrupted pass gives when the shuffling is seeded (`split_loader(seed=...)`)."""

    def __init__(self, loader: DataLoader, used: Callable[[], int]):
        self.loader, self.used, self.skip = loader, used, 0

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def collate_fn(self) -> Callable | None:
        return self.loader.collate_fn

    def __iter__(self):  # a generator: nothing is drawn until the first batch (Lightning calls iter() to check)
        skip, self.skip = self.skip, 0
        yield from islice(self.loader, skip, None)

    def state_dict(self) -> dict:
        return {"batches": self.used()}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["batches"]
