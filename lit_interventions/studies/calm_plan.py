"""The CALM study's plan: `run_calm`'s arguments checked and its work drawn up before the LM's
weights are read: the attacks, the placement, the properties and tasks, the site, the saved
probes to reuse, each property's kept classes, the entity splits and the prompt templates."""

from __future__ import annotations

from dataclasses import dataclass

from lit_interventions.core.lm import check_device, hidden_size, load_config
from lit_interventions.core.sharding import LoadOptions
from lit_interventions.core.sites import site_layer
from lit_interventions.datamodules.ravel import RavelData, load_ravel
from lit_interventions.interventions.attacks import ATTACKS
from lit_interventions.modules.probe import KINDS
from lit_interventions.studies.calm_data import (
    SPLITS,
    _check_names,
    choose_templates,
    property_classes,
    split_entities,
)
from lit_interventions.studies.calm_probes import check_saved_classes, load_saved_probes


@dataclass
class CalmArgs:
    """`run_calm`'s arguments as given (its docstring says what each one is; its signature holds
    the defaults)."""

    lm: str
    dtype: str
    device: str
    ravel_dir: str | None
    entity_type: str
    properties: list[str] | None
    tasks: list[str] | None
    layer: int | None
    max_classes: int
    entities: dict[str, int] | None
    templates_per_property: int
    max_tokens: int
    probe: str
    probe_hidden: int | None
    probe_epochs: int
    probe_lr: float
    probe_batch_size: int
    probes: str | None
    methods: list[str] | None
    epsilon: float
    epsilon_relative: bool
    alpha: float | None
    steps: int
    k_max: int
    batch_size: int
    seed: int
    out: str
    device_map: str | int | dict | None
    quantization: str | None


@dataclass
class CalmPlan:
    """The checked work of a CALM run: attacks, placement, data, site and probes to reuse."""

    methods: list[str]  # the attacks (the random control runs besides)
    placement: LoadOptions
    data: RavelData
    properties: list[str]
    tasks: list[str]
    layer: int
    d: int  # the LM's hidden size
    loaded: dict  # property -> a saved probe to reuse
    classes: dict[str, list[str]]  # property -> its kept values
    split_of: dict[str, list[str]]  # split -> its entities
    templates: dict[str, list[str]]  # property -> its prompt templates


def _check_settings(args: CalmArgs) -> tuple[list[str], LoadOptions, dict[str, int]]:
    """(attacks, placement, entities per split), once the settings that need no file are checked."""
    methods = _check_names(args.methods, list(ATTACKS), "methods") if args.methods is not None else list(ATTACKS)
    epsilon, alpha, steps, k_max = args.epsilon, args.alpha, args.steps, args.k_max
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be > 0 (the L∞ radius of the interventions)")
    if args.probe not in KINDS:
        raise ValueError(f"probe={args.probe!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r} must be an int >= 1")
    if args.max_classes < 2:
        raise ValueError(f"max_classes={args.max_classes!r} must be >= 2")
    if alpha is not None and not alpha > 0:
        raise ValueError(f"alpha={alpha!r} must be > 0 (the PGD step), or null for ε/10")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    check_device(args.device)
    placement = LoadOptions(args.device_map, args.quantization)
    sizes = {"train": 200, "val": 50, "test": 50} | dict(args.entities or {})
    if set(sizes) != set(SPLITS) or any(not isinstance(n, int) or n < 1 for n in sizes.values()):
        raise ValueError(f"entities={args.entities!r}: give positive ints for {', '.join(SPLITS)}")
    return methods, placement, sizes


def plan_calm(args: CalmArgs) -> CalmPlan:
    """Check everything before the LM's weights are read (only its config is), and draw up the run."""
    methods, placement, sizes = _check_settings(args)
    data = load_ravel(args.ravel_dir, args.entity_type)
    properties = _check_names(args.properties, data.attributes, f"properties of entity type {args.entity_type!r}:")
    tasks = _check_names(args.tasks, properties, "tasks (must be among the properties)")
    config = load_config(args.lm)
    layer = site_layer(config, args.layer)
    d = hidden_size(config)
    loaded = load_saved_probes(args.probes, properties, (args.lm, layer, d))
    classes = property_classes(data, properties, args.max_classes)
    check_saved_classes(loaded, classes)
    split_of = split_entities(data, properties, sizes, args.seed)
    templates = choose_templates(data, properties, args.templates_per_property, args.seed)
    return CalmPlan(methods, placement, data, properties, tasks, layer, d, loaded, classes, split_of, templates)
