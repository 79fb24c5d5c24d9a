"""The CausalGym sweep at a fine site component: every method at every layer × head × region
(a head component) or layer × region (any other) of every task.

    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --component value [--heads "[0,1]"]
    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --component mlp_neuron

The components are `core.blocks.COMPONENTS` but `block_output` (the default sweep,
`causalgym_sweep`): `block_input`, `attention_output`, `mlp_output`, `mlp_neuron`, and, per head,
`attention_head`, `query`, `key`, `value` (key and value count the key/value heads of
grouped-query attention). A site is (layer, head, region), its head None for a component
without heads, at the last token of the region (`sites.Site`). Each site is run on its own
through the path `train.py` runs (`InterchangeModule(component=..., head=h)`, the full forward,
no activation cache): a trained method (DAS, DBM, ...) is trained there by a Lightning loop of
one epoch seeded as `train.py fit` seeds it (`train_at_site`); the closed-form methods are fitted
on the site's base train states and their sentence types and every method is scored with the
same interchange and odds metric (`causalgym_scoring.sweep_site`, `fit_states`,
`fit_closed_form`, `InterchangeModule.score`).

Writes, resumably (one transaction per site; a rerun skips the finished sites and reuses the
trained interventions):
- DIR/results.csv: task, method, layer, head, region, odds, iia [, control_odds, control_iia]
  (head empty for a component without heads);
- DIR/summary.csv: task, method, head, accuracy, overall_odds (CausalGym eq. 19 at that head:
  the mean over layers of the best scored region's odds), selectivity; without heads, one row
  per (task, method) and no head column, as the block-output sweep writes it;
- DIR/heatmaps/TASK_METHOD_heads.png: layer × head, each cell the best scored region's odds; without
  heads, DIR/heatmaps/TASK_METHOD.png: layer × region (`causalgym_report.write_heatmaps`);
- DIR/METHOD/TASK_LAYER[_hHEAD][_control].safetensors: a trained method's interventions ({region: W}).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import defaultdict
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch

from lit_interventions.artifacts.plots import DPI, heatmap_figure, save_figures
from lit_interventions.artifacts.results import Table
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.lm import load_lm
from lit_interventions.core.parts import site_tap
from lit_interventions.core.progress import Progress
from lit_interventions.core.signals import raise_pending
from lit_interventions.core.sites import BLOCK_OUTPUT, COMPONENTS, HEAD_COMPONENTS, KEY, VALUE, head_counts
from lit_interventions.interventions.registry import TRAINED, MethodSpec
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.objectives import build_objective
from lit_interventions.studies import distributed
from lit_interventions.studies.causalgym_report import SUMMARY_COLUMNS, summary_rows, write_heatmaps, write_summary_csv
from lit_interventions.studies.causalgym_scoring import CONTROL, sweep_site, task_accuracy
from lit_interventions.studies.causalgym_training import (
    frozen_intervention,
    one_epoch_trainer,
    read_trained,
    trained_path,
    write_trained,
)
from lit_interventions.studies.causalgym_units import unit_position

SITE_RESULTS = Table(
    "results",
    ("task", "method", "layer", "head", "region", "odds", "iia", "control_odds", "control_iia"),
    key=("task", "method", "layer", "head", "region"),
    numeric=("layer", "head", "odds", "iia", "control_odds", "control_iia"),
    optional=("head", "control_odds", "control_iia"),
)
# a method is finished at a (layer, head) of a task once all its regions ran (control: 1 with the control)
SITE_FINISHED = Table(
    "finished",
    ("task", "layer", "head", "method", "control"),
    key=("task", "layer", "head", "method"),
    numeric=("layer", "head", "control"),
    optional=("head",),
    export=False,
)
HEAD_SUMMARY_COLUMNS = ["task", "method", "head", *SUMMARY_COLUMNS[2:]]


def choose_heads(component: str, heads, config, layers: list[int]) -> list[int | None] | None:
    """The heads the sweep sweeps: None for the block output (the default sweep); [None] for a
    component without heads (`heads` must be None); for a head component, `heads` (None or 'all':
    every head; an int or a list), each checked against the model's query heads (key and value:
    its key/value heads); and, for every component but the block output, `layers` without -1
    (the embeddings have only the block output)."""
    if component not in COMPONENTS:
        raise ValueError(f"component={component!r} is not swept; choose one of: {', '.join(COMPONENTS)}")
    if component not in HEAD_COMPONENTS and heads is not None:
        raise ValueError(
            f"heads={heads!r} is given with component={component!r}, which has no heads: "
            f"heads is only for {', '.join(HEAD_COMPONENTS)}"
        )
    if component == BLOCK_OUTPUT:
        return None
    if -1 in layers:
        raise ValueError(
            f"layer -1 (the embeddings) has no {component}: choose layers 0.. with component={component!r}"
        )
    return _heads(component, heads, config) if component in HEAD_COMPONENTS else [None]


def _heads(component: str, heads, config) -> list[int]:
    """`heads` of a head component, checked against the model's count for it."""
    n_query, n_kv, _ = head_counts(config)
    n, kind = (n_kv, "key/value") if component in (KEY, VALUE) else (n_query, "attention")
    allowed = f"this model has {n} {kind} heads (0..{n - 1}, or 'all')"
    every = heads is None or heads == "all" or heads == ["all"]
    if not every and (isinstance(heads, str) or heads == []):
        raise ValueError(f"heads={heads!r} names no head index: {allowed}")
    found = list(range(n)) if every else [heads] if isinstance(heads, int) else list(heads)
    bad = [h for h in found if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n]
    if bad:
        raise ValueError(f"heads {bad} are out of range for component={component!r}: {allowed}")
    if len(set(found)) != len(found):
        raise ValueError(f"heads {found} name a head twice: give each head once")
    return found


def check_found(lm: str, dtype: str, component: str, layer: int, head: int | None) -> None:
    """A one-line ValueError, before any sweep work, where the LM's architecture has no
    `component` the hooks can find (the check `train.py fit` meets at its first forward)."""
    site_tap(load_lm(lm, dtype), layer, component, head)


def check_component(out: Path, component: str) -> None:
    """Refuse an output directory that holds a sweep of another component (meta.json's
    `component`; none: block_output) before it is claimed."""
    path = Path(out) / "meta.json"
    try:
        found = json.loads(path.read_text()).get("component", BLOCK_OUTPUT)
    except (OSError, ValueError, AttributeError):
        return  # no directory yet, or a damaged meta.json, which claiming it reports
    if found != component:
        raise ValueError(f"{out} holds a sweep of component={found!r}, not {component!r}: choose another --out")


def train_at_site(method: MethodSpec, lm: str, layer: int, component: str, head, data, seed: int, dtype: str):
    """A trained method's intervention at `component` (head `head`, None without heads) of layer
    `layer`, at `data`'s region: what `train.py fit --model.component C [--model.head H]` trains
    there (seeded by `seed_everything(seed)`, then the module built, then one epoch over the
    shuffled train split at the data's batch size), without its validation; at a site where no train pair differs
    (`unchanged_at`), the initialised intervention, which that epoch leaves as it is."""
    L.seed_everything(seed, verbose=False)
    module = InterchangeModule(
        lm=lm,
        layer=layer,
        region=data.region,
        intervention=method.build,
        objective=build_objective(method),
        lr=method.lr,
        warmup_ratio=method.warmup_ratio,
        dtype=dtype,
        component=component,
        head=head,
    )
    module.to("cuda" if torch.cuda.is_available() else "cpu")  # where the LM is
    if unchanged_at(module, data):
        return module.intervention  # f(b) = f(s) at every train pair: a zero gradient, nothing moves
    trainer = one_epoch_trainer()
    trainer.fit(module, datamodule=data)
    return module.intervention


@torch.no_grad()
def unchanged_at(module: InterchangeModule, data, batch_size: int = 64) -> bool:
    """Whether every train pair's base and source have the same state at `module`'s site, bit
    for bit (a region before the pairs' first difference, under causal attention). There f* =
    f(b) + Wᵀ(W f(s) − W f(b)) = f(b) whatever W is: the loss's gradient is exactly zero, so
    training leaves the intervention as it was initialised."""
    with torch.random.fork_rng(devices=[]):  # a DataLoader's iterator draws its seed: the loop's order stays
        for batch in data.loader("train", batch_size):
            batch = module.transfer_batch_to_device(batch, module.device, 0)
            if not torch.equal(module.site_representation(batch, "base"), module.site_representation(batch, "source")):
                return False
    return True


def saved_at_site(path: Path, region: str, method: MethodSpec, train) -> torch.nn.Module:
    """`method`'s trained intervention at `region` kept in `path` ({region: its exported
    tensors}, `trained_path`), trained by `train()` and added to the file (written whole) where
    it lacks it; returned as the fixed intervention it acts as."""
    regions, config = read_trained(path)
    if region not in regions:
        trained = train()
        regions[region], config = trained.export(), trained.config()
        write_trained(path, regions, config)
    return frozen_intervention(method, regions[region], config)


def _trained(out: Path, task: str, layer: int, site: tuple, region: str, data_of, setup, control: bool):
    """({name: intervention}, the same on the control task) of the trained methods at a site;
    `site`: (component, head)."""
    found = ({}, {})
    for method in setup.methods:
        if setup.kinds[method.name] != TRAINED:
            continue
        for kind, into in [(None, found[0]), *([(CONTROL, found[1])] if control else [])]:
            data = data_of(region, kind)
            if data is not None:
                path = trained_path(out, task, layer, kind, method.name, site[1])
                train = partial(train_at_site, method, setup.lm, layer, *site, data, setup.seed, setup.dtype)
                into[method.name] = saved_at_site(path, region, method, train)
    return found


def _sweep_unit(store, task: str, layers, setup, component: str, heads: list, done: set, progress) -> float:
    """Every (layer, head, region) of a unit not in `done` (head None: a component without heads),
    each trained, fitted, scored and stored in its own transaction, a (layer, head)'s finished
    methods with its last region; the task's Acc."""
    model = load_lm(setup.lm, setup.dtype).to("cuda" if torch.cuda.is_available() else "cpu")
    cache = ActivationCache(model, list(layers))  # Acc only: the sites run the full forward
    data_of = functools.cache(setup.tasks[task].data)
    accuracy = task_accuracy(data_of(None, None), setup.lm, cache, setup.dtype, setup.batch_size)
    control = task in setup.control
    for layer in layers:
        for head in heads:
            progress.note(f"{task}: layer {layer}" + ("" if head is None else f", head {head}"))
            for region in setup.tasks[task].regions:
                raise_pending()  # a signal a library swallowed stops the sweep between sites
                methods = [m for m in setup.methods if (task, m.name, layer, head, region) not in done]
                data = data_of(region)
                if methods and data is not None:
                    sub = dataclasses.replace(setup, methods=methods)
                    trained = _trained(store.out, task, layer, (component, head), region, data_of, sub, control)
                    control_data = data_of(region, CONTROL) if control else None
                    rows = sweep_site(
                        task, layer, region, methods, setup.lm, data, control_data, cache, setup.seed,
                        setup.dtype, *trained, setup.batch_size, component=component, head=head,
                    )  # fmt: skip
                    store.add({"results": [{**row, "head": head} for row in rows]})
                progress.update()
            finished = [
                {"task": task, "layer": layer, "head": head, "method": m.name, "control": int(control)}
                for m in setup.methods
            ]
            store.add({"finished": finished})
    return accuracy


def _plan(units, names: list[str], heads: list, control: frozenset[str]):
    """plan(store): the units with work left, and the finished sites (a site run without the
    control, on a task of `control`, is redone with it)."""

    def plan(store) -> tuple[list, set]:
        done = {
            (r["task"], r["method"], int(r["layer"]), head_of(r), r["region"])
            for r in store.rows("results")
            if r["control_odds"] or r["task"] not in control
        }
        finished = {
            (r["task"], int(r["layer"]), head_of(r), r["method"])
            for r in store.rows("finished")
            if r["control"] == "1" or r["task"] not in control
        }
        measured = {r["task"] for r in store.rows("accuracy")}
        todo = [
            (task, group)
            for task, group in units
            if task not in measured
            or any((task, layer, h, m) not in finished for layer in group for h in heads for m in names)
        ]
        return todo, done

    return plan


def run_components(ranks, out: Path, meta: dict, units, layers: list[int], heads: list, setup, accuracy_table):
    """Claim (or resume) `out`, sweep this process's units at meta's component, at every head of
    `heads` ([None]: a component without heads), merge, write summary.csv and the heatmaps: the
    summary rows."""
    names, component = [m.name for m in setup.methods], meta["component"]
    check_found(setup.lm, setup.dtype, component, layers[0], heads[0])  # before the directory is claimed
    tables = [SITE_RESULTS, accuracy_table, SITE_FINISHED]
    with distributed.ShardedRun(ranks, out, meta, tables, ignore=("templates", "pairs")) as run:
        todo, done = run.start(_plan(units, names, heads, setup.control))
        total = sum(len(group) * len(heads) * len(setup.tasks[task].regions) for task, group in todo)
        with Progress(total, "sites", "site") as progress:
            for task, group in run.take(todo, cost=lambda unit: len(unit[1]) * len(setup.tasks[unit[0]].regions)):
                accuracy = _sweep_unit(run.store, task, group, setup, component, heads, done, progress)
                run.store.add({"accuracy": [{"task": task, "accuracy": accuracy}]})
        scored = {name: task.scored_regions for name, task in setup.tasks.items()}
        summary = run.finish(
            unit_position(units), partial(_summary, scored=scored, names=names, layers=layers, heads=heads, out=out)
        )
        if ranks.is_main:  # the figures last: one not written leaves the results as they are
            rows = _rows(run.main, list(scored), names, layers, heads)
            if heads == [None]:  # layer × region, as the block-output sweep draws it
                write_heatmaps(rows, {name: task.regions for name, task in setup.tasks.items()}, summary, out)
            else:
                write_head_heatmaps(rows, scored, summary, out, component)
        return summary


def _rows(store, tasks, names, layers, heads) -> list[dict]:
    return [
        r
        for r in store.rows("results")
        if r["task"] in tasks and r["method"] in names and int(r["layer"]) in layers and head_of(r) in heads
    ]


def head_of(row: dict) -> int | None:
    """A results row's head: None where it is empty (a component without heads)."""
    return None if row["head"] == "" else int(row["head"])


def head_summary(results: list[dict], accuracy: dict[str, float], scored: dict[str, list[str]]) -> list[dict]:
    """One row per (task, method, head) (head None: a component without heads): the task's Acc,
    the overall odds at that head (CausalGym eq. 19 over the head's sites: the mean over layers
    of the best scored region's odds) and, where every site has the control, the selectivity
    (`causalgym_report.summary_rows`)."""
    by_head = defaultdict(list)
    for row in results:
        by_head[head_of(row)].append(row)
    lines = [
        {**line, "head": head}
        for head, rows in sorted(by_head.items(), key=lambda item: item[0] or 0)
        for line in summary_rows(rows, accuracy, scored)
    ]
    order = {(r["task"], r["method"]): i for i, r in enumerate(results)}
    return sorted(lines, key=lambda line: (order[(line["task"], line["method"])], line["head"] or 0))


def _summary(store, scored, names, layers, heads, out: Path) -> list[dict]:
    """DIR/summary.csv of the store's rows (`head_summary`; without heads, no head column),
    written whole; its rows."""
    accuracy = {r["task"]: float(r["accuracy"]) for r in store.rows("accuracy")}
    summary = head_summary(_rows(store, list(scored), names, layers, heads), accuracy, scored)
    columns = SUMMARY_COLUMNS if heads == [None] else HEAD_SUMMARY_COLUMNS
    return write_summary_csv([{c: row[c] for c in columns if c in row} for row in summary], out, columns)


def best_region_grid(results: list[dict], regions: list[str]) -> tuple[np.ndarray, list[int], list[int]]:
    """(layers × heads matrix, layers, heads) of one task and method's rows: each cell the best
    odds over the scored `regions` at that (layer, head), NaN where none was run."""
    layers = sorted({int(r["layer"]) for r in results})
    heads = sorted({int(r["head"]) for r in results})
    matrix = np.full((len(layers), len(heads)), -math.inf)
    for r in results:
        if r["region"] in regions:
            i, j = layers.index(int(r["layer"])), heads.index(int(r["head"]))
            matrix[i, j] = max(matrix[i, j], float(r["odds"]))
    matrix[np.isneginf(matrix)] = np.nan
    return matrix, layers, heads


def write_head_heatmaps(results, scored: dict[str, list[str]], summary, out: Path, component: str = "attention_head"):
    """DIR/heatmaps/TASK_METHOD_heads.png: per task and method, the layer × head grid of the best
    scored region's odds (`best_region_grid`) of the head component `component`; every one
    tried, the first not written raised."""
    grouped = defaultdict(list)
    for row in results:
        grouped[(row["task"], row["method"])].append(row)

    def figures():
        for task, method in dict.fromkeys((line["task"], line["method"]) for line in summary):
            matrix, layers, heads = best_region_grid(grouped[(task, method)], scored[task])
            title = f"{task} · {method} · best region's odds per head"
            fig = heatmap_figure(matrix, layers, heads, title, xlabel=f"{component} head")[0]
            yield fig, Path(out) / "heatmaps" / f"{task}_{method}_heads.png"

    return save_figures(figures(), dpi=DPI)
