"""The AxBench steering baselines that finetune per concept: LoReFT and LoRA (AxBench §4, methods).

- LoReFT (`steering_loreft.LoReFTModule`): Φ(h) = h + Rᵀ(W h + b − R h)
  on the residual stream after one or several blocks, at every position or at the prompt's first
  and last tokens (AxBench's `f5+l5`).
- LoRA: peft `LoraConfig(r=rank, lora_alpha=32, target_modules=[attention output projection])`
  in every layer (or `layers`), scaled α/r (α/√r with `rslora`). The target is `o_proj` (Llama,
  Gemma, Qwen, SmolLM...); for architectures without it, the attention output projection found
  by name: `out_proj`, `attention.dense` (GPT-NeoX), `attn.c_proj` (GPT-2).

Both share the loop of `steering_finetuned.FinetunedSteeringModule` (LM loss on one concept's
positive responses, AdamW, export after fit).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager

import torch
from torch import nn

from lit_interventions.core.edits import ApplyRequest, Edit
from lit_interventions.core.lm import DEFAULT_LM, load_config, load_lm, num_layers
from lit_interventions.core.lora import lora_edits
from lit_interventions.core.parts import attention_output_modules
from lit_interventions.modules.steering_finetuned import FinetunedSteeringModule
from lit_interventions.modules.steering_loreft import LoReFTModule  # noqa: F401  (a class path run configs name: modules.steering_baselines.LoReFTModule)
from lit_interventions.modules.steering_objective import lm_loss


class LoRAModule(FinetunedSteeringModule):
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
