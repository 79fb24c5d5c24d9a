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
   FGSM) and, as the control, add a random ±ε perturbation; write h + δ back into the forward;
4. score competence (top-k overlap with the causal graph's prediction, k = 1..k_max, ranked
   within the task's answer vocabulary: the first tokens of the queried attribute's values, as
   the paper ranks within the task's answer vocabulary, App. B.2), the
   targeted probe's success and accuracy after the attack, and the collateral damage (accuracy
   of the other properties' probes after it).

Writes DIR/results.csv (one row per task × method × property), DIR/summary.csv (one row per
task × method) and DIR/summary.json (both, plus probes, ε and the config); probes in DIR/probes/.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_interventions.cli.studies import run_cli
from lit_interventions.core.lm import DEFAULT_LM, check_device, hidden_size, load_config, load_lm, load_tokenizer
from lit_interventions.core.sharding import LoadOptions, is_dispatched
from lit_interventions.core.sites import logits_at, site_layer
from lit_interventions.datamodules.ravel import load_ravel
from lit_interventions.interventions.attacks import ATTACKS, add, attack, epsilon_scale, random_sign
from lit_interventions.metrics.competence import Competence, competence_scores
from lit_interventions.modules.probe import KINDS, ProbeModule, load_probe, train_probe
from lit_interventions.studies.calm_data import (
    SPLITS,
    Prompt,
    _batches,
    _check_names,
    _first_tokens,
    _labels,
    _other_class,
    _pad,
    answer_vocabulary,
    choose_templates,
    property_classes,
    read_states,
    split_entities,
    tokenize_prompt,
)

RANDOM = "random"  # the control: ±ε per coordinate, same size as the attacks
POSITION = "entity_last"


@dataclass
class _Batch:
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
    def logits(self, model, layer: int, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (batch, vocab) of the LM, with h + δ written at the site if δ is given."""
        edit = None if delta is None else add(delta.to(self.ids.device))
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


@torch.no_grad()
def _make_batch(prompts, states, h, data, classes, probes, pad_id, device) -> _Batch:
    ids, mask = _pad(prompts, pad_id)
    width = ids.shape[1]
    start = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, width - len(s))) for s in states])
    return _Batch(
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
def _record(
    t: Counter,
    batch: _Batch,
    probes,
    prop: str,
    target,
    delta,
    clean,
    edited,
    k_max: int,
    candidates: torch.Tensor | None = None,
) -> None:
    """Add one batch of do(prop = target) to the counts of a (method, property); the top-k overlap
    and the top-1 change are taken within `candidates` (the task's answer vocabulary) if given."""
    t["n"] += len(target)
    t["overlap"] += (
        competence_scores(clean, edited, torch.zeros(len(target), dtype=torch.bool), k_max, candidates).sum().item()
    )
    if candidates is not None:
        clean, edited = clean[:, candidates], edited[:, candidates]
    t["top1_changed"] += (edited.argmax(-1) != clean.argmax(-1)).sum().item()
    moved = batch.h + delta
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


def _result_row(task: str, method: str, prop: str, t: Counter) -> dict:
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


def fit_probes(data, prompts, site, classes, loaded, where, args: dict, seed: int, save_dir: Path):
    """A probe per property (trained on train entities with a kept value, best val epoch kept, or
    `loaded`), and its accuracy per split: ({property: probe}, {property: info})."""
    lm, layer, d = where
    probes, info = {}, {}
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
            probes[prop] = train_probe(
                module, train, val, args["epochs"], args["batch_size"], seed, save_to=save_dir / f"{prop}.ckpt"
            )
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


# --- the study ------------------------------------------------------------------------------------
def run_calm(
    lm: str = DEFAULT_LM,
    dtype: str = "float32",
    device: str = "cpu",
    ravel_dir: str | None = None,
    entity_type: str = "city",
    properties: list[str] | None = None,
    tasks: list[str] | None = None,
    layer: int | None = None,
    max_classes: int = 6,
    entities: dict[str, int] | None = None,
    templates_per_property: int = 3,
    max_tokens: int = 96,
    probe: str = "mlp",
    probe_hidden: int | None = None,
    probe_epochs: int = 32,
    probe_lr: float = 1e-3,
    probe_batch_size: int = 64,
    probes: str | None = None,
    methods: list[str] | None = None,
    epsilon: float = 0.1,
    epsilon_relative: bool = False,
    alpha: float | None = None,
    steps: int = 40,
    k_max: int = 10,
    batch_size: int = 16,
    seed: int = 0,
    out: str = "runs/calm",
    device_map: str | int | dict | None = None,
    quantization: str | None = None,
) -> list[dict]:
    """Run the CALM study; returns the summary rows (one per task × method).

    Args:
        lm, dtype, device: the frozen LM ("gemma-3-270m" by default) and where it runs.
        ravel_dir, entity_type: RAVEL files (None: our built-in data) and the entity type.
        properties: the attributes Z to probe and intervene on (default: all of the type).
        tasks: the attributes whose prompts form the tasks (default: every property).
        layer: residual stream after this block (default: the middle layer); site: entity's last token.
        max_classes: each property keeps its most frequent values among train entities.
        entities: at most this many entities per split, {"train": .., "val": .., "test": ..}.
        templates_per_property: prompt templates per attribute (probes read all of them; a task's
            examples use its own); templates longer than max_tokens (with the entity) are dropped.
        probe, probe_hidden, probe_epochs, probe_lr, probe_batch_size: g_Z ("mlp" or "linear").
        probes: a directory of probes saved by an earlier run (PROPERTY.ckpt) to reuse; each must
            have been trained at this site of this model.
        methods: attacks among fgsm, pgd (the random control always runs).
        epsilon: the L∞ radius, > 0. epsilon_relative: multiply it by the site's coordinate scale
            (the median per-coordinate std of the train states); False = absolute, as in the paper.
        alpha, steps: PGD step (default ε/10) and T (40).
        k_max: competence averages top-k overlap over k = 1..k_max (10), ranked within the task's
            answer vocabulary (k stops at its size if that is smaller).
        device_map, quantization: a frozen LM larger than one device (`lit_interventions.core.sharding`):
            e.g. "auto" and "4bit"; `device` is then where the inputs and probes go.
    """
    # -- validate everything before the LM's weights are read
    methods = _check_names(methods, list(ATTACKS), "methods") if methods is not None else list(ATTACKS)
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be > 0 (the L∞ radius of the interventions)")
    if probe not in KINDS:
        raise ValueError(f"probe={probe!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r} must be an int >= 1")
    if max_classes < 2:
        raise ValueError(f"max_classes={max_classes!r} must be >= 2")
    if alpha is not None and not alpha > 0:
        raise ValueError(f"alpha={alpha!r} must be > 0 (the PGD step), or null for ε/10")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    check_device(device)
    placement = LoadOptions(device_map, quantization)
    sizes = {"train": 200, "val": 50, "test": 50} | dict(entities or {})
    if set(sizes) != set(SPLITS) or any(not isinstance(n, int) or n < 1 for n in sizes.values()):
        raise ValueError(f"entities={entities!r}: give positive ints for {', '.join(SPLITS)}")
    data = load_ravel(ravel_dir, entity_type)
    properties = _check_names(properties, data.attributes, f"properties of entity type {entity_type!r}:")
    tasks = _check_names(tasks, properties, "tasks (must be among the properties)")
    config = load_config(lm)
    layer = site_layer(config, layer)
    d = hidden_size(config)
    loaded = {}
    if probes is not None:
        for prop in properties:
            path = Path(probes) / f"{prop}.ckpt"
            if not path.is_file():
                raise ValueError(f"no probe for property {prop!r} at {path}")
            loaded[prop] = load_probe(path)
            loaded[prop].check_site(lm, layer, d, POSITION)
    classes = property_classes(data, properties, max_classes)
    for prop, g in loaded.items():
        if g.classes != classes[prop]:
            raise ValueError(f"the saved probe of {prop!r} has classes {g.classes}; this run keeps {classes[prop]}")
    split_of = split_entities(data, properties, sizes, seed)
    templates = choose_templates(data, properties, templates_per_property, seed)

    # -- tokenise, read the site states once
    tokenizer = load_tokenizer(lm)
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
    model = load_lm(lm, dtype, placement.device_map, placement.quantization)
    if not is_dispatched(model):
        model.to(device)
    pad_id = tokenizer.pad_token_id
    states = {s: read_states(model, layer, prompts[s], pad_id, batch_size, device) for s in SPLITS}
    site = {s: torch.stack([st[p.site] for st, p in zip(states[s], prompts[s])]) for s in SPLITS}  # (n, d)
    scale = epsilon_scale(site["train"])
    eps = epsilon * scale if epsilon_relative else float(epsilon)

    # -- probes
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe_args = dict(kind=probe, hidden=probe_hidden, lr=probe_lr, epochs=probe_epochs, batch_size=probe_batch_size)
    where = (lm, layer, d)
    g, probe_info = fit_probes(data, prompts, site, classes, loaded, where, probe_args, seed, out_dir / "probes")

    # -- interventions per task
    rng = random.Random(seed)
    noise = torch.Generator().manual_seed(seed)
    names = [*methods, RANDOM]
    results, summary = [], []
    for task in tasks:
        rows = [i for i, p in enumerate(prompts["test"]) if p.attribute == task]
        if not rows:
            raise ValueError(f"task {task!r} has no test prompt within max_tokens={max_tokens}")
        vocabulary = answer_vocabulary(tokenizer, data, task, templates[task])  # competence ranks within it
        metric = {m: Competence(k_max, candidates=vocabulary) for m in names}
        tally = {(m, prop): Counter() for m in names for prop in properties}
        lm_correct = 0
        for chunk in _batches(rows, batch_size):
            batch = _make_batch(
                [prompts["test"][i] for i in chunk],
                [states["test"][i] for i in chunk],
                site["test"][chunk],
                data,
                classes,
                g,
                pad_id,
                device,
            )
            clean = batch.logits(model, layer)
            answers = [_first_tokens(tokenizer, data.entities[p.entity][task]) for p in batch.prompts]
            lm_correct += sum(t in ids for t, ids in zip(clean.argmax(-1).tolist(), answers))
            for prop in properties:
                n_classes = len(classes[prop])
                target = torch.tensor([_other_class(int(y), n_classes, rng) for y in batch.truth[prop]])  # z′ ≠ z
                deltas = {m: attack(m, g[prop], batch.h, target, eps, alpha, steps) for m in methods}
                deltas[RANDOM] = random_sign(batch.h, eps, noise)
                causal = torch.full((len(chunk),), prop == task)
                for m, delta in deltas.items():
                    edited = batch.logits(model, layer, delta)
                    metric[m].update(clean, edited, causal)
                    _record(tally[(m, prop)], batch, g, prop, target, delta, clean, edited, k_max, vocabulary)
        for m in names:
            mine = [_result_row(task, m, prop, tally[(m, prop)]) for prop in properties]
            results.extend(mine)
            scores = {k: v.item() for k, v in metric[m].compute().items()}
            summary.append(
                {
                    "task": task,
                    "method": m,
                    "competence": scores["competence"],
                    "competence_causal": scores["causal"],
                    "competence_environmental": scores["environmental"],
                    "random_model": 1 / len(properties),
                    "do_nothing": (len(properties) - 1) / len(properties),
                    "target_success": _mean(r["target_success"] for r in mine),
                    "collateral_acc_before": _mean(r["collateral_acc_before"] for r in mine),
                    "collateral_acc_after": _mean(r["collateral_acc_after"] for r in mine),
                    "lm_accuracy": lm_correct / len(rows),
                    "n_examples": len(rows),
                    "answer_vocabulary": len(vocabulary),
                    "epsilon": epsilon,
                    "epsilon_abs": eps,
                }
            )
    _write(
        out_dir,
        results,
        summary,
        {
            "lm": lm,
            "layer": layer,
            "hidden_size": d,
            "site": POSITION,
            "entity_type": entity_type,
            "ravel_dir": ravel_dir,
            "properties": properties,
            "tasks": tasks,
            "methods": methods,
            "epsilon": epsilon,
            "epsilon_relative": epsilon_relative,
            "epsilon_abs": eps,
            "site_scale": scale,
            "alpha": (alpha if alpha is not None else eps / 10),
            "steps": steps,
            "k_max": k_max,
            "probe": probe,
            "probe_epochs": probe_epochs,
            "entities": {s: len(v) for s, v in split_of.items()},
            "prompts": {s: len(v) for s, v in prompts.items()},
            "templates": templates,
            "seed": seed,
        },
        probe_info,
    )
    return summary


def _accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy over the examples with a kept class (label >= 0)."""
    known = labels >= 0
    return (predicted[known] == labels[known]).float().mean().item() if known.any() else math.nan


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _write(out_dir: Path, results: list[dict], summary: list[dict], config: dict, probes: dict) -> None:
    for name, rows in (("results.csv", results), ("summary.csv", summary)):
        with open(out_dir / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    payload = {"config": config, "probes": probes, "summary": summary, "results": results}
    (out_dir / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")


def main(args=None) -> None:
    run_cli(run_calm, __doc__, args)
