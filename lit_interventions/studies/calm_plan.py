"""The CALM study's settings (`CalmArgs`, what `lit-interventions calm` parses and `run_calm`
takes) and its plan: the settings checked and the work drawn up before the LM's weights are read:
the attacks, the placement, the properties and tasks, the site, the saved probes to reuse, each
property's kept classes, the entity splits and the prompt templates."""

from __future__ import annotations

from dataclasses import dataclass

from lit_interventions.core.lm import DEFAULT_LM, check_device, hidden_size, load_config
from lit_interventions.core.sharding import LoadOptions
from lit_interventions.core.sites import site_layer
from lit_interventions.datamodules.ravel import RavelData, load_ravel
from lit_interventions.interventions.attacks import (
    attack_spec,
    build_attack,
    check_pgd,
    registered_attacks,
    with_defaults,
)
from lit_interventions.interventions.registry import MethodSpec
from lit_interventions.modules.probe import KINDS
from lit_interventions.studies.calm_data import (
    SPLITS,
    _check_names,
    choose_templates,
    property_classes,
    split_entities,
)
from lit_interventions.studies.calm_probes import check_saved_classes, load_saved_probes

METHODS = ("fgsm", "pgd")  # the attacks of a run that names none
RANDOM = "random"  # the control: ±ε per coordinate, same size as the attacks (always run, last)


@dataclass
class CalmArgs:
    """The CALM study's settings (`run_calm`, `lit-interventions calm`).

    Args:
        lm: the frozen LM (an embedded name, .gguf, local directory or hub id).
        dtype: the frozen LM's dtype (float32, bfloat16, float16).
        device: where the LM runs (with device_map: where the inputs and probes go).
        ravel_dir: the published RAVEL files (null: our built-in data).
        entity_type: the RAVEL entity type (city).
        properties: the attributes Z to probe and intervene on (default: all of the type).
        tasks: the attributes whose prompts form the tasks (default: every property).
        layer: residual stream after this block (default: the middle layer); site: entity's last token.
        max_classes: each property keeps its most frequent values among train entities.
        entities: at most this many entities per split, {"train": .., "val": .., "test": ..}.
        templates_per_property: prompt templates per attribute (probes read all of them; a task's
            examples use its own); templates longer than max_tokens (with the entity) are dropped.
        max_tokens: the longest prompt kept, in tokens.
        probe: the probe g_Z: "mlp" (2 hidden layers, ReLU, dropout 0.1) or "linear".
        probe_hidden: the MLP's hidden width (default: the LM's hidden size).
        probe_epochs: training epochs; the best validation epoch is kept.
        probe_lr: the probes' Adam learning rate.
        probe_batch_size: the probes' training batch size.
        probes: a directory of probes saved by an earlier run (PROPERTY.ckpt) to reuse; each must
            have been trained at this site of this model.
        methods: the attacks (default: fgsm, pgd), each a registered short name (fgsm, pgd) or
            {name, class_path, init_args} of a class with delta(probe, h, target, epsilon); the
            random ±ε control always runs besides.
        epsilon: the L∞ radius, > 0.
        epsilon_relative: multiply epsilon by the site's coordinate scale (the median
            per-coordinate std of the train states); false = absolute, as in the paper.
        alpha: PGD's step (null: ε/10): the default of every attack that takes `alpha` and whose
            init_args leave it unset.
        steps: PGD's T (40), a default as alpha is.
        k_max: competence averages top-k overlap over k = 1..k_max, ranked within the task's
            answer vocabulary (k stops at its size if that is smaller).
        batch_size: test prompts per forward.
        seed: the entity splits, templates, targets z′, probe training and the random control.
        out: the output directory.
        device_map: a frozen LM larger than one device (`lit_interventions.core.sharding`), e.g. "auto".
        quantization: the frozen LM in 8 or 4 bits ("8bit", "4bit").
    """

    lm: str = DEFAULT_LM
    dtype: str = "float32"
    device: str = "cpu"
    ravel_dir: str | None = None
    entity_type: str = "city"
    properties: list[str] | None = None
    tasks: list[str] | None = None
    layer: int | None = None
    max_classes: int = 6
    entities: dict[str, int] | None = None
    templates_per_property: int = 3
    max_tokens: int = 96
    probe: str = "mlp"
    probe_hidden: int | None = None
    probe_epochs: int = 32
    probe_lr: float = 1e-3
    probe_batch_size: int = 64
    probes: str | None = None
    methods: list[str | dict] | None = None
    epsilon: float = 0.1
    epsilon_relative: bool = False
    alpha: float | None = None
    steps: int = 40
    k_max: int = 10
    batch_size: int = 16
    seed: int = 0
    out: str = "runs/calm"
    device_map: str | int | dict | None = None
    quantization: str | None = None


@dataclass
class CalmPlan:
    """The checked work of a CALM run: attacks, placement, data, site and probes to reuse."""

    methods: list[MethodSpec]  # the attacks, then the random control, with the run's defaults filled in
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
    epsilon, k_max = args.epsilon, args.k_max
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be > 0 (the L∞ radius of the interventions)")
    if args.probe not in KINDS:
        raise ValueError(f"probe={args.probe!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r} must be an int >= 1")
    if args.max_classes < 2:
        raise ValueError(f"max_classes={args.max_classes!r} must be >= 2")
    check_pgd(args.alpha, args.steps)
    methods = choose_attacks(args.methods, {"alpha": args.alpha, "steps": args.steps, "seed": args.seed})
    check_device(args.device)
    placement = LoadOptions(args.device_map, args.quantization)
    sizes = {"train": 200, "val": 50, "test": 50} | dict(args.entities or {})
    if set(sizes) != set(SPLITS) or any(not isinstance(n, int) or n < 1 for n in sizes.values()):
        raise ValueError(f"entities={args.entities!r}: give positive ints for {', '.join(SPLITS)}")
    return methods, placement, sizes


def choose_attacks(methods: list[str | dict] | None, defaults: dict) -> list[MethodSpec]:
    """The attacks `methods` names (None: `METHODS`), then the random control, each with `defaults`
    filled in (`with_defaults`) and built once, so that a bad entry fails before any work."""
    items = list(METHODS) if methods is None else [methods] if isinstance(methods, (str, dict)) else list(methods)
    if not items:
        raise ValueError(
            f"methods=[] names no attack; give registered names ({', '.join(registered_attacks())}) "
            "or {name, class_path, init_args}"
        )
    specs = [attack_spec(m) for m in items]
    names = [spec.name for spec in specs]
    if RANDOM in names:
        raise ValueError(f"methods {names}: {RANDOM!r} is the control, which always runs; give the attacks only")
    if len(set(names)) != len(names):
        raise ValueError(f"methods {names} name a method twice: give each name once")
    specs = [with_defaults(spec, defaults) for spec in [*specs, attack_spec(RANDOM)]]
    for spec in specs:
        build_attack(spec)
    return specs


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
