"""Short names for AxBench's concept methods (`reft_r1`, `ssv`, `diffmean`, `pca`, `lat`, `probe`)
and building a method from a name, a {class_path, init_args} config or an instance.

`register_concept_method` adds a name; a class_path is imported from the user's own config (as
LightningCLI does), never from a dictionary card: a card names its method and latent only.
"""

from __future__ import annotations

from typing import Any

from lit_interventions.interventions.base import class_path, import_class
from lit_interventions.interventions.capabilities import Fitted, is_trained
from lit_interventions.interventions.concept_methods import ConceptMethod

_REGISTRY: dict[str, str] = {}  # short name -> class path


def register_concept_method(name: str, path: str) -> None:
    """Register the short name `name` for the concept method class at `path`. Refuses a name twice."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"concept method name={name!r} must be a non-empty string without '/'")
    if name in _REGISTRY:
        raise ValueError(f"concept method {name!r} is already registered (as {_REGISTRY[name]})")
    _REGISTRY[name] = path


def registered_concept_methods() -> list[str]:
    """The registered short names, in registration order."""
    return list(_REGISTRY)


def _built(path: str, init_args: dict) -> ConceptMethod:
    if not isinstance(init_args, dict):
        raise ValueError(f"method {path!r}: init_args={init_args!r} must be a mapping")
    cls = import_class(path)
    if not (isinstance(cls, type) and issubclass(cls, ConceptMethod)):
        raise ValueError(
            f"method class_path={path!r} is not a concept method (a subclass of {class_path(ConceptMethod)})"
        )
    try:
        return cls(**init_args)
    except TypeError as err:
        raise ValueError(f"method {path!r}: bad init_args {sorted(init_args)}: {err}") from err


def concept_method(method: str | dict | ConceptMethod, **init_args: Any) -> ConceptMethod:
    """The concept method `method` names: a registered short name (built with `init_args`), a
    {class_path, init_args} config, or an instance (returned as it is). It must be trained
    (`trains`) or fitted in closed form (`fit`)."""
    if isinstance(method, str):
        if method not in _REGISTRY:
            raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(_REGISTRY)}")
        built = _built(_REGISTRY[method], init_args)
    elif init_args:
        raise ValueError(f"init_args {sorted(init_args)} go with a short method name, not with {method!r}")
    elif isinstance(method, dict):
        if "class_path" not in method or set(method) - {"class_path", "init_args"}:
            raise ValueError(f"a method config is {{class_path, init_args}}; got keys {sorted(method)}")
        built = _built(method["class_path"], method.get("init_args") or {})
    elif isinstance(method, ConceptMethod):
        built = method
    else:
        raise ValueError(
            f"method={method!r} must be a short name ({', '.join(_REGISTRY)}), a {{class_path, init_args}} "
            "config or a ConceptMethod"
        )
    if not (is_trained(built) or isinstance(built, Fitted)):
        raise ValueError(f"{built!r} is neither trained (trains = True) nor fitted in closed form (fit)")
    return built


def method_config(method: ConceptMethod) -> dict:
    """{class_path, init_args} of a built method: the config that builds it again."""
    return {"class_path": class_path(method), "init_args": method.config()}


def closed_form_methods() -> list[str]:
    """The registered short names of the closed-form methods."""
    return [name for name in _REGISTRY if not is_trained(concept_method(name))]


for _name, _cls in [
    ("reft_r1", "ReFTR1Method"),
    ("ssv", "SSVMethod"),
    ("diffmean", "DiffMeanMethod"),
    ("pca", "PCAMethod"),
    ("lat", "LATMethod"),
    ("probe", "ProbeMethod"),
]:
    register_concept_method(_name, f"lit_interventions.interventions.concept_methods.{_cls}")
