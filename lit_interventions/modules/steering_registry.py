"""Steering modules by name (LoReFT, LoRA, ...), and loading a trained one from what it saved.

SAELens' `register_sae_class` is the model: `register_steering_module(name, class_path)` adds a
class, a saved artifact records which one it is, and the loader takes the registered class that
record names. A class path read from a file is compared with the registered ones as a string and
never imported; only the registry's own paths are imported, when a module is rebuilt.

What records the class:

    saved as                                   the record                 matched against
    config.json of kind "steering" (LoRA;      its class_path             the registered class paths
      LoReFT at several layers or positions)
    config.json of another kind (LoReFT at     its method                 the registered names
      one layer, every position)
    intervention.json, without config.json     its method                 the registered names
    a Lightning .ckpt                          its "steering_module"      the registered names
    a .ckpt without that name                  its hyper_parameters       the one registered class
                                                                          whose __init__ takes them all

A directory's class rebuilds itself with `cls.from_export(tensors, card, lm)`; a `.ckpt` is read
with `torch.load(weights_only=True)` (tensors and plain data, nothing unpickled that runs code),
then `cls(**hyper_parameters)` and `load_state_dict`.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from lit_interventions.artifacts.card import LIBRARY
from lit_interventions.artifacts.checkpoint_io import read_checkpoint
from lit_interventions.artifacts.hub import CONFIG, read_config
from lit_interventions.artifacts.intervention_files import CARD, read_tensors, weights_path
from lit_interventions.core.files import read_weights
from lit_interventions.interventions.base import class_path, import_class, remote_code_trusted

CHECKPOINT_KEY = "steering_module"  # the registered name a Lightning checkpoint records
_REGISTRY: dict[str, str] = {}  # name -> class path


def register_steering_module(name: str, cls: str | type) -> None:
    """Register `name` (the class's `method`, which its saved cards record) for a steering module
    class or its class path. The class needs `from_export(tensors, card, lm)`. Refuses a name twice."""
    path = class_path(cls) if isinstance(cls, type) else cls
    if not isinstance(name, str) or not name:
        raise ValueError(f"steering module name={name!r} must be a non-empty string")
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"steering module {name!r}: class_path={path!r} must be 'package.module.Class'")
    if name in _REGISTRY:
        raise ValueError(f"steering module {name!r} is already registered (as {_REGISTRY[name]})")
    _REGISTRY[name] = path


def registered_steering_modules() -> dict[str, str]:
    """{name: class path} of the registered steering modules, in registration order."""
    return dict(_REGISTRY)


def steering_module_class(key: object, where: str | Path) -> type:
    """The registered class `key` names (a registered name or class path, compared as a string);
    `where` is the file that recorded it, for the message. Any other key is refused, unimported,
    unless inside `trusting_remote_code()` (`steer --trust_remote_code`), where a class path is
    imported as it is."""
    for name, path in _REGISTRY.items():
        if isinstance(key, str) and key in (name, path):
            return _with_from_export(import_class(path), name)
    if remote_code_trusted() and isinstance(key, str) and "." in key:
        return _with_from_export(import_class(key), key)
    known = ", ".join(f"{name} ({path})" for name, path in _REGISTRY.items())
    raise ValueError(
        f"{where}: {key!r} is not a registered steering module, so nothing was imported; registered: {known}; "
        "register yours (register_steering_module) or pass --trust_remote_code if you trust where it came from"
    )


def _with_from_export(cls: type, name: str) -> type:
    if not callable(getattr(cls, "from_export", None)):
        raise ValueError(f"steering module {name!r}: {class_path(cls)} has no from_export(tensors, card, lm)")
    return cls


def load_steering_checkpoint(path: str | Path, lm: str | None = None):
    """A trained steering module (LoReFT, LoRA, ...) from its exported directory (config.json, or
    intervention.json + intervention.safetensors) or a Lightning `.ckpt`; `lm` overrides the
    model it records. The class is the registered one its files name (see the module doc)."""
    path = Path(path)
    if path.suffix == ".ckpt":
        return _from_lightning_checkpoint(path, lm)
    config = read_config(path) if (path / CONFIG).is_file() else {}
    if config.get("library_name") == LIBRARY and "weights" in config:
        where = path / CONFIG
        cls = steering_module_class(
            config.get("class_path") if config.get("kind") == "steering" else config.get("method"), where
        )
        weights = weights_path(path, config["weights"], where)
        tensors, card = read_weights(weights, where), config
    elif (path / CARD).is_file():  # a directory without config.json, or with one that is not ours
        tensors, card = read_tensors(path)
        cls = steering_module_class(card.get("method"), path / CARD)
    else:
        raise FileNotFoundError(f"{path} is neither a .ckpt file nor a directory holding {CONFIG} or {CARD}")
    return cls.from_export(tensors, card, lm)


def _from_lightning_checkpoint(path: Path, lm: str | None):
    checkpoint = read_checkpoint(path)  # weights_only: one ValueError naming a damaged or crafted file
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(hparams, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path} is not a Lightning checkpoint of a steering module (no hyper_parameters, state_dict)")
    cls = steering_module_class(checkpoint.get(CHECKPOINT_KEY) or _name_taking(hparams, path), path)
    if unknown := sorted(set(hparams) - _init_parameters(cls)):
        raise ValueError(f"{path}: hyper-parameters {unknown} are not arguments of {class_path(cls)}")
    module = cls(**{**hparams, **({"lm": lm} if lm else {})})
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    return module


def _init_parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def _name_taking(hparams: dict, path: Path) -> str:
    """The one registered name whose class's __init__ takes every hyper-parameter in `hparams`
    (a checkpoint that records no name)."""
    names = [name for name in _REGISTRY if set(hparams) <= _init_parameters(steering_module_class(name, path))]
    if len(names) != 1:
        raise ValueError(
            f"{path} records no {CHECKPOINT_KEY!r} and its hyper-parameters {sorted(hparams)} fit "
            f"{names or 'none'} of the registered steering modules {sorted(_REGISTRY)}"
        )
    return names[0]


register_steering_module("loreft", "lit_interventions.modules.steering_loreft.LoReFTModule")
register_steering_module("lora", "lit_interventions.modules.steering_baselines.LoRAModule")
