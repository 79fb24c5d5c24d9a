"""Short method names and the specs they stand for (SAELens' `register_sae_class` is the model).

A method spec is a `class_path` and its `init_args`, as a YAML gives an intervention, plus the
options of the loop that trains it (learning rate, warmup, objective), used only by a trained
one. The registry maps short names (`das`, `probe`, `dbm`, ...) to specs; it holds strings only,
and a spec's class is imported when it is built (`import_class`), whether it came from the
registry or from a user's config. How a study runs a method follows from the capabilities of
what its spec builds (`kind`): fitted in closed form, trained, or fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from lit_interventions.interventions.base import import_class
from lit_interventions.interventions.capabilities import Fitted, is_trained

FITTED, TRAINED, FIXED = "fitted", "trained", "fixed"  # what `kind` says of a built method


@dataclass(frozen=True)
class MethodSpec:
    """A method: `name` (the results' `method` column), `class_path` and `init_args` of what it
    builds, and for a trained one its loop's `lr`, `warmup_ratio` and `objective` ({class_path,
    init_args} of an `Objective`, built by `lit_interventions.objectives.build_objective`; None:
    CausalGym's −log p*(y_s), `CounterfactualLoss`)."""

    name: str
    class_path: str
    init_args: dict = field(default_factory=dict)
    lr: float = 5e-3
    warmup_ratio: float = 0.1
    objective: dict | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"method name={self.name!r} must be a non-empty string without '/'")
        if not isinstance(self.class_path, str) or "." not in self.class_path:
            raise ValueError(f"method {self.name!r}: class_path={self.class_path!r} must be 'package.module.Class'")
        if not isinstance(self.init_args, dict):
            raise ValueError(f"method {self.name!r}: init_args={self.init_args!r} must be a mapping")

    @classmethod
    def from_config(cls, config: dict) -> MethodSpec:
        """The spec a config gives: {name, class_path, init_args, [lr, warmup_ratio, objective]}."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(allowed))
        if unknown or "name" not in config or "class_path" not in config:
            raise ValueError(
                f"a method config needs name and class_path and may have {', '.join(allowed[2:])}; got {sorted(config)}"
            )
        return cls(**{**config, "init_args": dict(config.get("init_args") or {})})

    def build(self, hidden_size: int, seed: int = 0) -> Any:
        """A fresh instance: an `nn.Module` class as cls(hidden_size, **init_args); any other (a
        scikit-learn style estimator) as cls(**init_args), with `random_state=seed` where it has
        that parameter and `init_args` leave it unset."""
        cls = import_class(self.class_path)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls(hidden_size, **self.init_args)
        built = cls(**self.init_args)
        params = built.get_params() if callable(getattr(built, "get_params", None)) else {}
        if "random_state" in params and "random_state" not in self.init_args:
            built.set_params(random_state=seed)
        return built

    def loop_options(self) -> tuple:
        """What a training loop's result depends on besides its sites and data."""
        return (self.class_path, sorted(self.init_args.items()), self.lr, self.warmup_ratio, self.objective)


def kind(method: Any) -> str:
    """How a study runs a built method: FITTED (closed form: `Fitted`, fitted on a site's states
    and labels), TRAINED (`trains` True: learned by gradient descent) or FIXED (an intervention
    used as it is)."""
    if isinstance(method, Fitted):
        return FITTED
    if is_trained(method):
        return TRAINED
    if isinstance(method, nn.Module):
        return FIXED
    raise ValueError(
        f"{type(method).__name__} is neither fitted in closed form (fit), trained (trains) nor an intervention"
    )


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(name: str, class_path: str, init_args: dict | None = None, **options: Any) -> MethodSpec:
    """Register `name` for a spec (`options`: lr, warmup_ratio, objective). Refuses a name twice."""
    if name in _REGISTRY:
        raise ValueError(f"method {name!r} is already registered (as {_REGISTRY[name].class_path})")
    _REGISTRY[name] = spec = MethodSpec(name, class_path, dict(init_args or {}), **options)
    return spec


def method_spec(name: str) -> MethodSpec:
    """The registered spec of `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"Unknown method {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def registered_methods() -> list[str]:
    """The registered names, in registration order."""
    return list(_REGISTRY)


_DIRECTIONS = "lit_interventions.interventions.directions"
register_method("das", "lit_interventions.interventions.rotation.RotatedSpaceIntervention", {"k": 1})
for _name, _cls in [
    ("probe", "ProbeDirection"),
    ("diffmean", "DiffMeanDirection"),
    ("lda", "LDADirection"),
    ("pca", "PCADirection"),
    ("kmeans", "KMeansDirection"),
    ("random", "RandomDirection"),
    ("lat", "LATDirection"),
]:
    register_method(_name, f"{_DIRECTIONS}.{_cls}")
register_method("vanilla", "lit_interventions.interventions.rotation.FullSubspaceSwap")
register_method(  # as configs/dbm.yaml: T annealed 1e-2 -> 1e-7, λ = 1e-3, lr 1e-2
    "dbm",
    "lit_interventions.interventions.mask.SigmoidMaskIntervention",
    {"temperature": 0.01, "temperature_end": 1e-7},
    lr=0.01,
    objective={"class_path": "lit_interventions.objectives.CounterfactualLoss", "init_args": {"sparsity": 0.001}},
)
