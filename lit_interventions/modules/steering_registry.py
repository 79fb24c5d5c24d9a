"""Loading a trained steering module (LoReFT, LoRA, ...) from what it saved.

The steering modules are the registered methods (`interventions.registry.register_method`, the one
table of method names; SAELens' `register_sae_class` is the model) whose class has
`from_export(tensors, card, lm)`: `loreft` and `lora`, and a user's own once registered. A saved
artifact records which one it is, and the loader takes the registered class that record names. A
class path read from a file is compared with the registered ones as a string and never
imported; only the registry's own paths are imported, when a module is rebuilt.

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
from lit_interventions.interventions.registry import method_spec, registered_methods

CHECKPOINT_KEY = "steering_module"  # the registered name a Lightning checkpoint records


def registered_steering_modules() -> dict[str, str]:
    """{name: class path} of the steering modules among the registered methods (`register_method`;
    a class with `from_export(tensors, card, lm)`), in registration order."""
    found = {}
    for name in registered_methods():
        path = method_spec(name).class_path
        try:
            cls = import_class(path)
        except ValueError:  # a user's registration whose class does not import: not a steering module here
            continue
        if callable(getattr(cls, "from_export", None)):
            found[name] = path
    return found


def steering_module_class(key: object, where: str | Path) -> type:
    """The registered steering module `key` names (a registered name or class path, compared as
    a string); `where` is the file that recorded it, for the message. Any other key is refused,
    unimported, unless inside `trusting_remote_code()` (`steer --trust_remote_code`), where a
    class path is imported as it is."""
    registered = registered_steering_modules()
    for name, path in registered.items():
        if isinstance(key, str) and key in (name, path):
            return import_class(path)
    if remote_code_trusted() and isinstance(key, str) and "." in key:
        return _with_from_export(import_class(key), key)
    known = ", ".join(f"{name} ({path})" for name, path in registered.items())
    raise ValueError(
        f"{where}: {key!r} is not a registered steering module, so nothing was imported; registered: {known}; "
        "register yours (register_method(name, class_path)) or pass --trust_remote_code if you trust where it came from"
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
    registered = registered_steering_modules()
    names = [name for name, cls in registered.items() if set(hparams) <= _init_parameters(import_class(cls))]
    if len(names) != 1:
        raise ValueError(
            f"{path} records no {CHECKPOINT_KEY!r} and its hyper-parameters {sorted(hparams)} fit "
            f"{names or 'none'} of the registered steering modules {sorted(registered)}"
        )
    return names[0]
