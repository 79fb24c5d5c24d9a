"""The DataLoader every data module builds: shuffled for training; for evaluation under DDP, each
example exactly once (Lightning's default sampler pads uneven shards with repeats, which would
bias the synced metrics)."""

from __future__ import annotations

from typing import Callable

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset


def split_loader(dataset: Dataset, batch_size: int, collate_fn: Callable | None, trainer=None, shuffle: bool = False,
                 seed: int | None = None) -> DataLoader:  # fmt: skip
    """Batches of one split; `seed` fixes the shuffling order; `collate_fn` None: torch's default."""
    sampler = None
    if not shuffle and trainer is not None and trainer.world_size > 1:
        sampler = UnrepeatedDistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                               shuffle=False)  # fmt: skip
    generator = torch.Generator().manual_seed(seed) if shuffle and seed is not None else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, generator=generator,
                      collate_fn=collate_fn)  # fmt: skip
