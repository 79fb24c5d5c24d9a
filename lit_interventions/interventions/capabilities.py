"""What an intervention can do beyond f* = forward(f(b), f(s)), as declared types.

Each capability is a small runtime-checkable Protocol: `isinstance(x, Annealed)` says whether x
offers it, and the modules and studies dispatch on these types.

- `Trained`: `trains` (True: its parameters are learned by gradient descent; `is_trained`).
- `Fitted`: `fit(states, labels)` in closed form on a site's states (closed-form directions,
  PCA/SAE featurizers); `DirectionEstimator` is the scikit-learn kind, whose `fit(X, y)` gives a
  direction and `to_intervention()` the interchange on it. `NeedsFit` says whether a fitted one
  has been fitted yet, `DevCandidates` that it offers several fits to choose from on dev data.
- `Annealed`: `anneal(step, total)`, a schedule set before each training step (DBM's temperature
  T); `Tempered`: a `temperature` to log.
- `Penalised`: `penalty()`, a term the objective adds, weighted (DBM: ‖σ(m/T)‖₁).
- `SourceFree`: `edits_base_alone` (True: f* = forward(f(b)), no source; steering, LoReFT,
  attacks).
- `Summarised`: `summary()`, one line on what a fit found.

`intervene` is the one call site of every intervention at a site, dispatched on `SourceFree` as
pyvene's `do_intervention` dispatches on its intervention types: f* = forward(f(b), **context)
for a source-free one, f* = forward(f(b), f(s), **context) for an interchange. `needs_source`
says, before any LM loads, whether a module must read f(s) for it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Trained(Protocol):
    """Says whether its parameters are learned by gradient descent."""

    trains: bool


@runtime_checkable
class Fitted(Protocol):
    """Fitted in closed form on a site's states (n, d) and one label per row."""

    def fit(self, states: Any, labels: Any) -> Any: ...


@runtime_checkable
class DirectionEstimator(Protocol):
    """A closed-form direction, scikit-learn style: `fit(X, y)` sets it, `to_intervention()` is the
    interchange on its span, f* = f(b) + (a·f(s) − a·f(b)) a (`directions.py`)."""

    def fit(self, X: Any, y: Any = None) -> Any: ...

    def to_intervention(self) -> torch.nn.Module: ...


@runtime_checkable
class NeedsFit(Protocol):
    """True until `fit` has run."""

    needs_fit: bool


@runtime_checkable
class DevCandidates(Protocol):
    """Several fits (one per setting) to score on dev data; `choose(scores)` keeps the best."""

    def dev_candidates(self) -> dict[str, torch.nn.Module]: ...

    def choose(self, scores: dict[str, dict]) -> None: ...


@runtime_checkable
class Annealed(Protocol):
    """A schedule set at training `step` of `total` (DBM: T from its start towards its end)."""

    def anneal(self, step: int, total: int) -> None: ...


@runtime_checkable
class Tempered(Protocol):
    """A temperature (DBM's T)."""

    temperature: torch.Tensor


@runtime_checkable
class Penalised(Protocol):
    """A loss term the objective adds with its weight (DBM: ‖σ(m/T)‖₁)."""

    def penalty(self) -> torch.Tensor: ...


@runtime_checkable
class SourceFree(Protocol):
    """Says whether it edits the base alone (no source state)."""

    edits_base_alone: bool


@runtime_checkable
class Summarised(Protocol):
    """One line on what a fit found."""

    def summary(self) -> str: ...


def is_trained(intervention: object) -> bool:
    """Whether `intervention` declares parameters learned by gradient descent (`trains` True)."""
    return isinstance(intervention, Trained) and bool(intervention.trains)


def is_source_free(intervention: object) -> bool:
    """Whether `intervention` declares that it edits the base alone."""
    return isinstance(intervention, SourceFree) and bool(intervention.edits_base_alone)


def needs_source(intervention: object) -> bool:
    """Whether f* reads the source state f(s): False for a source-free intervention (`SourceFree`),
    so a module that runs it reads no source forward."""
    return not is_source_free(intervention)


def intervene(intervention: Any, base: torch.Tensor, source: torch.Tensor | None = None, **context: Any):
    """f* at a site, the one call every module and study makes (pyvene's `do_intervention`):

        f* = intervention(f(b), **context)          source-free (`edits_base_alone`): no source given
        f* = intervention(f(b), f(s), **context)    an interchange: f(s) is required

    `context`: the per-batch keywords its forward takes (`concept_id`, `factor`; an attack's
    `probe`, `target` and `epsilon`). An interchange given no source is one ValueError naming it."""
    if is_source_free(intervention):
        return intervention(base, None, **context)
    if source is None:
        raise ValueError(
            f"{type(intervention).__name__} is an interchange intervention: f* = forward(f(b), f(s)) needs the "
            "source state, and none was read"
        )
    return intervention(base, source, **context)
