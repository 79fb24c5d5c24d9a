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
``intervention.json`` card holding ``class_path`` and ``config``.

A class path read from a file is data: `loadable_class` resolves it through the table of
registered classes (`register_intervention`; the project's own classes register themselves where
they are defined) and refuses any other before importing it, unless the caller trusts the file
(`trust_remote_code=True`, as transformers names it). No Lightning here.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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
from lit_interventions.core.edits import ApplyRequest, Edit, intervention_edits

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
    def from_pretrained(
        cls, directory_or_hub_id: str | Path, *, trust_remote_code: bool = False, **download: Any
    ) -> Intervention:
        """The intervention saved in a local directory or a hub repository (`snapshot_download`;
        `download`: revision, token, cache_dir, local_files_only). Refuses one of another class,
        and an unregistered class path unless `trust_remote_code` (`load_pretrained`)."""
        directory = local_directory(directory_or_hub_id, **download)
        intervention = load_pretrained(directory, trust_remote_code=trust_remote_code)
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

    def edits(self, config: dict, request: ApplyRequest, where: str = "the intervention") -> list[Edit]:
        """What applying it to an LM does (`lit_interventions.apply`): itself at the site its
        config.json records, at the request's positions (`intervention_edits`)."""
        return intervention_edits(self, config, request, where)

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


# --- the classes a file may name ------------------------------------------------------------------------------

OWN_PACKAGE = "lit_interventions."
_REGISTERED: dict[str, type] = {}
_TRUST_REMOTE_CODE: ContextVar[bool] = ContextVar("trust_remote_code", default=False)


def register_intervention(cls: type | None = None, *, aliases: tuple[str, ...] = ()):
    """Let saved artifacts name `cls` (an intervention, or a part one is built from, such as a
    featurizer) by its class path, and by any of `aliases`. Use as `register_intervention(MyClass)`
    or as a class decorator. Returns the class."""

    def register(klass: type) -> type:
        if not isinstance(klass, type):
            raise ValueError(f"register_intervention takes a class; got {klass!r}")
        for path in (class_path(klass), *aliases):
            known = _REGISTERED.get(path)
            if known is not None and known is not klass:
                raise ValueError(f"class_path {path!r} is already registered for {known!r}")
            _REGISTERED[path] = klass
        return klass

    return register if cls is None else register(cls)


def registered_interventions() -> list[str]:
    """The class paths saved artifacts may name without `trust_remote_code`."""
    return sorted(_REGISTERED)


@contextmanager
def trusting_remote_code(trust: bool = True) -> Iterator[None]:
    """Inside the block, `loadable_class` imports class paths outside the registry (the nested
    parts of a composed intervention included) when `trust` is True."""
    token = _TRUST_REMOTE_CODE.set(bool(trust))
    try:
        yield
    finally:
        _TRUST_REMOTE_CODE.reset(token)


def remote_code_trusted() -> bool:
    """Whether this block runs inside `trusting_remote_code()` (unregistered class paths load)."""
    return _TRUST_REMOTE_CODE.get()


def loadable_class(path: object, where: str | Path) -> type:
    """The class a saved artifact names at `where` (a file, for the message). A registered class
    path gives its class. The project's own modules may be imported to register their classes;
    any other class path is refused before anything is imported, unless inside
    `trusting_remote_code()`."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: class_path={path!r} must be a dotted class path string")
    if path not in _REGISTERED and path.startswith(OWN_PACKAGE):
        try:  # the project's own code: importing it registers its classes
            importlib.import_module(path.rpartition(".")[0])
        except (ImportError, ValueError):
            pass
    if path in _REGISTERED:
        return _REGISTERED[path]
    if _TRUST_REMOTE_CODE.get():
        return import_class(path)
    raise ValueError(
        f"{where}: class_path {path!r} is not a registered class, so it was not imported; if it is "
        "yours, call lit_interventions.register_intervention(YourClass) before loading, or pass "
        "trust_remote_code=True if you trust where this artifact came from"
    )


def weights_path(directory: Path, name: object, where: str | Path) -> Path:
    """The weights file `name` (from a saved config) inside `directory`: a plain file name only,
    never a path that leaves the artifact's directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or ":" in name:
        raise ValueError(f"{where}: weights={name!r} must be a file name inside {directory} (no path separators)")
    return directory / name


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


def _rebuild(cls_path: object, tensors: dict[str, torch.Tensor], config: object, where: Path, trust: bool):
    """`cls.from_tensors(tensors, **config)` for the class `cls_path` names (see `loadable_class`)."""
    with trusting_remote_code(trust):
        cls = loadable_class(cls_path, where)
        if not callable(getattr(cls, "from_tensors", None)):
            raise ValueError(f"{where}: class_path={cls_path!r} is not an intervention class (no from_tensors)")
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config={config!r} must be a JSON object")
        return cls.from_tensors(tensors, **config)


def load_intervention(directory: str | Path, *, trust_remote_code: bool = False) -> tuple[InterventionProtocol, dict]:
    """(the rebuilt intervention, its card) from what `save_intervention` wrote. The card's class
    path is resolved by `loadable_class`."""
    where = Path(directory) / CARD
    card = _read_card(where)
    if "class_path" not in card:
        raise ValueError(f"{where} has no class_path (an older export?); read it with read_tensors")
    loadable_class_or_trusted(card["class_path"], where, trust_remote_code)  # refused before the weights are read
    tensors, card = read_tensors(directory)
    return _rebuild(card["class_path"], tensors, card.get("config", {}), where, trust_remote_code), card


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


def load_pretrained(directory: str | Path, *, trust_remote_code: bool = False) -> InterventionProtocol:
    """The intervention `save_pretrained` (config.json) or `save_intervention` (intervention.json,
    older directories) wrote to the local `directory`. Its class path (and those of its nested
    parts) must be registered (`register_intervention`) unless `trust_remote_code`; a refusal
    happens before any weights are read."""

    directory = Path(directory)
    config = read_config(directory) if (directory / CONFIG).is_file() else {}
    if "class_path" not in config:  # an older directory (intervention.json only), or config.json not ours
        if not (directory / CARD).is_file():
            raise FileNotFoundError(f"{directory} holds neither a lit-interventions config.json nor {CARD}")
        return load_intervention(directory, trust_remote_code=trust_remote_code)[0]
    where = directory / CONFIG
    loadable_class_or_trusted(config["class_path"], where, trust_remote_code)
    tensors = read_weights(weights_path(directory, config.get("weights", WEIGHTS), where), where)
    return _rebuild(config["class_path"], tensors, config.get("config", {}), where, trust_remote_code)


def read_weights(weights: Path, named_in: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `weights` (that the config `named_in` names); one clear
    error naming the file when it is missing, unreadable (truncated, empty, another kind of file:
    a pickle is never unpickled) or holds non-finite values."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except FileNotFoundError:
        named = f" ({named_in} names it as the weights)" if named_in is not None else ""
        raise FileNotFoundError(f"{weights}: no such file{named}") from None
    except Exception as err:  # truncated, empty, not safetensors
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ValueError(
            f"{weights} is unreadable ({type(err).__name__}{': ' + detail if detail else ''}); "
            "restore the file or save it again"
        ) from None
    check_finite(tensors, weights, "load")
    return tensors


def loadable_class_or_trusted(path: object, where: Path, trust: bool) -> type:
    """`loadable_class(path, where)`, importing an unregistered class path only when `trust`."""
    with trusting_remote_code(trust):
        return loadable_class(path, where)


def _read_card(where: Path) -> dict:
    """The JSON card at `where` (intervention.json)."""
    try:
        card = json.loads(where.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file (is {where.parent} an intervention's directory?)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{where} is unreadable ({type(err).__name__}); re-export it or restore the file") from None
    if not isinstance(card, dict):
        raise ValueError(f"{where} is not a JSON object")
    return card
