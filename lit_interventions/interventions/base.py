"""The one protocol every intervention implements, and saving / loading through it.

An intervention is a torch module with

- ``forward(base, source=None, *, <context>) -> Tensor``: the new hidden state f*, shaped like
  ``base``, (batch, d) or (batch, seq, d). Interchange interventions (DAS, DBM, featurizers, swaps)
  need ``source``; additive ones (steering, LoReFT, attacks) refuse it. Per-batch context is
  keyword-only and drawn from one small vocabulary: ``concept_id`` ((batch,) dictionary rows),
  ``factor`` (steering strength α, a number or (batch,)) and ``target`` ((batch,) attack classes).
- ``trains: bool``: whether its parameters are learned by gradient descent.
- optional capabilities, declared as types in `capabilities` (fitted in closed form, annealed,
  penalised, source-free).
- ``export() -> dict[str, Tensor]`` (the tensors that define it) and ``config() -> dict`` (its
  JSON-able settings), so that ``type(x).from_tensors(x.export(), **x.config())`` equals ``x``.

`save_intervention` / `load_intervention` write and read ``intervention.safetensors`` plus an
``intervention.json`` card holding ``class_path`` and ``config``: no table of known classes.
No Lightning here.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lit_interventions.artifacts.hub import (
    CONFIG,
    class_path,
    intervention_config,
    local_directory,
    push_to_hub,
    read_config,
    write_hub_files,
)
from lit_interventions.core.files import check_finite, write_atomically

WEIGHTS, CARD = "intervention.safetensors", "intervention.json"


@runtime_checkable
class InterventionProtocol(Protocol):
    """f* = forward(f(b), f(s)); see the module docstring."""

    trains: bool

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None, **context: Any) -> torch.Tensor: ...

    def export(self) -> dict[str, torch.Tensor]: ...

    def config(self) -> dict: ...

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], **config: Any) -> InterventionProtocol: ...


class Intervention(nn.Module):
    """Defaults for the protocol: not trained, an interchange (it reads a source), no tensors, no
    settings. `frozen_class` is the class whose `from_tensors` rebuilds `export()` as the fixed
    intervention it acts as once trained (None: its own class; DAS: `FixedSubspaceIntervention`)."""

    trains: bool = False
    edits_base_alone: bool = False
    frozen_class: type | None = None

    def export(self) -> dict[str, torch.Tensor]:
        return {}

    def config(self) -> dict:
        return {}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], **config: Any) -> Intervention:
        if tensors:
            raise NotImplementedError(f"{cls.__name__} does not rebuild from tensors {sorted(tensors)}")
        return cls(**config)

    # the Hugging Face layout: config.json + README.md card beside the tensors (lit_interventions.artifacts.hub)

    def save_pretrained(self, directory: str | Path, card: dict | None = None) -> Path:
        """Write this intervention as a hub model repository directory (module `save_pretrained`);
        `card`: model, layer, region/component, data, metrics, command, ... Returns the directory."""
        return save_pretrained(directory, self, card)

    @classmethod
    def from_pretrained(cls, directory_or_hub_id: str | Path, **download: Any) -> Intervention:
        """The intervention saved in a local directory or a hub repository (`snapshot_download`;
        `download`: revision, token, cache_dir, local_files_only). Refuses one of another class."""
        intervention = load_pretrained(local_directory(directory_or_hub_id, **download))
        if not isinstance(intervention, cls):
            raise TypeError(
                f"{directory_or_hub_id} holds a {class_path(intervention)}, not a {class_path(cls)}; "
                "load it with lit_interventions.from_pretrained"
            )
        return intervention

    def push_to_hub(self, repo_id: str, card: dict | None = None, **kwargs: Any):
        """save_pretrained to a temporary directory, then upload it to `repo_id`
        (`lit_interventions.artifacts.hub.push_to_hub`; kwargs: private, token, commit_message, revision, create_pr)."""
        with tempfile.TemporaryDirectory(prefix="lit-interventions-push-") as tmp:
            save_pretrained(tmp, self, card)
            return push_to_hub(tmp, repo_id, **kwargs)

    def _require_source(self, source: torch.Tensor | None) -> torch.Tensor:
        if source is None:
            raise ValueError(f"{type(self).__name__} is an interchange intervention: source is required, got None")
        return source

    def _refuse_source(self, source: torch.Tensor | None) -> None:
        if source is not None:
            raise ValueError(f"{type(self).__name__} edits base alone: source must be None, got a tensor")


def import_class(path: str) -> type:
    """The class at ``package.module.Class`` (the inverse of `class_path`)."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"class_path={path!r} must be a dotted import path such as 'package.module.Class'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"class_path={path!r} cannot be imported: {error}") from error


def write_tensors(directory: str | Path, tensors: dict[str, torch.Tensor], card: dict) -> Path:
    """`intervention.safetensors` (float32, CPU) plus `intervention.json`, each written atomically.
    Refuses non-finite tensors. Returns the safetensors path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / WEIGHTS
    tensors = {k: v.detach().cpu().contiguous().float() for k, v in tensors.items()}
    check_finite(tensors, weights, "write")
    text = json.dumps(card, indent=2) + "\n"  # fails before anything is written if not JSON-able
    write_atomically(weights, lambda tmp: save_file(tensors, tmp))
    write_atomically(directory / CARD, text)
    return weights


def read_tensors(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the card `write_tensors` wrote; refuses non-finite tensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    fix = "re-export it (fit again) or restore the file"
    try:
        tensors = load_file(directory / WEIGHTS)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{directory / WEIGHTS}: no such file (is {directory} an intervention's directory?)"
        ) from None
    except Exception as err:  # truncated, empty, not safetensors: SafetensorError and others
        raise ValueError(
            f"{directory / WEIGHTS} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); {fix}"
        ) from None
    check_finite(tensors, directory / WEIGHTS, "load")
    try:
        card = json.loads((directory / CARD).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{directory / CARD} is unreadable ({type(err).__name__}); {fix}") from None
    return tensors, card


def save_intervention(directory: str | Path, intervention: InterventionProtocol, card: dict) -> Path:
    """Write `intervention.export()` and the card, with `class_path` and `config` added."""
    card = {**card, "class_path": class_path(intervention), "config": intervention.config()}
    return write_tensors(directory, intervention.export(), card)


def load_intervention(directory: str | Path) -> tuple[InterventionProtocol, dict]:
    """(the rebuilt intervention, its card) from what `save_intervention` wrote."""
    tensors, card = read_tensors(directory)
    if "class_path" not in card:
        raise ValueError(f"{Path(directory) / CARD} has no class_path (an older export?); read it with read_tensors")
    cls = import_class(card["class_path"])
    if not (isinstance(cls, type) and callable(getattr(cls, "from_tensors", None))):
        raise ValueError(
            f"{Path(directory) / CARD}: class_path={card['class_path']!r} is not an intervention class "
            "(no from_tensors)"
        )
    return cls.from_tensors(tensors, **card.get("config", {})), card


# --- the Hugging Face layout (config.json + README.md card; see lit_interventions.artifacts.hub) ---------------


def save_pretrained(directory: str | Path, intervention: InterventionProtocol, card: dict | None = None) -> Path:
    """`directory` as a hub model repository: `intervention.safetensors`, `config.json` (class path,
    config, and the card's model, layer/site, data, metrics, command) and a `README.md` model card.
    Returns the directory."""
    directory = Path(directory)
    tensors = {k: v.detach().cpu().contiguous().float() for k, v in intervention.export().items()}
    check_finite(tensors, directory / WEIGHTS, "write")
    config = intervention_config(intervention, card or {})
    json.dumps(config)  # not JSON-able: fails before anything is written
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / WEIGHTS, lambda tmp: save_file(tensors, tmp))
    write_hub_files(directory, config)
    return directory


def load_pretrained(directory: str | Path) -> InterventionProtocol:
    """The intervention `save_pretrained` (config.json) or `save_intervention` (intervention.json,
    older directories) wrote to the local `directory`."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_config(directory) if (directory / CONFIG).is_file() else {}
    if "class_path" not in config:  # an older directory (intervention.json only), or config.json not ours
        if not (directory / CARD).is_file():
            raise FileNotFoundError(f"{directory} holds neither a lit-interventions config.json nor {CARD}")
        return load_intervention(directory)[0]
    weights = directory / config.get("weights", WEIGHTS)
    tensors = load_file(weights)
    check_finite(tensors, weights, "load")
    cls = import_class(config["class_path"])
    if not (isinstance(cls, type) and callable(getattr(cls, "from_tensors", None))):
        raise ValueError(
            f"{directory / CONFIG}: class_path={config['class_path']!r} is not an intervention class (no from_tensors)"
        )
    return cls.from_tensors(tensors, **config.get("config", {}))
