"""The AxBench steering baselines that finetune per concept: LoReFT and LoRA (AxBench §4, methods).

Both minimise the LM loss −log p(response | instruction) on the positive responses of one
concept (rows with label 1; rows of other concepts are dropped when `concept_id` is set). The LM
stays frozen; only the intervention (LoReFT) or the adapter (LoRA) is trained and saved.

- LoReFT: Φ(h) = h + Rᵀ(W h + b − R h) on the residual stream after block `layer`, at **every
  position** (prompt and response, and every generated token at steering time), so training and
  generation see the same edit.
- LoRA: peft `LoraConfig(r=rank, lora_alpha=32, target_modules=[attention output projection])`
  in every layer (or `layers`), scaled α/r (α/√r with `rslora`). The target is `o_proj` (Llama,
  Gemma, Qwen, SmolLM...); for architectures without it, the attention output projection found
  by name: `out_proj`, `attention.dense` (GPT-NeoX), `attn.c_proj` (GPT-2).

After fit, rank 0 writes `intervention.safetensors` + `intervention.json` (card: method, model,
layer, rank, concept...) and config.json + a README.md model card to the run's log directory.
Each class rebuilds itself from that export (`from_export(tensors, card, lm)`);
`lit_interventions.modules.steering_registry.load_steering_checkpoint` picks the class from the
registered ones by the name the directory (or a Lightning `.ckpt`) records.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torchmetrics import MeanMetric

from lit_interventions.artifacts.hub import artifact_config, intervention_config, write_hub_files
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config, load_lm, num_layers
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.core.parts import attention_output_modules
from lit_interventions.core.sites import residual_hook, site_layer
from lit_interventions.inference.edits import ApplyRequest, Edit
from lit_interventions.inference.lora import lora_edits
from lit_interventions.interventions.base import WEIGHTS, save_intervention, write_tensors
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.modules.site import FrozenLMModule
from lit_interventions.modules.steering_objective import lm_loss
from lit_interventions.modules.steering_registry import CHECKPOINT_KEY


class _SteeringModule(FrozenLMModule):
    """Shared loop: filter the batch to one concept, LM loss, AdamW with a linear schedule."""

    method = ""

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
    def from_export(cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None = None) -> _SteeringModule:
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
        """Write intervention.safetensors (trainable weights only) and intervention.json, and the
        same as config.json (kind "steering") + a README.md model card."""
        tensors, card = self.export()
        path = write_tensors(directory, tensors, card)
        write_hub_files(directory, artifact_config("steering", self, card, WEIGHTS, site=self.site_text()))
        return path

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


class LoReFTModule(_SteeringModule):
    """LoReFT on one concept: Φ(h) = h + Rᵀ(W h + b − R h) at every position after block `layer`.

    Args:
        lm: the frozen LM (embedded name, .gguf, local directory or hub id).
        layer: residual stream after this block (-1 = embeddings); default the middle layer.
        rank: r, the rank of R and W.
        concept_id: train on rows of this concept id only (None: every positive row in the data,
            for a data module that holds one concept).
        concept: the concept's name, written to the card (default: from the data module).
        lr, weight_decay, warmup_ratio: AdamW with linear warmup, then linear decay to 0.
        dtype: the LM's dtype.
        device_map, quantization, max_memory, offload_folder: where the frozen LM is placed, for
            one larger than a GPU (`lit_interventions.core.sharding`): e.g. device_map "auto" spreads
            it over the GPUs, quantization "4bit" loads it in NF4; the trained weights stay float32.
    """

    method = "loreft"

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        rank: int = 4,
        concept_id: int | None = None,
        concept: str | None = None,
        lr: float = 5e-3,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        dtype: str = "float32",
        device_map: str | int | dict | None = None,
        quantization: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | None = None,
    ):
        super().__init__()
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)  # before the config is read
        config = load_config(lm)
        layer = site_layer(config, layer)
        self._setup_common(lm, concept_id, lr, warmup_ratio, weight_decay, dtype)
        self.save_hyperparameters()
        self.hparams.layer = layer
        self.intervention = LoReFTIntervention(hidden_size(config), rank)

    @contextmanager
    def steer(self, model: nn.Module | None = None, factor: float = 1.0):
        """Inside the block, `model` (default the LM) runs with Φ at every position; yields it.
        `factor` is accepted for a uniform steering interface and ignored: LoReFT has no strength."""
        model = model if model is not None else self.lm
        with residual_hook(model, self.hparams.layer, lambda h: self.intervention(h, None).to(h.dtype), self.device):
            yield model

    def loss(self, batch) -> torch.Tensor:
        with self.steer():
            return lm_loss(self.lm, batch)

    def export(self):
        card = {
            **self._card(),
            "layer": self.hparams.layer,
            "rank": self.hparams.rank,
            "positions": "all",
            "hidden_size": self.intervention.hidden_size,
        }
        return self.intervention.export(), card

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None = None) -> LoReFTModule:
        """LoReFT at the card's layer and rank, with R, W and b from `tensors` (checked against the LM's width)."""
        if set(tensors) != {"rotation", "weight", "bias"}:
            raise ValueError(f"LoReFT tensors are rotation, weight and bias; got {sorted(tensors)}")
        module = cls(**cls._card_args(card, lm, ("layer", "rank")))
        trained = tensors["rotation"].shape[1]
        if module.intervention.hidden_size != trained:
            raise ValueError(
                f"the LoReFT weights were trained on hidden size {trained}, but {module.hparams.lm!r} has "
                f"hidden size {module.intervention.hidden_size}"
            )
        module.intervention = LoReFTIntervention.from_tensors(tensors)
        return module

    def save(self, directory: str | Path) -> Path:
        """Through the intervention protocol: the card also gets class_path and config; config.json
        and the model card describe the intervention (it loads with `from_pretrained`)."""
        _, card = self.export()
        path = save_intervention(directory, self.intervention, card)
        write_hub_files(directory, intervention_config(self.intervention, card))
        return path


class LoRAModule(_SteeringModule):
    """LoRA on one concept (peft): W₀x + (α/r)·B A x (α/√r with `rslora`) on the attention output projection.

    Args:
        lm: the LM; a private copy gets the adapter (the shared frozen LM is never modified).
        rank: r; alpha: lora_alpha (the paper: 32); dropout: lora_dropout.
        rslora: scale the update by α/√r (rank-stabilised LoRA, peft's `use_rslora`; AxBench's
            sweeps) instead of α/r.
        target_modules: module name suffixes; default the attention output projection
            (`o_proj`, or the architecture's equivalent, `core.parts.ATTENTION_OUTPUTS`).
        layers: layer indices that get adapters (default: all).
        concept_id, concept, lr, weight_decay, warmup_ratio, dtype: as `LoReFTModule`.
    """

    method = "lora"

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        rank: int = 4,
        alpha: int = 32,
        dropout: float = 0.0,
        rslora: bool = False,
        target_modules: list[str] | None = None,
        layers: list[int] | None = None,
        concept_id: int | None = None,
        concept: str | None = None,
        lr: float = 5e-3,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        dtype: str = "float32",
    ):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive integer")
        n_layers = num_layers(load_config(lm))
        for layer in layers or []:
            if not 0 <= layer < n_layers:
                raise ValueError(f"layers={layers!r}: each must be in 0..{n_layers - 1}")
        self._setup_common(lm, concept_id, lr, warmup_ratio, weight_decay, dtype)
        model = copy.deepcopy(load_lm(lm, dtype))  # peft injects in place: never into the shared copy
        target_modules = list(target_modules) if target_modules else attention_output_modules(model)
        self.save_hyperparameters()
        self.hparams.target_modules = target_modules
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            use_rslora=bool(rslora),
            target_modules=target_modules,
            layers_to_transform=layers,
            bias="none",
        )
        peft_model = get_peft_model(model, config)
        self._frozen["peft"] = peft_model
        self._frozen["dropouts"] = [m for name, m in peft_model.named_modules() if name.endswith("lora_dropout")]
        # The adapter's parameters, registered here too: the optimizer, DDP and state_dict see only them.
        self.adapter = nn.ParameterDict(
            {name.replace(".", "__"): p for name, p in peft_model.named_parameters() if p.requires_grad}
        )
        if not len(self.adapter):
            raise ValueError(f"target_modules={target_modules!r} matched no module of {lm!r}")

    @property
    def lm(self) -> nn.Module:
        """The LM with the adapter injected (a private copy)."""
        model = self._frozen["peft"].get_base_model()
        if model.device != self.device:
            model.to(self.device)
        return model

    @contextmanager
    def steer(self, model: nn.Module | None = None, factor: float = 1.0):
        """Yields the adapted LM (`model` is ignored: the adapter lives in a private copy)."""
        yield self.lm

    def loss(self, batch) -> torch.Tensor:
        for dropout in self._frozen["dropouts"]:
            dropout.train(self.training)  # the LM itself stays in eval mode
        return lm_loss(self.lm, batch)

    def export(self):
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(self._frozen["peft"])
        card = {
            **self._card(),
            "rank": self.hparams.rank,
            "alpha": self.hparams.alpha,
            "target_modules": self.hparams.target_modules,
            "layers": self.hparams.layers,
            "dropout": self.hparams.dropout,
            "rslora": bool(self.hparams.rslora),
        }
        return tensors, card

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None = None) -> LoRAModule:
        """LoRA with the card's rank, alpha, targets and layers, and the adapter from `tensors`."""
        module = cls(
            **cls._card_args(card, lm, ("rank", "alpha", "target_modules"), layers=None, dropout=0.0, rslora=False)
        )
        module.load_adapter(tensors)
        return module

    def site_text(self) -> str:
        where = "every layer" if self.hparams.layers is None else f"layers {list(self.hparams.layers)}"
        return f"the attention output projections ({', '.join(self.hparams.target_modules)}) of {where}"

    @property
    def scaling(self) -> float:
        """The update's scale: α/r, or α/√r with `rslora`."""
        rank = self.hparams.rank
        return self.hparams.alpha / (math.sqrt(rank) if self.hparams.rslora else rank)

    def edits(self, config: dict, request: ApplyRequest, where: str = "the LoRA adapter") -> list[Edit]:
        """What `lit_interventions.apply` does with it: W₀x + `scaling`·B A x on each adapted module
        of the LM given (found by name), at every position unless the request names others."""
        tensors, _ = self.export()
        return lora_edits(tensors, self.scaling, request, {**config, "model": self.hparams.lm}, where)

    def peft_adapter(self) -> tuple:
        """(its peft LoraConfig, its state dict as peft saves it): `lit-interventions export --to peft`."""
        return self._frozen["peft"].peft_config["default"], self.export()[0]

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self._frozen["peft"], tensors)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"adapter tensors do not fit this model: unexpected {result.unexpected_keys[:3]}")
