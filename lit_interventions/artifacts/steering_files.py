"""A steering artifact (kind "steering") loaded as what `apply`, `serve` and `export` use: its
weights and the hooks that place them on an LM, never the LM itself.

    saved by          loads as         edits the LM                       exports to
    LoRAModule        `LoRAAdapter`    W₀x + scale·B A x on each adapted  peft (`peft_adapter`)
                                       module (`core.lora`)
    LoReFTModule      `LoReFTSteering` Φ(h) = h + Rᵀ(W h + b − R h) after pyvene (`to_pyvene_layers`)
                                       each of its layers, at its positions

Which one a directory holds is read from its files: config.json's `class_path` (kind
"steering"), or the `method` of an intervention.json without config.json; each is compared as a
string with `STEERING_METHODS` and nothing is imported. The trained LightningModule itself (to
resume training, or to evaluate it as it trained) loads with
`lit_interventions.modules.steering_registry.load_steering_checkpoint`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lit_interventions.artifacts.hub import CONFIG, read_config
from lit_interventions.artifacts.intervention_files import CARD, read_card, read_tensors, weights_path
from lit_interventions.artifacts.loreft_artifact import check_card, layer_tensors, loreft_positions, split_tensors
from lit_interventions.core.edits import ApplyRequest, Edit, check_site, check_width, scaled
from lit_interventions.core.files import read_weights
from lit_interventions.core.lm import load_config
from lit_interventions.core.lora import lora_edits
from lit_interventions.core.positions import Positions
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.interventions.registry import method_spec

# {method: the class path of the module that trains it (the registered method)}: the steering
# artifacts whose weights load here
STEERING_METHODS = {name: method_spec(name).class_path for name in ("loreft", "lora")}


class LoRAAdapter:
    """A LoRA adapter: peft's state dict (`...<module>.lora_A.weight`, `lora_B.weight`) and the
    card's rank, alpha, targets and layers."""

    method = "lora"

    def __init__(self, tensors: dict[str, torch.Tensor], card: dict):
        rank, alpha = card.get("rank"), card.get("alpha")
        if type(rank) is not int or rank < 1:
            raise ValueError(f"a LoRA card's rank={rank!r} must be a positive integer")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"a LoRA card's alpha={alpha!r} must be a finite number")
        downs = sorted(k for k in tensors if k.endswith(".lora_A.weight"))
        if not downs or sorted(tensors) != sorted([*downs, *(k.replace("lora_A", "lora_B") for k in downs)]):
            raise ValueError(
                f"LoRA tensors are pairs of <module>.lora_A.weight and lora_B.weight; got {sorted(tensors)[:4]}"
            )
        for key in downs:
            down, up = tensors[key], tensors[key.replace("lora_A", "lora_B")]
            if down.ndim != 2 or up.ndim != 2 or down.shape[0] != rank or up.shape[1] != rank:
                raise ValueError(
                    f"LoRA tensor {key} has shape {tuple(down.shape)} and its lora_B {tuple(up.shape)}; rank {rank} "
                    "needs (rank, in) and (out, rank)"
                )
        self.tensors, self.card = tensors, card
        self.model, self.concept = card.get("model"), card.get("concept")

    @property
    def scaling(self) -> float:
        """The update's scale: α/r, or α/√r with `rslora`."""
        rank = self.card["rank"]
        return self.card["alpha"] / (math.sqrt(rank) if self.card.get("rslora") else rank)

    def export(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self.tensors, self.card

    def edits(self, config: dict, request: ApplyRequest, where: str = "the LoRA adapter") -> list[Edit]:
        """What `lit_interventions.apply` does with it: W₀x + `scaling`·B A x on each adapted module
        of the LM given (found by name), at every position unless the request names others."""
        return lora_edits(self.tensors, self.scaling, request, {**config, "model": self.model}, where)

    def peft_adapter(self) -> tuple:
        """(its peft LoraConfig, its state dict as peft saves it): `lit-interventions export --to peft`."""
        from peft import LoraConfig

        targets = self.card.get("target_modules")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"a LoRA card's target_modules={targets!r} must be a list of module names")
        config = LoraConfig(
            r=self.card["rank"],
            lora_alpha=self.card["alpha"],
            lora_dropout=self.card.get("dropout") or 0.0,
            use_rslora=bool(self.card.get("rslora")),
            target_modules=targets,
            layers_to_transform=self.card.get("layers"),
            fan_in_fan_out=_conv1d_targets(self.model, targets),
            bias="none",
        )
        return config, self.tensors


def _conv1d_targets(model: object, targets: list[str]) -> bool:
    """Whether the modules `targets` names in `model` are GPT-2's Conv1D (weights stored (in, out)),
    which peft's config records as `fan_in_fan_out`; the architecture is built on the meta device,
    without weights."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    if not isinstance(model, str) or not model:
        return False
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(load_config(model))
    return any(isinstance(m, Conv1D) for name, m in lm.named_modules() if name.rsplit(".", 1)[-1] in targets)


class LoReFTSteering:
    """LoReFT at one or several layers (`by_layer`: {layer: `LoReFTIntervention`}), at
    `positions` ("all", or the prompt's first and last tokens, "fN+lM")."""

    method = "loreft"

    def __init__(
        self, by_layer: dict[int, LoReFTIntervention], positions: Positions, model: str | None = None, card=None
    ):
        self.by_layer, self.positions, self.model = by_layer, positions, model
        self.card = (
            card if card is not None else {"model": model, "layers": list(by_layer), "positions": str(positions)}
        )

    def export(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(its tensors as saved, its card): R, W, b of a single layer at every position, else
        `layers.<L>.rotation`, ... (`loreft_artifact`)."""
        if len(self.by_layer) == 1 and self.positions.rule == "all" and "layers" not in self.card:
            return next(iter(self.by_layer.values())).export(), self.card
        return layer_tensors({layer: part.export() for layer, part in self.by_layer.items()}), self.card

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], card: dict) -> LoReFTSteering:
        """LoReFT as its card records it (`layer`, or `layers` + `positions`; `rank`), with R, W and b
        from `tensors`, each checked against the card (`loreft_artifact`)."""
        positions = loreft_positions(card.get("positions", "all"))
        if "layers" not in card:
            layer = card.get("layer")
            if type(layer) is not int:
                raise ValueError(f"a LoReFT card records layer or layers; got layer={layer!r}")
            if set(tensors) != {"rotation", "weight", "bias"}:
                raise ValueError(f"LoReFT tensors are rotation, weight and bias; got {sorted(tensors)}")
            return cls({layer: LoReFTIntervention.from_tensors(tensors)}, positions, card.get("model"), card)
        layers, rank = check_card(card)
        parts = split_tensors(tensors, layers, rank)
        by_layer = {layer: LoReFTIntervention.from_tensors(part) for layer, part in parts.items()}
        return cls(by_layer, positions, card.get("model"), card)

    def edits(self, config: dict, request: ApplyRequest, where: str = "the LoReFT module") -> list[Edit]:
        """What `lit_interventions.apply` does with it: Φ after each layer, at its positions unless
        the request names others, scaled by the request's factor: h + factor·(Φ(h) − h) (`scaled`;
        Φ itself at factor 1)."""
        positions = request.positions.resolved(str(self.positions))
        config = {**config, "model": self.model}
        edits = []
        for layer, intervention in self.by_layer.items():
            check_site(layer, "block_output", request.lm, config, where)
            check_width(intervention.hidden_size, request.lm, config, where)

            def fn(states, rows, inputs=None, intervention=intervention):
                return scaled(states, intervention(states, None), request.per_row(request.factor, rows))

            edits.append(Edit(fn, positions, layer))
        return edits

    def to_pyvene_layers(self) -> dict[int, dict]:
        """{layer: its intervention's `to_pyvene()`} (`lit-interventions export --to pyvene`): one
        pyvene LoreftIntervention per layer; the positions are pyvene's `unit_locations`."""
        return {layer: intervention.to_pyvene() for layer, intervention in self.by_layer.items()}


def steering_method(key: object, where: str | Path) -> str:
    """The steering method `key` names (a method of `STEERING_METHODS` or its class path),
    compared as a string; any other key is refused, unimported."""
    for method, path in STEERING_METHODS.items():
        if isinstance(key, str) and key in (method, path):
            return method
    raise ValueError(
        f"{where}: {key!r} is not a steering artifact this version loads ({', '.join(STEERING_METHODS)}), so "
        "nothing was imported; a module of your own loads with "
        "lit_interventions.modules.steering_registry.load_steering_checkpoint"
    )


def names_known_steering(directory: str | Path) -> bool:
    """Whether the steering artifact in `directory` names a method of `STEERING_METHODS` (its
    config.json's class path, or its intervention.json's method), which `load_steering` loads as
    weights; another (a steering module of the user's own) loads as its module
    (`modules.steering_registry.load_steering_checkpoint`)."""
    directory = Path(directory)
    if (directory / CONFIG).is_file():
        key = read_config(directory).get("class_path")
    else:
        key = read_card(directory / CARD).get("method") if (directory / CARD).is_file() else None
    return isinstance(key, str) and any(key in (method, path) for method, path in STEERING_METHODS.items())


def load_steering(directory: str | Path) -> LoRAAdapter | LoReFTSteering:
    """The steering artifact in `directory` (config.json of kind "steering", or an
    intervention.json without config.json), as the object `apply` and `export` use."""
    directory = Path(directory)
    config = read_config(directory) if (directory / CONFIG).is_file() else {}
    if "weights" in config and config.get("kind") == "steering":
        where = directory / CONFIG
        method = steering_method(config.get("class_path"), where)
        card, tensors = config, read_weights(weights_path(directory, config["weights"], where), where)
    elif (directory / CARD).is_file():
        card = read_card(directory / CARD)
        method = steering_method(card.get("method"), directory / CARD)
        tensors, card = read_tensors(directory)
    else:
        raise FileNotFoundError(f"{directory} holds neither a steering {CONFIG} nor {CARD}")
    return LoRAAdapter(tensors, card) if method == "lora" else LoReFTSteering.from_export(tensors, card)
