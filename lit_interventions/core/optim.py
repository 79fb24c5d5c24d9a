"""The optimizer and schedule every trained intervention shares: Adam or AdamW, linear warmup over
the first `warmup_ratio` of the steps, then linear decay to 0 (the CausalGym paper's schedule;
AxBench's with warmup 0). One typed piece, as litgpt's `TrainArgs`, instead of a copy per module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import get_linear_schedule_with_warmup

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@dataclass
class OptimizerArgs:
    """lr: learning rate (> 0); warmup_ratio: linear warmup share of the steps, in [0, 1);
    name: adam or adamw; weight_decay: AdamW's (>= 0; Adam takes none)."""

    lr: float = 5e-3
    warmup_ratio: float = 0.1
    name: str = "adam"
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer name={self.name!r} is not one of {', '.join(OPTIMIZERS)}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise ValueError(f"lr={self.lr!r} must be a finite number > 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio!r} must be in [0, 1)")
        if not 0.0 <= self.weight_decay < float("inf"):
            raise ValueError(f"weight_decay={self.weight_decay!r} must be a finite number >= 0")
        if self.name == "adam" and self.weight_decay:
            raise ValueError(f"weight_decay={self.weight_decay!r} needs name='adamw' (Adam's L2 is not decoupled)")

    def build(self, parameters: Iterable[torch.nn.Parameter], total_steps: int):
        """(optimizer, per-step linear schedule) over `total_steps` (at least 1)."""
        kwargs = {"weight_decay": self.weight_decay} if self.name == "adamw" else {}
        optimizer = OPTIMIZERS[self.name](parameters, lr=self.lr, **kwargs)
        total = max(1, int(total_steps))
        return optimizer, get_linear_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)

    def lightning(self, parameters: Iterable[torch.nn.Parameter], total_steps: int) -> dict:
        """What `LightningModule.configure_optimizers` returns: the schedule steps every batch."""
        optimizer, schedule = self.build(parameters, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
