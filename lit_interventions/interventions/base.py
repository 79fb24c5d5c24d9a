"""The one protocol every intervention implements, and the table of classes a saved file may name.

An intervention is a torch module with

- ``forward(base, source=None, *, <context>) -> Tensor``: the new hidden state f*, shaped like
  ``base``, (batch, d) or (batch, seq, d). Interchange interventions (DAS, DBM, featurizers, swaps)
  need ``source``; additive ones (steering, LoReFT, attacks) refuse it. Per-batch context is
  keyword-only and drawn from one small vocabulary: ``concept_id`` ((batch,) dictionary rows),
  ``factor`` (steering strength α, a number or (batch,)), and an attack's ``probe`` (the probe
  g_Z it attacks), ``target`` ((batch,) the classes z′ it aims at) and ``epsilon`` (the L∞ radius).
- ``trains: bool``: whether its parameters are learned by gradient descent.
- optional capabilities, declared as types in `capabilities` (fitted in closed form, annealed,
  penalised, source-free).
- ``export() -> dict[str, Tensor]`` (the tensors that define it) and ``config() -> dict`` (its
  JSON-able settings), so that ``type(x).from_tensors(x.export(), **x.config())`` equals ``x``.

Saving and loading through the protocol is `lit_interventions.artifacts.intervention_files`.

A class path read from a file is data: `loadable_class` resolves it through the table of
registered classes (`register_intervention`; the project's own classes register themselves where
they are defined) and refuses any other before importing it, unless the caller trusts the file
(`trust_remote_code=True`, as transformers names it). No Lightning here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lit_interventions.core.edits import ApplyRequest, Edit, intervention_edits


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


def class_path(obj_or_cls) -> str:
    """The import path of a class (or of an object's class): ``package.module.Class``."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


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
