"""A sparse autoencoder on the site activations of a frozen LM: RAVEL's SAE featurizer (Huang et al. 2024, §4).

    f = ReLU(W1 (x − b2) + b1),   x̂ = W2 f + b2,   latent size 4d,   loss = MSE(x̂, x) + λ ‖f‖₁

Choices the paper leaves open (common practice, e.g. Bricken et al. 2023):
- inputs are centred-and-scaled for training: x ↦ c·x with c such that E‖c(x − μ)‖² = d, so λ
  means the same at every model and layer; the exported weights fold c back in and act on raw x;
- MSE is the mean over the d coordinates; ‖f‖₁ the sum over latents; both averaged over a batch;
- decoder columns (W2[:, j]) are renormalised to unit norm after every step (in the scaled space),
  so the L1 penalty cannot be dodged by shrinking f and growing W2; W1 starts as W2ᵀ, b2 at the
  mean, b1 at 0; Adam.

Train it: `lit-interventions fit --config configs/sae.yaml`. After fit,
`sae.safetensors` (W1, b1, W2, b2 on raw activations; no LM weights) and one card, config.json
(kind "sae"), are written to the run's log directory; `SAEFeaturizer.load(path)` reads the weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning import Callback, LightningModule
from safetensors.torch import save_file
from torch import nn
from torchmetrics import Metric

from lit_interventions.artifacts.hub import artifact_config, trainer_command, write_run_card
from lit_interventions.core.files import finite_values, write_atomically

WEIGHTS, CARD = "sae.safetensors", "sae.json"


class SparseAutoencoder(nn.Module):
    """W1: (m, d), b1: (m,), W2: (d, m), b2: (d,), all in the scaled space x_s = scale · x."""

    def __init__(self, hidden_size: int, latent_size: int | None = None):
        super().__init__()
        latent_size = 4 * hidden_size if latent_size is None else latent_size
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive integer")
        if not isinstance(latent_size, int) or latent_size < 1:
            raise ValueError(f"latent_size={latent_size!r} must be a positive integer (default 4 × hidden_size)")
        W2 = torch.randn(hidden_size, latent_size)
        W2 /= W2.norm(dim=0, keepdim=True)
        self.W1 = nn.Parameter(W2.T.clone())
        self.b1 = nn.Parameter(torch.zeros(latent_size))
        self.W2 = nn.Parameter(W2)
        self.b2 = nn.Parameter(torch.zeros(hidden_size))
        self.register_buffer("scale", torch.tensor(1.0))

    @torch.no_grad()
    def initialize(self, mean: torch.Tensor, scale: float) -> None:
        """Input scale c and b2 = c·μ (the scaled mean)."""
        self.scale.fill_(float(scale))
        self.b2.copy_(mean.to(self.b2) * float(scale))

    def encode_scaled(self, x_s: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., m)
        return torch.relu((x_s - self.b2) @ self.W1.T + self.b1)

    def decode_scaled(self, f: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., d)
        return f @ self.W2.T + self.b2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """f = ReLU(W1 (c·x − b2) + b1) on raw activations x."""
        return self.encode_scaled(x * self.scale)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """x̂ = (W2 f + b2) / c, in raw coordinates."""
        return self.decode_scaled(f) / self.scale

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W2 /= self.W2.norm(dim=0, keepdim=True).clamp_min(1e-8)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """W1, b1, W2, b2 acting on raw x (the scale folded in): f = ReLU(W1(x − b2) + b1), x̂ = W2 f + b2."""
        c = self.scale.detach()
        return {
            "W1": (self.W1 * c).detach().cpu(),
            "b1": self.b1.detach().cpu().clone(),
            "W2": (self.W2 / c).detach().cpu(),
            "b2": (self.b2 / c).detach().cpu(),
        }


class Reconstruction(Metric):
    """MSE, fraction of variance unexplained and L0 (active latents per example) of an SAE."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name in ("sse", "sst", "active"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("elements", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor, reconstruction: torch.Tensor, latents: torch.Tensor, mean: torch.Tensor) -> None:
        self.sse += (reconstruction - x).double().pow(2).sum()
        self.sst += (x - mean).double().pow(2).sum()
        self.active += (latents > 0).double().sum()
        self.count += x.shape[0]
        self.elements += x.numel()

    def compute(self) -> dict[str, torch.Tensor]:
        return {
            "mse": self.sse / self.elements.clamp_min(1),
            "fvu": self.sse / self.sst.clamp_min(1e-12),
            "l0": self.active / self.count.clamp_min(1),
        }


class SAEModule(LightningModule):
    """Trains a `SparseAutoencoder` on batches of activations ((B, d) tensors or 1-tuples of them).

    Args:
        hidden_size: d (the CLI takes it from the data module).
        latent_size: m (default 4d, the paper's).
        l1_coefficient: λ in MSE + λ‖f‖₁ (in the scaled space, see the module docstring).
        lr: Adam learning rate.
        normalize_decoder: renormalise the decoder columns after every step.
    """

    def __init__(
        self,
        hidden_size: int,
        latent_size: int | None = None,
        l1_coefficient: float = 2e-3,
        lr: float = 1e-3,
        normalize_decoder: bool = True,
    ):
        super().__init__()
        if not math.isfinite(l1_coefficient) or l1_coefficient < 0:
            raise ValueError(f"l1_coefficient={l1_coefficient!r} must be a finite number ≥ 0")
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        self.save_hyperparameters()
        self.sae = SparseAutoencoder(hidden_size, latent_size)
        self.val_metric = Reconstruction()
        self.register_buffer("data_mean", torch.zeros(hidden_size))

    def on_fit_start(self) -> None:
        """Scale and mean from the data module (`mean`, `scale` after its setup), if it has them."""
        data = getattr(self.trainer, "datamodule", None)
        if data is not None and getattr(data, "mean", None) is not None and self.global_step == 0:
            self.sae.initialize(data.mean.to(self.device), data.scale)
            self.data_mean.copy_(data.mean)

    @staticmethod
    def _inputs(batch) -> torch.Tensor:
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def losses(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """MSE and ‖f‖₁ in the scaled space, for raw activations x (B, d)."""
        x_s = x * self.sae.scale
        f = self.sae.encode_scaled(x_s)
        mse = (self.sae.decode_scaled(f) - x_s).pow(2).mean()
        l1 = f.abs().sum(-1).mean()
        return {
            "loss": mse + self.hparams.l1_coefficient * l1,
            "mse": mse,
            "l1": l1,
            "l0": (f > 0).float().sum(-1).mean(),
        }

    def training_step(self, batch, batch_idx):
        x = self._inputs(batch)
        losses = self.losses(x)
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, prog_bar=True, batch_size=len(x))
        return losses["loss"]

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.hparams.normalize_decoder:
            self.sae.normalize_decoder()

    def validation_step(self, batch, batch_idx):
        x = self._inputs(batch)
        f = self.sae.encode(x)
        self.val_metric.update(x, self.sae.decode(f), f, self.data_mean)

    def on_validation_epoch_end(self):
        self.log_dict({f"val/{k}": v for k, v in self.val_metric.compute().items()}, prog_bar=True)
        self.val_metric.reset()

    def configure_optimizers(self):
        return torch.optim.Adam(self.sae.parameters(), lr=self.hparams.lr)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.sae.export_weights()


class ExportSAE(Callback):
    """After fit, rank 0 writes `sae.safetensors` (W1, b1, W2, b2 on raw activations) and one card,
    config.json, with a README.md model card (`hub.write_run_card`; loads with `from_pretrained`)."""

    def on_fit_end(self, trainer, pl_module):
        directory = Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous().float() for k, v in pl_module.export_weights().items()}
        write_atomically(directory / WEIGHTS, lambda tmp: save_file(tensors, tmp))
        data_hp = dict(trainer.datamodule.hparams) if trainer.datamodule is not None else {}
        card = {
            "method": "sae",
            "model": data_hp.get("lm"),
            "layer": data_hp.get("layer"),
            "entity_type": data_hp.get("entity_type"),
            "positions": data_hp.get("positions"),
            "hidden_size": pl_module.hparams.hidden_size,
            "latent_size": pl_module.sae.W1.shape[0],
            "l1_coefficient": pl_module.hparams.l1_coefficient,
            "metrics": dict(sorted(finite_values(trainer.callback_metrics).items())),
            "command": trainer_command(trainer, directory),
        }
        write_run_card(directory, artifact_config("sae", SparseAutoencoder, card, WEIGHTS), CARD, card)
