"""The one table of method names, for every study (SAELens' `register_sae_class` is the model).

A method spec is a `class_path` and its `init_args`, as a YAML gives an intervention, plus the
options of the loop that trains it (learning rate, warmup, objective), used only by a trained
one. The registry maps unique short names to specs; it holds strings only, and a spec's class is
imported when it is built (`import_class`), whether it came from the registry or from a user's
config. Each name means one class in every study; what a study does with it follows from the
capabilities of what its spec builds (`kind`: fitted in closed form, trained, or fixed) and from
the study's data:

    das, vanilla, dbm                         interventions (CausalGym; RAVEL with its configs)
    probe, diffmean, lda, pca, kmeans,        direction estimators: one direction per CausalGym
      random, lat                               site, one-vs-rest on RAVEL, one per AxBench concept
    mdas, mdbm, full_swap, pca_features, sae  RAVEL
    reft_r1, ssv                              AxBench's trained concept dictionaries
    reps                                      AxBench RePS: the ssv rows, the preference objective
    fgsm, pgd, random_sign                    CALM's attacks and its random control
    loreft, lora                              steering modules (`load_steering_checkpoint`)

A study's method list takes a registered name or `{name: NAME, model: <train.py's model
section>}` (`method_entry`). `register_intervention` (interventions/base.py) is the separate
allow-list of the classes a saved artifact may name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_interventions.interventions.base import import_class
from lit_interventions.interventions.capabilities import Fitted, is_trained

FITTED, TRAINED, FIXED = "fitted", "trained", "fixed"  # what `kind` says of a built method
INTERCHANGE_MODULE = "lit_interventions.modules.interchange.InterchangeModule"
_DAS = "lit_interventions.interventions.rotation.RotatedSpaceIntervention"


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
    def from_model(cls, name: str, model: dict) -> MethodSpec:
        """The spec of `{name, model}`: `model` is what train.py's `model:` section holds,
        {class_path, init_args}. A module that takes an `intervention` (InterchangeModule) gives
        its intervention ({class_path, init_args}; none: DAS of its `k`), `lr`, `warmup_ratio` and
        `objective`; its site and LM (lm, layer, region, dtype, ...) are the study's to set. Any
        other class is the method itself (a direction estimator, an attack): {class_path, init_args}."""
        if not isinstance(model, dict) or "class_path" not in model or set(model) - {"class_path", "init_args"}:
            got = sorted(model) if isinstance(model, dict) else repr(model)
            raise ValueError(
                f"method {name!r}: model is {{class_path, init_args}} (train.py's model section); got {got}"
            )
        init_args = model.get("init_args") or {}
        if not isinstance(init_args, dict):
            raise ValueError(f"method {name!r}: model.init_args={init_args!r} must be a mapping")
        if "intervention" not in class_parameters(model["class_path"], name):
            return cls(name, model["class_path"], dict(init_args))
        intervention = init_args.get("intervention") or {"class_path": _DAS, "init_args": {"k": init_args.get("k", 1)}}
        if not isinstance(intervention, dict) or "class_path" not in intervention:
            raise ValueError(
                f"method {name!r}: model.init_args.intervention={intervention!r} must be {{class_path, init_args}}"
            )
        options = {k: init_args[k] for k in ("lr", "warmup_ratio", "objective") if init_args.get(k) is not None}
        return cls(name, intervention["class_path"], dict(intervention.get("init_args") or {}), **options)

    def model(self, module: str = INTERCHANGE_MODULE) -> dict:
        """train.py's `model:` section that trains or fits this method at one site: `module`
        (InterchangeModule) with the method as its intervention and its loop's options."""
        init_args = {
            "intervention": {"class_path": self.class_path, "init_args": dict(self.init_args)},
            "lr": self.lr,
            "warmup_ratio": self.warmup_ratio,
        }
        if self.objective is not None:
            init_args["objective"] = self.objective
        return {"class_path": module, "init_args": init_args}

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


def method_entry(entry: str | dict | MethodSpec) -> MethodSpec:
    """The spec of one entry of a study's method list: a registered name, or `{name: NAME,
    model: <train.py's model section>}` (`MethodSpec.from_model`); a spec is returned as it is."""
    if isinstance(entry, MethodSpec):
        return entry
    if isinstance(entry, str):
        return method_spec(entry)
    if not isinstance(entry, dict) or set(entry) != {"name", "model"} or not isinstance(entry["name"], str):
        got = sorted(entry) if isinstance(entry, dict) else repr(entry)
        raise ValueError(
            f"a method is a registered name ({', '.join(_REGISTRY)}) or {{name: NAME, model: {{class_path, "
            f"init_args}}}} (train.py's model section); got {got}"
        )
    return MethodSpec.from_model(entry["name"], entry["model"])


def check_site_method(spec: MethodSpec, study: str) -> None:
    """Refuse, before any work, a method that `study` (a sweep) cannot run at a site: it runs an
    intervention (an `nn.Module` whose forward takes the base and the source, and no context of
    another study, e.g. an attack's probe) and a direction estimator (`fit(X, y)`). A
    LightningModule, an AxBench concept method or a CALM attack is one ValueError naming it."""
    cls = import_class(spec.class_path)
    what = f"method {spec.name!r} ({spec.class_path})"
    takes = "interventions (forward(base, source)) and direction estimators (fit(X, y))"
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        if callable(getattr(cls, "training_step", None)):
            raise ValueError(f"{what} is a LightningModule of its own; the {study} takes {takes}")
        context = [
            p.name
            for p in inspect.signature(cls.forward).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
        ]
        if context:
            raise ValueError(
                f"{what} needs {', '.join(context)} at each call, which the {study} does not give; it takes {takes}"
            )
        return
    if not callable(getattr(cls, "fit", None)):
        raise ValueError(f"{what} is neither an intervention nor a direction estimator; the {study} takes {takes}")


def class_parameters(path: str, name: str) -> set[str]:
    """The parameter names of the class at `path` (imported: the user's own config names it); a
    path that is not a class is one ValueError naming the method `name`."""
    cls = import_class(path)
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError) as error:
        raise ValueError(f"method {name!r}: class_path={path!r} is not a class: {error}") from error


def method_spec(name: str) -> MethodSpec:
    """The registered spec of `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"Unknown method {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def registered_methods() -> list[str]:
    """The registered names, in registration order."""
    return list(_REGISTRY)


_DIRECTIONS = "lit_interventions.interventions.directions"
register_method("das", _DAS, {"k": 1})
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
# steering modules: LightningModules that train on steering data and rebuild with from_export
register_method("loreft", "lit_interventions.modules.steering_loreft.LoReFTModule")
register_method("lora", "lit_interventions.modules.steering_baselines.LoRAModule")

# CALM: the attacks against a probe and the random ±ε control (interventions/attacks.py)
_ATTACKS = "lit_interventions.interventions.attacks"
register_method("fgsm", f"{_ATTACKS}.FGSM")
register_method("pgd", f"{_ATTACKS}.PGD")
register_method("random_sign", f"{_ATTACKS}.RandomSign")

# AxBench: the trained concept dictionaries (SteeringModule; its own lr, AxBench's 1e-2 with no
# warmup). AxBench's closed forms are the direction estimators above, fitted once per concept.
_ADDITIVE = "lit_interventions.interventions.additive"
register_method("reft_r1", f"{_ADDITIVE}.ReFTR1Dictionary", lr=0.01, warmup_ratio=0.0)
register_method("ssv", f"{_ADDITIVE}.SSVDictionary", lr=0.01, warmup_ratio=0.0)

# RAVEL: the settings of configs/ravel/<name>.yaml (Huang et al. 2024, §4), objective L_Cause (+ L_Iso)
_CAUSE_ISO = "lit_interventions.objectives.CauseIsoLoss"
_MASK = "lit_interventions.interventions.mask.SigmoidMaskIntervention"
_FEATURES = "lit_interventions.interventions.fitted.FeatureInterchangeFit"
register_method(  # L_Cause + mean over the other attributes of L_Iso, k = 64, lr 1e-2
    "mdas", _DAS, {"k": 64}, lr=0.01, objective={"class_path": _CAUSE_ISO, "init_args": {"multitask": True}}
)
register_method(  # the multi-task loss with λ = 0, T annealed 1e-2 -> 1e-7, lr 1e-2
    "mdbm",
    _MASK,
    {"temperature": 0.01, "temperature_end": 1e-7},
    lr=0.01,
    objective={"class_path": _CAUSE_ISO, "init_args": {"multitask": True, "sparsity": 0.0}},
)
register_method(  # f* = f(s), the whole vector
    "full_swap",
    "lit_interventions.interventions.featurizers.FullVectorSwap",
    objective={"class_path": _CAUSE_ISO, "init_args": {"multitask": False}},
)
register_method(  # standardised PCA, components of an L1 SVM, C by dev Disentangle (RAVEL App. B.1)
    "pca_features",
    _FEATURES,
    {"featurizer": "pca", "max_features": None, "select_by": "disentangle", "C": None, "standardize": True},
    objective={"class_path": _CAUSE_ISO, "init_args": {"multitask": False}},
)
register_method(  # a trained SAE's L1-selected latents, f* = dec(z_mix); sae: the sae.safetensors to set
    "sae",
    _FEATURES,
    {"featurizer": "sae", "sae": None, "max_features": None, "reconstruction_error": "drop"},
    objective={"class_path": _CAUSE_ISO, "init_args": {"multitask": False}},
)

# AxBench RePS (Wu et al. 2025, arXiv 2505.20809): a free-norm rank-1 vector per concept (the SSV
# dictionary's rows) trained by the preference objective of SteeringModule, AxBench's
# scaled_simpo with the orig_add and orig_sub pairs (modules/steering_objective.py); lr and epochs
# in configs/reps.yaml.
register_method(
    "reps",
    f"{_ADDITIVE}.SSVDictionary",
    {"init": 0.01},
    lr=0.04,
    warmup_ratio=0.0,
    objective={"class_path": "lit_interventions.modules.steering_objective.PreferenceObjective", "init_args": {}},
)
