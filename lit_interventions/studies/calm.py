"""The CALM study on RAVEL: probes, gradient-based interventions and competence (Davies et al.).

    lit-interventions calm --config configs/calm_ravel.yaml [--layer 6] [--out DIR]

Experimental model (CALM §5.2, App. C.2, adapted to RAVEL):
- properties Z: RAVEL attributes of one entity type (city: Country, Continent, Language), each
  restricted to its `max_classes` most frequent values among the train entities: a probe trains
  and is scored on the entities with a kept value, and attacks aim at a kept value z′ ≠ z;
- tasks T: a prompt that queries one attribute A, so A is the causal property and the others are
  environmental (one competence score per task);
- site: the residual stream after block `layer` at the last token of the entity.

Steps:
1. read the states at the site once (the LM is frozen) for train / val / test entities in the
   prompts of every property;
2. train a probe g_Z per property on train entities, keep its best val epoch, score it on test;
3. per task, per test example and per property Z: attack g_Z toward another kept value z′ (PGD,
   FGSM, or any source-free intervention whose forward takes the attack's context,
   forward(h, probe=g_Z, target=z′, epsilon=ε) -> h′, named in `methods` by {name, model})
   and, as the control (`random_sign`), add a random ±ε perturbation; write h′ = h + δ back into
   the forward;
4. score competence (top-k overlap with the causal graph's prediction, k = 1..k_max, ranked
   within the task's answer vocabulary: the first tokens of the queried attribute's values, as
   the paper ranks within the task's answer vocabulary, App. B.2), the
   targeted probe's success and accuracy after the attack, and the collateral damage (accuracy
   of the other properties' probes after it).

Writes DIR/results.csv (one row per task × method × property), DIR/summary.csv (one row per
task × method) and DIR/summary.json (both, plus probes, ε and the config); probes in DIR/probes/.

The file reads in that order: settings and plan (every check before the LM's weights are read),
data, probes, run, report, then `run_calm` and `main`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import yaml

from lit_interventions.callbacks.progress import LoopProgress
from lit_interventions.cli.studies import run_cli
from lit_interventions.core.blocks import site_layer
from lit_interventions.core.files import write_atomically
from lit_interventions.core.forward import logits_at, read_layers
from lit_interventions.core.lm import DEFAULT_LM, check_device, hidden_size, load_config, load_lm, load_tokenizer
from lit_interventions.core.progress import Progress, current, line_seconds
from lit_interventions.core.sharding import LoadOptions, is_dispatched
from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.core.tokens import pad_batch, token_covering
from lit_interventions.datamodules.ravel_answers import _first_token
from lit_interventions.datamodules.ravel_files import RavelData, load_ravel, value_separator
from lit_interventions.interventions.attacks import check_pgd, epsilon_scale
from lit_interventions.interventions.base import import_class
from lit_interventions.interventions.capabilities import intervene, is_source_free
from lit_interventions.interventions.registry import FIXED, MethodSpec, class_parameters, kind, method_entry
from lit_interventions.metrics.competence import Competence, competence_scores
from lit_interventions.modules.probe import KINDS, ProbeModule, load_probe, train_probe

# --- settings and plan: every check before the LM's weights are read ------------------------------
SPLITS = ("train", "val", "test")
POSITION = "entity_last"  # the site's position: the entity's last token


METHODS = ("fgsm", "pgd")  # the attacks of a run that names none
RANDOM = "random_sign"  # the control: ±ε per coordinate, same size as the attacks (always run, last)


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
        methods: the attacks (default: fgsm, pgd), each a registered name (fgsm, pgd) or
            {name: NAME, model: {class_path, init_args}} of a source-free intervention whose
            forward(h, probe=g_Z, target=z′, epsilon=ε) returns h′; the random ±ε control
            (random_sign) always runs besides, last.
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
    """The attacks `methods` names (None: `METHODS`), each a registered name or {name, model}
    (`registry.method_entry`), then the random control, each with `defaults` filled in
    (`with_defaults`) and built once, so that a bad entry fails before any work."""
    items = list(METHODS) if methods is None else [methods] if isinstance(methods, (str, dict)) else list(methods)
    if not items:
        raise ValueError(
            f"methods=[] names no attack; give registered names ({', '.join(METHODS)}) or "
            "{name: NAME, model: {class_path, init_args}}"
        )
    specs = [method_entry(_new_form(m)) for m in items]
    names = [spec.name for spec in specs]
    if RANDOM in names:
        raise ValueError(f"methods {names}: {RANDOM!r} is the control, which always runs; give the attacks only")
    if len(set(names)) != len(names):
        raise ValueError(f"methods {names} name a method twice: give each name once")
    specs = [with_defaults(spec, defaults) for spec in [*specs, method_entry(RANDOM)]]
    for spec in specs:
        build_attack(spec)
    return specs


def _new_form(entry):
    """`entry`, refused in the form {name, class_path, init_args} with the form it is written in."""
    if isinstance(entry, dict) and "class_path" in entry:
        model = {k: entry[k] for k in ("class_path", "init_args") if k in entry}
        written = {"name": entry.get("name"), "model": model}
        flow = yaml.safe_dump(written, default_flow_style=True, sort_keys=False, width=math.inf).strip()
        raise ValueError(f"method {entry.get('name')!r}: {{name, class_path, init_args}} is written {flow}")
    return entry


def with_defaults(spec: MethodSpec, defaults: dict) -> MethodSpec:
    """`spec` with each of `defaults` added to its init_args where its class takes a parameter of
    that name and init_args leave it unset (the run's `alpha`, `steps` and `seed`)."""
    accepted = class_parameters(spec.class_path, spec.name)
    filled = {k: v for k, v in defaults.items() if k in accepted and k not in spec.init_args}
    return replace(spec, init_args={**filled, **spec.init_args})


def build_attack(spec: MethodSpec):
    """A fresh instance of `spec`'s class, cls(**init_args), checked to be a fixed source-free
    intervention (`kind` FIXED, `edits_base_alone`): what CALM calls with the attack's context."""
    try:
        built = import_class(spec.class_path)(**spec.init_args)
    except TypeError as error:
        raise ValueError(f"method {spec.name!r}: {spec.class_path}(**{spec.init_args}) failed: {error}") from error
    if not (isinstance(built, torch.nn.Module) and kind(built) == FIXED and is_source_free(built)):
        hint = f" (CALM's random control is {RANDOM!r}, which always runs)" if spec.name == "random" else ""
        raise ValueError(
            f"method {spec.name!r}: {spec.class_path} is not an attack{hint}: CALM runs a fixed source-free "
            "intervention (edits_base_alone) whose forward(h, probe=, target=, epsilon=) returns h′"
        )
    return built


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


# --- data: the prompts, splits, classes, answer vocabulary and the states at the site -------------
@dataclass
class Prompt:
    """One tokenised prompt: an entity in a template of a queried attribute."""

    entity: str
    attribute: str  # the attribute the template queries
    template: str
    ids: list[int]
    site: int  # the entity's last token
    last: int  # the prediction position


def _check_names(names: list[str] | None, valid: list[str], what: str) -> list[str]:
    """The names (default: every valid one), all of them among `valid` and at least one."""
    names = list(valid) if names is None else list(names)
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"{what} {unknown or names} not in the data; available: {', '.join(valid)}")
    return names


def property_classes(data: RavelData, properties: list[str], max_classes: int) -> dict[str, list[str]]:
    """Each property's `max_classes` most frequent values among train entities (ties: by name)."""
    classes = {}
    for prop in properties:
        counts = Counter(v for e, v in data.values(prop).items() if data.entity_split.get(e) == "train")
        kept = [v for v, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:max_classes]]
        if len(kept) < 2:
            raise ValueError(f"property {prop!r} has {len(kept)} value(s) among train entities; a probe needs >= 2")
        classes[prop] = kept
    return classes


def split_entities(data: RavelData, properties: list[str], sizes: dict[str, int], seed: int) -> dict[str, list[str]]:
    """Entities per split that have a value of every property, at most sizes[split] of each (seeded)."""
    rng = random.Random(seed)
    kept = {s: [] for s in SPLITS}
    for entity, attrs in sorted(data.entities.items()):
        split = data.entity_split.get(entity)
        if split in kept and all(attrs.get(p) for p in properties):
            kept[split].append(entity)
    for split in SPLITS:
        rng.shuffle(kept[split])
        kept[split] = sorted(kept[split][: sizes[split]])
        if not kept[split]:
            raise ValueError(f"no {split} entity has a value of every property {properties}")
    return kept


def choose_templates(data: RavelData, properties: list[str], per_property: int, seed: int) -> dict[str, list[str]]:
    """At most `per_property` prompt templates of each property, sampled (seeded) and sorted."""
    rng = random.Random(seed)
    chosen = {}
    for prop in properties:
        templates = sorted(data.prompts.get(prop, []))
        if not templates:
            raise ValueError(f"property {prop!r} has no prompt templates")
        chosen[prop] = sorted(rng.sample(templates, min(per_property, len(templates))))
    return chosen


def tokenize_prompt(tokenizer, template: str, entity: str, attribute: str) -> Prompt:
    """The prompt with BOS, the entity's last token (offsets) and the last position."""
    prefix = bos_prefix(tokenizer)
    text = prefix + template.replace("%s", entity)
    enc = tokenizer(text, return_offsets_mapping=True)
    site = token_covering(enc["offset_mapping"], len(prefix) + template.index("%s") + len(entity) - 1, text)
    return Prompt(entity, attribute, template, enc["input_ids"], site, len(enc["input_ids"]) - 1)


def tokenize_splits(
    tokenizer, split_of: dict[str, list[str]], properties: list[str], templates: dict[str, list[str]], max_tokens: int
) -> dict[str, list[Prompt]]:
    """Every split's prompts: each entity in each template of each property, those longer than
    `max_tokens` dropped; a split left without one is an error."""
    prompts: dict[str, list[Prompt]] = {}
    for split in SPLITS:
        prompts[split] = [
            p
            for entity in split_of[split]
            for attr in properties
            for t in templates[attr]
            if len((p := tokenize_prompt(tokenizer, t, entity, attr)).ids) <= max_tokens
        ]
        if not prompts[split]:
            raise ValueError(f"every {split} prompt is longer than max_tokens={max_tokens}")
    return prompts


def _pad(prompts: list[Prompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids right-padded with `pad_id`, and their attention mask: (batch, seq) each."""
    ids, mask, _ = pad_batch([p.ids for p in prompts], pad_id)
    return ids, mask


def _batches(items: list, size: int):
    """Consecutive slices of `items`, `size` long (the last one shorter)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def read_states(model, layer: int, prompts: list[Prompt], pad_id: int, batch_size: int, device) -> list[torch.Tensor]:
    """The residual stream at `layer` of each prompt, unpadded, [(seq, d)] on the CPU; each batch
    counted in the study's progress (`core.progress.current`)."""
    out = []
    for batch in _batches(prompts, batch_size):
        ids, mask = _pad(batch, pad_id)
        states = read_layers(model, [layer], ids.to(device), mask.to(device))[layer].float().cpu()
        out.extend(states[i, : len(p.ids)] for i, p in enumerate(batch))
        current().update()
    return out


def site_states(
    model, layer: int, prompts: dict[str, list[Prompt]], pad_id: int, batch_size: int, device
) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Each split's states at `layer` ([(seq, d)] per prompt, `read_states`) and their rows at the
    site, stacked: ({split: states}, {split: (n, d)})."""
    states = {s: read_states(model, layer, prompts[s], pad_id, batch_size, device) for s in SPLITS}
    site = {s: torch.stack([st[p.site] for st, p in zip(states[s], prompts[s])]) for s in SPLITS}  # (n, d)
    return states, site


def _labels(data: RavelData, prompts: list[Prompt], prop: str, classes: list[str]) -> torch.Tensor:
    """Class id of each prompt's entity for `prop`, −1 where its value is not a kept class, (n,)."""
    values = [data.entities[p.entity][prop] for p in prompts]
    return torch.tensor([classes.index(v) if v in classes else -1 for v in values])


def _other_class(label: int, n_classes: int, rng: random.Random) -> int:
    """A target value z′ ≠ z, uniformly among the other kept values."""
    return rng.choice([c for c in range(n_classes) if c != label])


def answer_vocabulary(tokenizer, data: RavelData, task: str, templates: list[str]) -> torch.Tensor:
    """The task's answer vocabulary (CALM App. B.2: predictions are ranked within it): the first
    token of every value of the queried attribute in the data, as it follows each of the task's
    templates (with the space `value_separator` puts before it), sorted token ids."""
    seps = {value_separator(t) for t in templates}
    ids = {_first_token(tokenizer, sep + value) for value in set(data.values(task).values()) for sep in seps}
    return torch.tensor(sorted(ids), dtype=torch.long)


def _first_tokens(tokenizer, value: str) -> set[int]:
    """The first token of the value, with and without a leading space (either counts as the answer)."""
    return {ids[0] for ids in (tokenizer(w, add_special_tokens=False).input_ids for w in (value, " " + value)) if ids}


# --- probes: g_Z per property, saved or trained ---------------------------------------------------
def load_saved_probes(probes: str | None, properties: list[str], where: tuple) -> dict:
    """{property: probe} from a directory of probes saved by an earlier run (PROPERTY.ckpt), each
    checked to have been trained at this site `where` = (lm, layer, hidden size); {} without one."""
    lm, layer, d = where
    loaded = {}
    if probes is not None:
        for prop in properties:
            path = Path(probes) / f"{prop}.ckpt"
            if not path.is_file():
                raise ValueError(f"no probe for property {prop!r} at {path}")
            loaded[prop] = load_probe(path)
            loaded[prop].check_site(lm, layer, d, POSITION)
    return loaded


def check_saved_classes(loaded: dict, classes: dict[str, list[str]]) -> None:
    """Each saved probe must have the classes this run keeps for its property."""
    for prop, g in loaded.items():
        if g.classes != classes[prop]:
            raise ValueError(f"the saved probe of {prop!r} has classes {g.classes}; this run keeps {classes[prop]}")


def fit_probes(data, prompts, site, classes, loaded, where, args: dict, seed: int, save_dir: Path):
    """A probe per property (trained on train entities with a kept value, best val epoch kept, or
    `loaded`), and its accuracy per split: ({property: probe}, {property: info}). Each probe
    trained is counted in the study's progress (`core.progress.current`), its batches a stage."""
    lm, layer, d = where
    probes, info = {}, {}
    torch.manual_seed(seed)  # the first probe's initial weights (each later one follows train_probe's seeding)
    for prop in classes:
        labels = {s: _labels(data, prompts[s], prop, classes[prop]) for s in SPLITS}
        known = {s: labels[s] >= 0 for s in SPLITS}  # entities whose value is a kept class
        if prop in loaded:
            probes[prop] = loaded[prop]
        else:
            module = ProbeModule(
                classes[prop],
                lm,
                layer,
                d,
                POSITION,
                kind=args["kind"],
                hidden=args["hidden"],
                lr=args["lr"],
                property_name=prop,
            )
            train = (site["train"][known["train"]], labels["train"][known["train"]])
            val = (site["val"][known["val"]], labels["val"][known["val"]])
            current().note(prop)
            probes[prop] = train_probe(
                module,
                train,
                val,
                args["epochs"],
                args["batch_size"],
                seed,
                save_to=save_dir / f"{prop}.ckpt",
                callbacks=[LoopProgress(validation=False)],  # its batches in the study's progress
            )
            current().update()
        with torch.no_grad():
            accs = {f"{s}_acc": _accuracy(probes[prop].predict(site[s]), labels[s]) for s in SPLITS}
        test_known = labels["test"][known["test"]].tolist()
        majority = max(Counter(test_known).values()) / len(test_known) if test_known else math.nan
        info[prop] = {
            "classes": classes[prop],
            **accs,
            "test_majority": majority,
            **{f"n_{s}": int(known[s].sum()) for s in SPLITS},
        }
    return probes, info


def _accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy over the examples with a kept class (label >= 0)."""
    known = labels >= 0
    return (predicted[known] == labels[known]).float().mean().item() if known.any() else math.nan


# --- run: every task's test prompts under every method --------------------------------------------
@dataclass
class SiteInputs:
    """The frozen LM, every split's prompts and the states it computes at the site (read once),
    and ε in absolute units."""

    tokenizer: object
    model: torch.nn.Module
    prompts: dict[str, list[Prompt]]
    states: dict[str, list[torch.Tensor]]  # split -> the residual stream of each prompt, (seq, d)
    site: dict[str, torch.Tensor]  # split -> its rows at the site, (n, d)
    scale: float  # the site's coordinate scale (`epsilon_scale` of the train states)
    eps: float  # the L∞ radius in absolute units


@dataclass
class _Run:
    """What the interventions of every task share: the plan, the inputs, the probes, the draws of
    z′ (`rng`) and the methods built for this run (the random control's signs are its own draws)."""

    args: CalmArgs
    plan: CalmPlan
    inputs: SiteInputs
    probes: dict  # property -> g_Z
    rng: random.Random
    attacks: dict[str, torch.nn.Module]  # name -> the attack, the random control last

    @property
    def names(self) -> list[str]:
        """The methods: the attacks, then the random control."""
        return list(self.attacks)


def read_inputs(args: CalmArgs, plan: CalmPlan) -> SiteInputs:
    """Tokenise every split's prompts, load the LM (onto `device` unless it is dispatched), read
    the states at the site once, and ε = epsilon × the site's scale if relative, else epsilon."""
    tokenizer = load_tokenizer(args.lm)
    prompts = tokenize_splits(tokenizer, plan.split_of, plan.properties, plan.templates, args.max_tokens)
    model = load_lm(args.lm, args.dtype, plan.placement.device_map, plan.placement.quantization)
    if not is_dispatched(model):
        model.to(args.device)
    batches = sum(math.ceil(len(prompts[split]) / args.batch_size) for split in SPLITS)
    with Progress(batches, "site states", "batch"):  # counted per batch (`read_states`)
        states, site = site_states(model, plan.layer, prompts, tokenizer.pad_token_id, args.batch_size, args.device)
    scale = epsilon_scale(site["train"])
    eps = args.epsilon * scale if args.epsilon_relative else float(args.epsilon)
    return SiteInputs(tokenizer, model, prompts, states, site, scale, eps)


@dataclass
class TaskBatch:
    """Test prompts of one task, padded, with their site states and the probes' view of them."""

    prompts: list[Prompt]
    ids: torch.Tensor  # (batch, seq)
    mask: torch.Tensor  # (batch, seq)
    start: torch.Tensor  # (batch, seq, d): the residual stream at the layer, read once
    sites: torch.Tensor  # (batch,)
    last: torch.Tensor  # (batch,)
    h: torch.Tensor  # (batch, d): f(x) at the site, on the CPU
    truth: dict[str, torch.Tensor]  # property -> class ids (batch,), −1 where the value is not kept
    before: dict[str, torch.Tensor]  # property -> the probe's prediction on h (batch,)

    @torch.no_grad()
    def logits(self, model, layer: int, edited: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (batch, vocab) of the LM, with the state `edited` h′ (batch, d)
        written at the site if it is given."""
        edit = None if edited is None else _written(edited)
        return (
            logits_at(
                model,
                self.ids,
                self.mask,
                self.last,
                layer=layer,
                site_positions=self.sites,
                intervention=edit,
                start_states=self.start,
            )
            .float()
            .cpu()
        )


def _written(state: torch.Tensor):
    """The intervention at the site that writes `state` there, h ↦ h′, in the LM's dtype."""
    return lambda h: state.to(h.device, h.dtype)


@torch.no_grad()
def make_batch(prompts, states, h, data, classes, probes, pad_id, device) -> TaskBatch:
    """The batch of these test prompts: padded ids and states (right-padded to the widest) on `device`,
    the site and prediction positions, h, each property's class ids and its probe's prediction on h."""
    ids, mask = _pad(prompts, pad_id)
    width = ids.shape[1]
    start = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, width - len(s))) for s in states])
    return TaskBatch(
        prompts,
        ids.to(device),
        mask.to(device),
        start.to(device),
        torch.tensor([p.site for p in prompts], device=device),
        torch.tensor([p.last for p in prompts], device=device),
        h,
        {p: _labels(data, prompts, p, c) for p, c in classes.items()},
        {p: probe.predict(h) for p, probe in probes.items()},
    )


@torch.no_grad()
def record(
    t: Counter,
    batch: TaskBatch,
    probes,
    prop: str,
    target,
    moved,
    clean,
    edited,
    k_max: int,
    candidates: torch.Tensor | None = None,
) -> None:
    """Add one batch of do(prop = target) to the counts of a (method, property): `moved` is h′,
    `clean` and `edited` the LM's logits without and with it; the top-k overlap and the top-1
    change are taken within `candidates` (the task's answer vocabulary) if given."""
    t["n"] += len(target)
    t["overlap"] += (
        competence_scores(clean, edited, torch.zeros(len(target), dtype=torch.bool), k_max, candidates).sum().item()
    )
    if candidates is not None:
        clean, edited = clean[:, candidates], edited[:, candidates]
    t["top1_changed"] += (edited.argmax(-1) != clean.argmax(-1)).sum().item()
    for other, probe in probes.items():
        truth, after = batch.truth[other], probe.predict(moved)
        known = truth >= 0
        if other == prop:
            t["target_success"] += (after == target).sum().item()
            t["known"] += known.sum().item()
            t["acc_before"] += (batch.before[other] == truth)[known].sum().item()
            t["acc_after"] += (after == truth)[known].sum().item()
        else:  # collateral damage: the other properties' probes
            t["collateral_n"] += known.sum().item()
            t["collateral_before"] += (batch.before[other] == truth)[known].sum().item()
            t["collateral_after"] += (after == truth)[known].sum().item()


def _intervene(run: _Run, task: str, chunk: list[int], vocabulary, metric: dict, tally: dict) -> int:
    """One batch of the task's test prompts: per property Z, a target z′ ≠ z per example, h′ of
    each attack toward it and of the random control, h′ written into the forward; updates the
    Competence `metric` and the (method, property) `tally`; returns how many clean top-1
    predictions are a first token of the right answer."""
    args, plan, inputs, g = run.args, run.plan, run.inputs, run.probes
    batch = make_batch(
        [inputs.prompts["test"][i] for i in chunk],
        [inputs.states["test"][i] for i in chunk],
        inputs.site["test"][chunk],
        plan.data,
        plan.classes,
        g,
        inputs.tokenizer.pad_token_id,
        args.device,
    )
    clean = batch.logits(inputs.model, plan.layer)
    answers = [_first_tokens(inputs.tokenizer, plan.data.entities[p.entity][task]) for p in batch.prompts]
    correct = sum(t in ids for t, ids in zip(clean.argmax(-1).tolist(), answers))
    for prop in plan.properties:
        n_classes = len(plan.classes[prop])
        target = torch.tensor([_other_class(int(y), n_classes, run.rng) for y in batch.truth[prop]])  # z′ ≠ z
        moved = {m: _attacked(m, a, g[prop], batch.h, target, inputs.eps) for m, a in run.attacks.items()}
        causal = torch.full((len(chunk),), prop == task)
        for m, state in moved.items():
            edited = batch.logits(inputs.model, plan.layer, state)
            metric[m].update(clean, edited, causal)
            record(tally[(m, prop)], batch, g, prop, target, state, clean, edited, args.k_max, vocabulary)
        current().update()  # the study's progress: one batch × property
    return correct


def _attacked(name: str, attack, probe, h: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """h′ = `attack`(h) toward `target` with the attack's context (`intervene`), checked to be
    (batch, d) as h is."""
    moved = intervene(attack, h, probe=probe, target=target, epsilon=eps)
    if not isinstance(moved, torch.Tensor) or moved.shape != h.shape:
        got = tuple(moved.shape) if isinstance(moved, torch.Tensor) else type(moved).__name__
        raise ValueError(
            f"method {name!r}: forward(h, probe=, target=, epsilon=) returned {got}; expected h's {tuple(h.shape)}"
        )
    return moved


def _run_task(run: _Run, task: str) -> tuple[list[dict], list[dict]]:
    """The results rows (method × property) and summary rows (per method) of one task: its test
    prompts, in batches, under every method; competence ranks within the task's answer vocabulary."""
    args, plan, inputs = run.args, run.plan, run.inputs
    rows = [i for i, p in enumerate(inputs.prompts["test"]) if p.attribute == task]
    if not rows:
        raise ValueError(f"task {task!r} has no test prompt within max_tokens={args.max_tokens}")
    vocabulary = answer_vocabulary(inputs.tokenizer, plan.data, task, plan.templates[task])
    metric = {m: Competence(args.k_max, candidates=vocabulary) for m in run.names}
    tally = {(m, prop): Counter() for m in run.names for prop in plan.properties}
    lm_correct = 0
    for chunk in _batches(rows, args.batch_size):
        lm_correct += _intervene(run, task, chunk, vocabulary, metric, tally)
    results, summary = [], []
    for m in run.names:
        mine = [result_row(task, m, prop, tally[(m, prop)]) for prop in plan.properties]
        results.extend(mine)
        scores = {k: v.item() for k, v in metric[m].compute().items()}
        summary.append(
            summary_row(
                task,
                m,
                scores,
                mine,
                n_properties=len(plan.properties),
                lm_correct=lm_correct,
                n_examples=len(rows),
                answer_vocabulary=len(vocabulary),
                epsilon=args.epsilon,
                epsilon_abs=inputs.eps,
            )
        )
    return results, summary


def run_tasks(args: CalmArgs, plan: CalmPlan, inputs: SiteInputs, probes: dict) -> tuple[list[dict], list[dict]]:
    """Every task's results and summary rows, in task order (one draw of z′ and of the random
    control's signs, seeded, runs through them all: the methods are built afresh here)."""
    attacks = {spec.name: build_attack(spec) for spec in plan.methods}
    run = _Run(args, plan, inputs, probes, random.Random(args.seed), attacks)
    results, summary = [], []
    counts = Counter(p.attribute for p in inputs.prompts["test"])
    total = sum(math.ceil(counts[task] / args.batch_size) for task in plan.tasks) * len(plan.properties)
    with Progress(total, "interventions", "batch") as shown:  # a test batch × a property (`_intervene`)
        for task in plan.tasks:
            shown.note(f"task {task}")
            mine, rows = _run_task(run, task)
            results.extend(mine)
            summary.extend(rows)
    return results, summary


# --- report: results.csv, summary.csv, summary.json -----------------------------------------------
def result_row(task: str, method: str, prop: str, t: Counter) -> dict:
    """The results.csv row of one (task, method, property): its tally as rates."""
    return {
        "task": task,
        "method": method,
        "property": prop,
        "causal": prop == task,
        "n": t["n"],
        "target_success": t["target_success"] / t["n"],
        "probe_acc_before": t["acc_before"] / max(1, t["known"]),
        "probe_acc_after": t["acc_after"] / max(1, t["known"]),
        "collateral_acc_before": t["collateral_before"] / max(1, t["collateral_n"]),
        "collateral_acc_after": t["collateral_after"] / max(1, t["collateral_n"]),
        "top1_changed": t["top1_changed"] / t["n"],
        "mean_topk_overlap": t["overlap"] / t["n"],
    }


def summary_row(
    task: str,
    method: str,
    scores: dict,
    mine: list[dict],
    *,
    n_properties: int,
    lm_correct: int,
    n_examples: int,
    answer_vocabulary: int,
    epsilon: float,
    epsilon_abs: float,
) -> dict:
    """The summary.csv row of one (task, method): its Competence `scores`, the two baselines (a
    random model: 1/|Z|; doing nothing: (|Z| − 1)/|Z|), the means over its results rows `mine`,
    the LM's accuracy on the task's examples, the answer vocabulary's size and ε."""
    return {
        "task": task,
        "method": method,
        "competence": scores["competence"],
        "competence_causal": scores["causal"],
        "competence_environmental": scores["environmental"],
        "random_model": 1 / n_properties,
        "do_nothing": (n_properties - 1) / n_properties,
        "target_success": _mean(r["target_success"] for r in mine),
        "collateral_acc_before": _mean(r["collateral_acc_before"] for r in mine),
        "collateral_acc_after": _mean(r["collateral_acc_after"] for r in mine),
        "lm_accuracy": lm_correct / n_examples,
        "n_examples": n_examples,
        "answer_vocabulary": answer_vocabulary,
        "epsilon": epsilon,
        "epsilon_abs": epsilon_abs,
    }


def run_config(args: CalmArgs, plan: CalmPlan, prompts: dict, eps: float, scale: float) -> dict:
    """The run's config as summary.json keeps it: the site, the data, the attacks and the probes."""
    return {
        "lm": args.lm,
        "layer": plan.layer,
        "hidden_size": plan.d,
        "site": POSITION,
        "entity_type": args.entity_type,
        "ravel_dir": args.ravel_dir,
        "properties": plan.properties,
        "tasks": plan.tasks,
        "methods": [{"name": m.name, "class_path": m.class_path, "init_args": m.init_args} for m in plan.methods],
        "epsilon": args.epsilon,
        "epsilon_relative": args.epsilon_relative,
        "epsilon_abs": eps,
        "site_scale": scale,
        "alpha": (args.alpha if args.alpha is not None else eps / 10),
        "steps": args.steps,
        "k_max": args.k_max,
        "probe": args.probe,
        "probe_epochs": args.probe_epochs,
        "entities": {s: len(v) for s, v in plan.split_of.items()},
        "prompts": {s: len(v) for s, v in prompts.items()},
        "templates": plan.templates,
        "seed": args.seed,
    }


def _mean(values) -> float:
    """The mean, NaN when there is no value."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def write_results(out_dir: Path, results: list[dict], summary: list[dict], config: dict, probes: dict) -> None:
    """DIR/results.csv, DIR/summary.csv, and DIR/summary.json (config, probes, summary, results),
    each written whole (a temporary file renamed over it)."""
    for name, rows in (("results.csv", results), ("summary.csv", summary)):
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(Path(out_dir) / name, text.getvalue())
    payload = {"config": config, "probes": probes, "summary": summary, "results": results}
    write_atomically(Path(out_dir) / "summary.json", json.dumps(payload, indent=2) + "\n")


# --- the study: plan, run, report -----------------------------------------------------------------
def run_calm(config: CalmArgs | None = None, /, **settings) -> list[dict]:
    """Run the CALM study; returns the summary rows (one per task × method).

    `config`: the settings as a `CalmArgs` (its docstring says what each one is; default: its
    defaults); `settings`: any of its fields as keywords, over `config`'s, e.g.
    `run_calm(tasks=["Country"], methods=["pgd"], out="runs/calm")`.
    """
    names = [f.name for f in fields(CalmArgs)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise ValueError(f"run_calm has no setting {', '.join(unknown)}; the settings are {', '.join(names)}")
    args = replace(CalmArgs() if config is None else config, **settings)
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    plan = plan_calm(args)  # every check, before the LM's weights are read
    inputs = read_inputs(args, plan)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe_args = dict(
        kind=args.probe,
        hidden=args.probe_hidden,
        lr=args.probe_lr,
        epochs=args.probe_epochs,
        batch_size=args.probe_batch_size,
    )
    where = (args.lm, plan.layer, plan.d)
    training = len(set(plan.classes) - set(plan.loaded))
    with Progress(training, "probes", "probe") if training else nullcontext():  # each one trained (`fit_probes`)
        g, probe_info = fit_probes(
            plan.data,
            inputs.prompts,
            inputs.site,
            plan.classes,
            plan.loaded,
            where,
            probe_args,
            args.seed,
            out_dir / "probes",
        )
    results, summary = run_tasks(args, plan, inputs, g)
    record = run_config(args, plan, inputs.prompts, inputs.eps, inputs.scale)
    write_results(out_dir, results, summary, record, probe_info)
    return summary


def _arguments(parser) -> None:
    """The command's options: the fields of `CalmArgs`."""
    parser.add_class_arguments(CalmArgs)


def main(args=None) -> None:
    """`lit-interventions calm`: the study from the command line."""
    run_cli(run_calm, __doc__, args, customize=_arguments)
