"""Probes g_Z: classifiers of a property Z from the frozen LM's hidden state at one site.

CALM (Davies et al., §5.3 and App. B.3): an MLP with 2 hidden layers (ReLU, dropout 0.1), trained
with BCE (here: BCE for a binary property, cross-entropy for a multi-class one), Adam, 32 epochs,
keeping the epoch with the best validation accuracy. A linear probe is the same module without
hidden layers.

The LM is frozen, so representations are read once (`lit_interventions.core.forward.read_layers`) and the
probe trains on tensors (`ProbeDataModule`). Inputs are standardised inside the probe by fixed
buffers (mean and std of the training representations), so the probe and the gradient attacks
against it act on the raw residual stream, whatever its scale.

A probe records its site (model name, layer, hidden size, token position); `check_site` refuses a
probe trained at another site or on another model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lit_interventions.artifacts.checkpoint_io import read_checkpoint
from lit_interventions.core.loaders import split_loader
from lit_interventions.interventions.base import register_intervention

KINDS = ("linear", "mlp")


def probe_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """BCE-with-logits for one logit per example (binary), else cross-entropy. logits (batch, c)."""
    if logits.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(logits[:, 0].float(), target.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), target, reduction=reduction)


def probe_predict(logits: torch.Tensor) -> torch.Tensor:
    """Class ids from probe logits, (batch,)."""
    if logits.shape[-1] == 1:
        return (logits[:, 0] > 0).long()
    return logits.argmax(-1)


def _network(kind: str, d: int, n_out: int, hidden: int, dropout: float) -> nn.Module:
    if kind == "linear":
        return nn.Linear(d, n_out)
    return nn.Sequential(  # 2 hidden layers, ReLU, dropout (CALM App. B.3)
        nn.Linear(d, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, n_out),
    )


@register_intervention  # a saved attack names its probe's class
class ProbeModule(L.LightningModule):
    """g_Z: hidden state at a site (batch, d) -> logits (batch, 1) if binary else (batch, classes).

    Args:
        classes: the property's values, in label-id order (at least 2).
        lm, layer, hidden_size, position: the site the probe reads (recorded, checked on use).
        kind: "linear" or "mlp". hidden: MLP width (default d, the paper's choice of the input
            width). dropout: MLP dropout (0.1). lr, weight_decay: Adam.
        property_name: what the probe predicts (for messages and reports).
    """

    def __init__(
        self,
        classes: list[str],
        lm: str,
        layer: int,
        hidden_size: int,
        position: str = "entity_last",
        kind: str = "mlp",
        hidden: int | None = None,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        property_name: str = "property",
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not a probe kind; choose one of {', '.join(KINDS)}")
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise ValueError(f"classes={classes!r}: a probe needs at least 2 distinct classes")
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive int")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1)")
        self.save_hyperparameters()
        n_out = 1 if len(classes) == 2 else len(classes)
        self.net = _network(kind, hidden_size, n_out, hidden or hidden_size, dropout)
        self.register_buffer("mean", torch.zeros(hidden_size))  # standardisation, set by `fit_scale`
        self.register_buffer("std", torch.ones(hidden_size))
        self.val_acc = MulticlassAccuracy(num_classes=len(classes), average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=len(classes), average="micro")

    # --- the site -------------------------------------------------------------------------
    @property
    def site(self) -> dict:
        h = self.hparams
        return {"lm": h.lm, "layer": h.layer, "hidden_size": h.hidden_size, "position": h.position}

    def check_site(self, lm: str, layer: int, hidden_size: int, position: str | None = None) -> None:
        """Refuse to be used at a site other than the one the probe was trained on."""
        asked = {"lm": lm, "layer": layer, "hidden_size": hidden_size}
        if position is not None:
            asked["position"] = position
        wrong = {k: v for k, v in asked.items() if self.site[k] != v}
        if wrong:
            raise ValueError(
                f"This probe of {self.hparams.property_name!r} was trained at site {self.site}; it cannot be used at "
                + ", ".join(f"{k}={v!r}" for k, v in wrong.items())
                + ". Train a probe for this site (or load the one that matches)."
            )

    # --- the classifier -------------------------------------------------------------------
    @property
    def classes(self) -> list[str]:
        return list(self.hparams.classes)

    @torch.no_grad()
    def fit_scale(self, features: torch.Tensor) -> None:
        """Set the fixed standardisation from the training representations, (n, d)."""
        self.mean.copy_(features.float().mean(0))
        self.std.copy_(features.float().std(0).clamp(min=1e-6))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.hparams.hidden_size:
            raise ValueError(
                f"The probe of {self.hparams.property_name!r} reads {self.hparams.hidden_size}-d states at site "
                f"{self.site}; got states of size {h.shape[-1]} (another model or site?)"
            )
        return self.net((h.float() - self.mean) / self.std)

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Class ids, (batch,)."""
        return probe_predict(self(h))

    # --- Lightning --------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        h, y = batch
        loss = probe_loss(self(h), y)
        self.log("train/loss", loss, batch_size=len(y))
        return loss

    def _evaluate(self, batch, metric, stage: str) -> None:
        h, y = batch
        logits = self(h)
        metric.update(probe_predict(logits), y)
        self.log(f"{stage}/loss", probe_loss(logits, y), batch_size=len(y), sync_dist=True)
        self.log(f"{stage}/acc", metric, batch_size=len(y))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, self.val_acc, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, self.test_acc, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class ProbeDataModule(L.LightningDataModule):
    """Representations and labels as tensors: train (shuffled) and val splits."""

    def __init__(
        self,
        train: tuple[torch.Tensor, torch.Tensor],
        val: tuple[torch.Tensor, torch.Tensor],
        batch_size: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        for name, (x, y) in {"train": train, "val": val}.items():
            if len(x) == 0 or len(x) != len(y):
                raise ValueError(f"{name} split: {len(x)} representations and {len(y)} labels (need >0, equal)")
        self.train_set, self.val_set = TensorDataset(*train), TensorDataset(*val)
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self):
        return split_loader(self.val_set, 1024, None, self.trainer)  # each example once under DDP


def train_probe(
    probe: ProbeModule,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    epochs: int = 32,
    batch_size: int = 64,
    seed: int = 0,
    save_to: str | Path | None = None,
    callbacks: list | None = None,
) -> ProbeModule:
    """Fit `probe` on (representations (n, d), labels (n,)) and return it with the weights of its best
    validation epoch (ModelCheckpoint on val/acc), in eval mode. `save_to`: also keep that checkpoint.
    `callbacks`: more Lightning callbacks for the fit (e.g. its progress)."""
    if epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be >= 1")
    L.seed_everything(seed, workers=False, verbose=False)
    probe.fit_scale(train[0])
    data = ProbeDataModule((train[0].float(), train[1].long()), (val[0].float(), val[1].long()), batch_size, seed)
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        best = ModelCheckpoint(dirpath=tmp, monitor="val/acc", mode="max", save_top_k=1, filename="best")
        trainer = L.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=[best, *(callbacks or [])],
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
            num_sanity_val_steps=0,
        )
        trainer.fit(probe, datamodule=data)
        checkpoint = torch.load(best.best_model_path, map_location="cpu", weights_only=True)
        probe.load_state_dict(checkpoint["state_dict"])
        probe.best_val_acc = float(best.best_model_score)
        if save_to is not None:
            Path(save_to).parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, save_to)
    return probe.eval()


def load_probe(path: str | Path) -> ProbeModule:
    """A probe saved by `train_probe(save_to=...)`, in eval mode (check its site before use). A
    damaged or crafted file is one ValueError naming it (`read_checkpoint`), before it is built."""
    read_checkpoint(path)
    return ProbeModule.load_from_checkpoint(str(path), map_location="cpu", weights_only=True).eval()
