"""The loop shared by AxBench's steering baselines that finetune per concept (LoReFT, LoRA).

Both minimise the LM loss −log p(response | instruction) on the positive responses of one
concept (rows with label 1; rows of other concepts are dropped when `concept_id` is set), with
AdamW and a linear schedule. The LM stays frozen; only the intervention (LoReFT) or the adapter
(LoRA) is trained and saved.

After fit, rank 0 writes the module's export to the run's log directory: its tensors, a card
(method, model, concept...) and config.json + a README.md model card. Each subclass rebuilds
itself from that export (`from_export(tensors, card, lm)`);
`lit_interventions.modules.steering_registry.load_steering_checkpoint` picks the class from the
registered ones by the name the directory (or a Lightning `.ckpt`) records.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torchmetrics import MeanMetric

from lit_interventions.artifacts.hub import artifact_config, write_run_card
from lit_interventions.artifacts.intervention_files import CARD, WEIGHTS, write_weights
from lit_interventions.core.lm import check_dtype
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.modules.site import FrozenLMModule
from lit_interventions.modules.steering_registry import CHECKPOINT_KEY


class FinetunedSteeringModule(FrozenLMModule):
    """Shared loop: filter the batch to one concept, LM loss, AdamW with a linear schedule."""

    method = ""
    edits_base_alone = True  # steering: the LM edited alone, no source state (`capabilities.SourceFree`)

    def _setup_common(
        self, lm: str, concept_id: int | None, lr: float, warmup_ratio: float, weight_decay: float, dtype: str
    ):
        self.optimizer_args = OptimizerArgs(lr, warmup_ratio, "adamw", weight_decay)  # validated before any load
        check_dtype(dtype)
        if concept_id is not None and (not isinstance(concept_id, int) or concept_id < 0):
            raise ValueError(f"concept_id={concept_id!r} must be a non-negative integer or None (all rows)")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self._frozen: dict[str, nn.Module] = {}  # the LM, kept out of state_dict and DDP

    def _concept_rows(self, batch):
        if self.hparams.concept_id is None:
            return batch
        keep = batch["concept_id"] == self.hparams.concept_id
        return {k: v[keep] if torch.is_tensor(v) and v.shape[:1] == keep.shape else v for k, v in batch.items()}

    def loss(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        batch = self._concept_rows(batch)
        if not (batch["label"] == 1).any():  # nothing of this concept in the batch
            if self.trainer.world_size == 1:
                return None  # skip the step
            # DDP needs every process in every backward: a zero loss adds zero to the mean gradient
            return sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=int((batch["label"] == 1).sum()))
        return loss

    def _evaluate(self, batch, metric: MeanMetric):
        batch = self._concept_rows(batch)
        if (batch["label"] == 1).any():  # weighted by lm_loss's token count: the token mean over the split
            tokens = int(batch["response_mask"][batch["label"] == 1][:, 1:].sum())
            metric.update(self.loss(batch), weight=tokens)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, self.val_loss)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, self.test_loss)

    def on_validation_epoch_end(self):
        self.log("val/loss", self.val_loss.compute(), prog_bar=True)
        self.val_loss.reset()

    def on_test_epoch_end(self):
        self.log("test/loss", self.test_loss.compute())
        self.test_loss.reset()

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return self.optimizer_args.lightning(params, self.trainer.estimated_stepping_batches)

    def export(self) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError

    @classmethod
    def from_export(
        cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None = None
    ) -> FinetunedSteeringModule:
        """The module `export()` described, rebuilt from its tensors and card; `lm` overrides the
        card's model."""
        raise NotImplementedError

    @classmethod
    def _card_args(cls, card: dict, lm: str | None, required: tuple[str, ...], **optional) -> dict:
        """`__init__` arguments from a card: the LM (`lm`, else the card's model), the concept, the
        `required` keys and the `optional` ones (with these defaults)."""
        if missing := [key for key in ("model", *required) if key not in card and not (key == "model" and lm)]:
            raise ValueError(f"a {cls.method} card needs {', '.join(missing)}; it holds {sorted(card)}")
        return {
            "lm": lm or card["model"],
            "concept": card.get("concept"),
            "concept_id": card.get("concept_id"),
            **{key: card[key] for key in required},
            **{key: card.get(key, default) for key, default in optional.items()},
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """A Lightning checkpoint records the registered name of its class (`steering_registry`)."""
        checkpoint[CHECKPOINT_KEY] = self.method

    def site_text(self) -> str:
        """Where the module edits the LM, in words (the model card's site)."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        """Write intervention.safetensors (trainable weights only) and one card, config.json (kind
        "steering"), with a README.md model card (`hub.write_run_card`). Returns the card's path."""
        tensors, card = self.export()
        config = artifact_config("steering", self, card, WEIGHTS, site=self.site_text())
        write_weights(directory, tensors)
        return write_run_card(directory, config, CARD, card)

    def on_fit_end(self):
        directory = self.trainer.log_dir or self.trainer.default_root_dir  # a collective under DDP
        if self.trainer.is_global_zero:
            self.save(directory)

    def _card(self) -> dict:
        names = getattr(self.trainer.datamodule, "concepts", None) if self._trainer is not None else None
        concept = self.hparams.concept
        if concept is None and names and self.hparams.concept_id is not None:
            concept = names[self.hparams.concept_id]
        elif concept is None and names and len(names) == 1:
            concept = names[0]
        return {
            "method": self.method,
            "model": self.hparams.lm,
            "concept": concept,
            "concept_id": self.hparams.concept_id,
            "metrics": {
                k: float(v)
                for k, v in (self.trainer.callback_metrics.items() if self._trainer is not None else [])
                if torch.as_tensor(v).numel() == 1
            },
        }
