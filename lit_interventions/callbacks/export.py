"""Write the trained intervention next to the TensorBoard logs when fit ends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from lightning import Callback
from safetensors.torch import load_file, save_file

WEIGHTS, CARD = "intervention.safetensors", "intervention.json"


def save_intervention(directory: str | Path, tensors: dict[str, torch.Tensor], card: dict) -> Path:
    """`intervention.safetensors` (the tensors) plus `intervention.json` (a small card)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().float() for k, v in tensors.items()}, directory / WEIGHTS)
    (directory / CARD).write_text(json.dumps(card, indent=2) + "\n")
    return directory / WEIGHTS


def load_intervention(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    return load_file(directory / WEIGHTS), json.loads((directory / CARD).read_text())


def _metrics(trainer) -> dict[str, float]:
    values = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
    return {k: v for k, v in sorted(values.items()) if math.isfinite(v)}


class ExportIntervention(Callback):
    """After fit, rank 0 writes the intervention's basis and a card (model, site, task, k, metrics)
    to the run's log directory."""

    def on_fit_end(self, trainer, pl_module):
        directory = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        data_hp = trainer.datamodule.hparams if trainer.datamodule is not None else {}
        hp = pl_module.hparams
        card = {
            "method": "das",
            "model": hp.lm,
            "layer": hp.layer,
            "region": getattr(trainer.datamodule, "region", hp.region),
            "task": data_hp.get("task"),
            "templates": data_hp.get("templates") or "builtin",
            "control": data_hp.get("control"),
            "k": hp.k,
            "hidden_size": pl_module.intervention.hidden_size,
            "metrics": _metrics(trainer),
        }
        save_intervention(directory, {"basis": pl_module.intervention.basis}, card)
