"""Write the trained intervention next to the TensorBoard logs when fit ends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from lightning import Callback
from safetensors.torch import load_file, save_file

from lit_interventions.interventions.mask import SigmoidMaskIntervention
from lit_interventions.interventions.rotation import RotatedSpaceIntervention

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


def exported_tensors(intervention) -> dict[str, torch.Tensor] | None:
    """What a trained interchange intervention is: a DAS basis W (k, d), or a DBM mask σ(m/T) (d,)."""
    if isinstance(intervention, RotatedSpaceIntervention):
        return {"basis": intervention.basis}
    if isinstance(intervention, SigmoidMaskIntervention):
        return {"mask": intervention.weights()}
    return None


class ExportIntervention(Callback):
    """After fit, rank 0 writes the trained interchange intervention (a DAS basis or a DBM mask)
    and a card (model, site, data, metrics) to the run's log directory. Modules with other
    interventions (steering, featurizers) are skipped: they export themselves."""

    def on_fit_end(self, trainer, pl_module):
        directory = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        tensors = exported_tensors(getattr(pl_module, "intervention", None))
        if not trainer.is_global_zero or tensors is None:
            return
        data_hp = dict(trainer.datamodule.hparams) if trainer.datamodule is not None else {}
        hp = pl_module.hparams
        card = {
            "method": hp.get("method", "das"),
            "model": hp.lm,
            "layer": hp.layer,
            "k": hp.get("k") if "basis" in tensors else None,
            "hidden_size": next(iter(tensors.values())).shape[-1],
            "data": {k: v for k, v in data_hp.items() if k != "lm" and not k.startswith("_")},  # not _class_path
            "metrics": _metrics(trainer),
        }
        if "task" in data_hp:  # CausalGym
            card.update(region=getattr(trainer.datamodule, "region", hp.get("region")), task=data_hp["task"],
                        templates=data_hp.get("templates") or "builtin", control=data_hp.get("control"))  # fmt: skip
        save_intervention(directory, tensors, card)
