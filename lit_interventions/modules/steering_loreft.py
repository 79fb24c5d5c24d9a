"""LoReFT as a per-concept steering baseline (Wu et al. 2024, eq. 2; AxBench §4, methods).

Φ(h) = h + Rᵀ(W h + b − R h), R (r × d) with orthonormal rows, on the residual stream after one
block (`layer`) or after each of several (`layers`, one independent intervention per layer), at:

- `positions: all`: every position (prompt and response while training; prompt and every
  generated token while steering), so training and generation see the same edit;
- `positions: fN+lM` (AxBench's sweeps: `f5+l5`): the prompt's first N and last M tokens, each
  count capped at half the prompt's length; the same intervention of a layer serves both ends
  (pyreft's `share_weights`). Training edits those tokens of the instruction (the chat-formatted
  prompt before the response) and no response token; steering edits them when the prompt is
  read, and no generated token (pyvene's `generate(intervene_on_prompt=True)`): the edit reaches
  the generated tokens through the cached keys and values of the prompt.

Positions count from each row's first real token, so left- and right-padded batches edit the
same tokens (`core.positions.prompt_ends`).

Saved: `layer` at every position keeps `LoReFTIntervention`'s own artifact (intervention kind;
tensors rotation, weight, bias); any other setting is a steering artifact whose card records
`layers`, `positions`, `rank` (`loreft_artifact`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn

from lit_interventions.artifacts.intervention_files import save_run_intervention
from lit_interventions.artifacts.loreft_artifact import (
    check_card,
    check_layers,
    layer_tensors,
    loreft_positions,
    split_tensors,
)
from lit_interventions.artifacts.steering_files import LoReFTSteering
from lit_interventions.core.blocks import site_layer
from lit_interventions.core.edits import ApplyRequest, Edit
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import DEFAULT_LM, hidden_size, load_config, num_layers
from lit_interventions.core.positions import PositionTracker, prompt_ends
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.modules.steering_finetuned import FinetunedSteeringModule
from lit_interventions.modules.steering_objective import lm_loss

Chooser = Callable[[torch.Tensor], torch.Tensor] | None  # hidden (b, T, d) -> edited positions (b, T)


def instruction_ends(batch: dict[str, torch.Tensor], n_first: int, n_last: int) -> torch.Tensor:
    """(batch, seq) bool: the first `n_first` and last `n_last` tokens of each row's instruction,
    the real tokens before its first response token (`response_mask`), left or right padded."""
    mask, response = batch["attention_mask"].bool(), batch["response_mask"].bool()
    first = mask.long().argmax(1)  # the first real token
    end = response.long().argmax(1)  # the first response token
    absolute = torch.arange(mask.shape[1], device=mask.device)[None, :].expand_as(mask)
    return prompt_ends(first, end, n_first, n_last, absolute) & mask


class LoReFTModule(FinetunedSteeringModule):
    """LoReFT on one concept: Φ(h) = h + Rᵀ(W h + b − R h) after block `layer` (or each of
    `layers`), at every position or at the prompt's first and last tokens.

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
        layers: several blocks instead of `layer`, one intervention each (AxBench: [5, 10, 15, 20]
            of Gemma-2-2B's 26).
        positions: "all" (every position) or "fN+lM" (the prompt's first N and last M tokens;
            AxBench: "f5+l5"); see the module doc.
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
        layers: list[int] | None = None,
        positions: str = "all",
    ):
        super().__init__()
        self.positions = loreft_positions(positions)
        if layer is not None and layers is not None:
            raise ValueError(f"layer={layer!r} and layers={layers!r}: give one of them")
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)  # before the config is read
        config = load_config(lm)
        layers = None if layers is None else check_layers(layers, num_layers(config))
        layer = site_layer(config, layer) if layers is None else None
        self._setup_common(lm, concept_id, lr, warmup_ratio, weight_decay, dtype)
        self.save_hyperparameters()
        self.hparams.layer = layer
        if layers is None:
            self.intervention = LoReFTIntervention(hidden_size(config), rank)
        else:  # one independent intervention per layer, created in the order given
            self.interventions = nn.ModuleDict({str(i): LoReFTIntervention(hidden_size(config), rank) for i in layers})

    @property
    def single_site(self) -> bool:
        """One layer at every position: saved as `LoReFTIntervention`'s own artifact."""
        return self.hparams.layers is None and self.positions.rule == "all"

    def by_layer(self) -> dict[int, LoReFTIntervention]:
        """{layer: its intervention}, in the order of `layers`."""
        if self.hparams.layers is None:
            return {self.hparams.layer: self.intervention}
        return {int(layer): intervention for layer, intervention in self.interventions.items()}

    @contextmanager
    def _edited(self, model: nn.Module, chosen: Chooser):
        """`model` with Φ after each layer at the positions `chosen(hidden)` picks (None: all)."""
        with ExitStack() as stack:
            for layer, intervention in self.by_layer().items():
                stack.enter_context(residual_hook(model, layer, _edit(intervention, chosen), self.device))
            yield model

    @contextmanager
    def steer(self, model: nn.Module | None = None, factor: float = 1.0):
        """Inside the block, `model` (default the LM) runs with Φ at the module's positions (with
        `fN+lM`: those prompt tokens when a prompt is read, never a generated token); yields it.
        `factor` is accepted for a uniform steering interface and ignored: LoReFT has no strength."""
        model = model if model is not None else self.lm
        if self.positions.rule == "all":
            with self._edited(model, None):
                yield model
            return
        tracker = PositionTracker()  # where each forward (of generate, or of the body alone) is in the sequence
        with (
            tracker.following(model.base_model),
            self._edited(model, lambda h: tracker.mask(self.positions, h.shape[0], h.device)),
        ):
            yield model

    def loss(self, batch) -> torch.Tensor:
        if self.positions.rule == "all":
            with self.steer():
                return lm_loss(self.lm, batch)
        positive = {k: v[batch["label"] == 1] for k, v in batch.items() if k in ("attention_mask", "response_mask")}
        chosen = instruction_ends(positive, *self.positions.indices)  # (positive rows, seq): lm_loss's rows
        with self._edited(self.lm, lambda h: chosen):
            return lm_loss(self.lm, batch)

    def export(self):
        by_layer = self.by_layer()
        site = {"layer": self.hparams.layer} if self.single_site else {"layers": list(by_layer)}
        card = {
            **self._card(),
            **site,
            "rank": self.hparams.rank,
            "positions": str(self.positions),
            "hidden_size": next(iter(by_layer.values())).hidden_size,
        }
        if self.single_site:
            return self.intervention.export(), card
        return layer_tensors({layer: intervention.export() for layer, intervention in by_layer.items()}), card

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None = None) -> LoReFTModule:
        """LoReFT as its card records it (`layer`, or `layers` + `positions`; `rank`), with R, W
        and b from `tensors`, each checked (`loreft_artifact`) against the card and the LM's width."""
        if "layers" not in card:
            return cls._from_single_site(tensors, card, lm)
        layers, rank = check_card(card)
        module = cls(**cls._card_args(card, lm, ("layers", "rank"), positions="all"))  # checks them against the LM
        parts = split_tensors(tensors, layers, rank)
        _check_width(module, parts[layers[0]]["rotation"].shape[1])
        for layer, part in parts.items():
            module.interventions[str(layer)] = LoReFTIntervention.from_tensors(part)
        return module

    @classmethod
    def _from_single_site(cls, tensors: dict[str, torch.Tensor], card: dict, lm: str | None) -> LoReFTModule:
        if set(tensors) != {"rotation", "weight", "bias"}:
            raise ValueError(f"LoReFT tensors are rotation, weight and bias; got {sorted(tensors)}")
        module = cls(**cls._card_args(card, lm, ("layer", "rank"), positions="all"))
        _check_width(module, tensors["rotation"].shape[1])
        module.intervention = LoReFTIntervention.from_tensors(tensors)
        return module

    def site_text(self) -> str:
        layers = list(self.by_layer())
        where = f"block {layers[0]}" if len(layers) == 1 else f"blocks {layers}"
        if self.positions.rule == "all":
            return f"the residual stream after {where}, every position"
        n_first, n_last = self.positions.indices
        return f"the residual stream after {where}, the prompt's first {n_first} and last {n_last} tokens"

    def save(self, directory: str | Path) -> Path:
        """One layer at every position: through the intervention protocol (the card also gets
        class_path and config; config.json and the model card describe the intervention, which
        loads with `from_pretrained`). Otherwise a steering artifact (`FinetunedSteeringModule.save`)."""
        if not self.single_site:
            return super().save(directory)
        return save_run_intervention(directory, self.intervention, self.export()[1])

    def to_pyvene_layers(self) -> dict[int, dict]:
        """{layer: its intervention's `to_pyvene()`} (`lit-interventions export --to pyvene`)."""
        return self.artifact().to_pyvene_layers()

    def artifact(self) -> LoReFTSteering:
        """Its weights as the saved artifact loads (`LoReFTSteering`): what `apply` places on an LM."""
        return LoReFTSteering(self.by_layer(), self.positions, self.hparams.lm)

    def edits(self, config: dict, request: ApplyRequest, where: str = "the LoReFT module") -> list[Edit]:
        """What `lit_interventions.apply` does with it: Φ after each layer, at the module's
        positions unless the request names others (`LoReFTSteering.edits`)."""
        return self.artifact().edits(config, request, where)


def _edit(intervention: LoReFTIntervention, chosen: Chooser) -> Callable[[torch.Tensor], torch.Tensor]:
    def on_hidden(hidden: torch.Tensor) -> torch.Tensor:  # (b, T, d)
        new = intervention(hidden, None).to(hidden.dtype)
        return new if chosen is None else torch.where(chosen(hidden)[..., None].to(hidden.device), new, hidden)

    return on_hidden


def _check_width(module: LoReFTModule, trained: int) -> None:
    width = hidden_size(load_config(module.hparams.lm))
    if width != trained:
        raise ValueError(
            f"the LoReFT weights were trained on hidden size {trained}, but {module.hparams.lm!r} has hidden size {width}"
        )
