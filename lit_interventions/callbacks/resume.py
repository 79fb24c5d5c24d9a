"""Progress saved during a long fit, for `Trainer.fit(ckpt_path=...)` to resume from
(`SaveProgress`): the sweep's DAS loop, which trains every site of a task for up to an hour."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from lightning.pytorch import Callback


class SaveProgress(Callback):
    """Every `every` of wall time, after a training step, Lightning's checkpoint of the fit (the
    weights, every optimiser and schedule, the loop's counters and its loaders' states) replaces
    `path` (written whole, then moved: never half a file). `ModelCheckpoint` is not used: under
    manual optimisation it saves only every N optimiser steps, and a step of the DAS loop makes
    one per site."""

    def __init__(self, path: str | Path, every: timedelta = timedelta(minutes=5)):
        self.path, self.every = Path(path), every.total_seconds()
        self._last = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if time.monotonic() - self._last >= self.every:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.path)
            self._last = time.monotonic()
