"""The CausalGym sweep at attention heads: every method at every layer × head × region of every task.

    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --component attention_head [--heads "[0,3]"]

A head site is the output of one attention head before the attention's output projection
(`sites.Site` component `attention_head`, pyvene's head_attention_value_output), head_dim
features, at the last token of a region. Each site (layer, head, region) is run on its own
through the path `train.py` runs (`InterchangeModule(component="attention_head", head=h)`, the
full forward, no activation cache): a trained method (DAS, DBM, ...) is trained there by a
Lightning loop of one epoch seeded as `train.py fit` seeds it (`train_at_head`); the closed-form
methods are fitted on the site's base train states and their sentence types and every method is
scored with the same interchange and odds metric (`causalgym_scoring.sweep_site`, `fit_states`,
`fit_closed_form`, `InterchangeModule.score`).

Writes, resumably (one transaction per site; a rerun skips the finished sites and reuses the
trained interventions):
- DIR/results.csv: task, method, layer, head, region, odds, iia [, control_odds, control_iia];
- DIR/summary.csv: task, method, head, accuracy, overall_odds (CausalGym eq. 19 at that head:
  the mean over layers of the best scored region's odds), selectivity;
- DIR/heatmaps/TASK_METHOD_heads.png: layer × head, each cell the best scored region's odds;
- DIR/METHOD/TASK_LAYER_hHEAD[_control].safetensors: a trained method's interventions ({region: W}).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
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
from lit_interventions.core.files import write_atomically
from lit_interventions.core.lm import load_lm
from lit_interventions.core.progress import Progress
from lit_interventions.core.signals import raise_pending
from lit_interventions.core.sites import ATTENTION_HEAD, BLOCK_OUTPUT, head_counts
from lit_interventions.interventions.registry import TRAINED, MethodSpec
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.studies import distributed
from lit_interventions.studies.causalgym_report import SUMMARY_COLUMNS, summary_rows
from lit_interventions.studies.causalgym_scoring import CONTROL, sweep_site, task_accuracy
from lit_interventions.studies.causalgym_training import frozen_intervention, read_trained, trained_path, write_trained
from lit_interventions.studies.causalgym_units import unit_position

COMPONENTS = (BLOCK_OUTPUT, ATTENTION_HEAD)  # what the sweep sweeps
HEAD_RESULTS = Table(
    "results",
    ("task", "method", "layer", "head", "region", "odds", "iia", "control_odds", "control_iia"),
    key=("task", "method", "layer", "head", "region"),
    numeric=("layer", "head", "odds", "iia", "control_odds", "control_iia"),
    optional=("control_odds", "control_iia"),
)
# a method is finished at a (layer, head) of a task once all its regions ran (control: 1 with the control)
HEAD_FINISHED = Table(
    "finished",
    ("task", "layer", "head", "method", "control"),
    key=("task", "layer", "head", "method"),
    numeric=("layer", "head", "control"),
    export=False,
)
HEAD_SUMMARY_COLUMNS = ["task", "method", "head", *SUMMARY_COLUMNS[2:]]


def choose_heads(component: str, heads, config, layers: list[int]) -> list[int] | None:
    """The heads the sweep sweeps: None for the block output (the default sweep); for
    `attention_head`, `heads` (None or 'all': every head of the model; an int or a list), each
    checked against the model's query heads, and `layers` without -1 (the embeddings have none)."""
    if component not in COMPONENTS:
        raise ValueError(f"component={component!r} is not swept; choose one of: {', '.join(COMPONENTS)}")
    if component == BLOCK_OUTPUT:
        if heads is not None:
            raise ValueError(
                f"heads={heads!r} is given with component='block_output', which has no heads: "
                "heads is only for component='attention_head'"
            )
        return None
    n_heads = head_counts(config)[0]
    allowed = f"this model has {n_heads} attention heads (0..{n_heads - 1}, or 'all')"
    every = heads is None or heads == "all" or heads == ["all"]
    if not every and (isinstance(heads, str) or heads == []):
        raise ValueError(f"heads={heads!r} names no head index: {allowed}")
    found = list(range(n_heads)) if every else [heads] if isinstance(heads, int) else list(heads)
    bad = [h for h in found if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_heads]
    if bad:
        raise ValueError(f"heads {bad} are out of range: {allowed}")
    if len(set(found)) != len(found):
        raise ValueError(f"heads {found} name a head twice: give each head once")
    if -1 in layers:
        raise ValueError("layer -1 (the embeddings) has no attention heads: choose layers 0.. with attention_head")
    return found


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


def train_at_head(method: MethodSpec, lm: str, layer: int, head: int, data, seed: int, dtype: str):
    """A trained method's intervention at head `head` of layer `layer`, at `data`'s region: what
    `train.py fit --model.component attention_head --model.head HEAD` trains there (seeded by
    `seed_everything(seed)`, then the module built, then one epoch over the shuffled train split
    at the data's batch size), without its validation; at a site where no train pair differs
    (`unchanged_at`), the initialised intervention, which that epoch leaves as it is."""
    L.seed_everything(seed, verbose=False)
    module = InterchangeModule(
        lm=lm,
        layer=layer,
        region=data.region,
        intervention=method.build,
        objective=method.build_objective(),
        lr=method.lr,
        warmup_ratio=method.warmup_ratio,
        dtype=dtype,
        component=ATTENTION_HEAD,
        head=head,
    )
    module.to("cuda" if torch.cuda.is_available() else "cpu")  # where the LM is
    if unchanged_at(module, data):
        return module.intervention  # f(b) = f(s) at every train pair: a zero gradient, nothing moves
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=1,
    )
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


def saved_at_head(path: Path, region: str, method: MethodSpec, train) -> torch.nn.Module:
    """`method`'s trained intervention at `region` kept in `path` ({region: its exported
    tensors}, `trained_path`), trained by `train()` and added to the file (written whole) where
    it lacks it; returned as the fixed intervention it acts as."""
    regions, config = read_trained(path)
    if region not in regions:
        trained = train()
        regions[region], config = trained.export(), trained.config()
        write_trained(path, regions, config)
    return frozen_intervention(method, regions[region], config)


def _trained(out: Path, task: str, layer: int, head: int, region: str, data_of, setup, control: bool):
    """({name: intervention}, the same on the control task) of the trained methods at a site."""
    found = ({}, {})
    for method in setup.methods:
        if setup.kinds[method.name] != TRAINED:
            continue
        for kind, into in [(None, found[0]), *([(CONTROL, found[1])] if control else [])]:
            data = data_of(region, kind)
            if data is not None:
                path = trained_path(out, task, layer, kind, method.name, head)
                train = partial(train_at_head, method, setup.lm, layer, head, data, setup.seed, setup.dtype)
                into[method.name] = saved_at_head(path, region, method, train)
    return found


def _sweep_unit(store, task: str, layers, setup, heads: list[int], done: set, progress) -> float:
    """Every (layer, head, region) of a unit not in `done`, each trained, fitted, scored and
    stored in its own transaction, a (layer, head)'s finished methods with its last region; the
    task's Acc."""
    model = load_lm(setup.lm, setup.dtype).to("cuda" if torch.cuda.is_available() else "cpu")
    cache = ActivationCache(model, list(layers))  # Acc only: head sites run the full forward
    data_of = functools.cache(setup.tasks[task].data)
    accuracy = task_accuracy(data_of(None, None), setup.lm, cache, setup.dtype, setup.batch_size)
    control = task in setup.control
    for layer in layers:
        for head in heads:
            progress.note(f"{task}: layer {layer}, head {head}")
            for region in setup.tasks[task].regions:
                raise_pending()  # a signal a library swallowed stops the sweep between sites
                methods = [m for m in setup.methods if (task, m.name, layer, head, region) not in done]
                data = data_of(region)
                if methods and data is not None:
                    sub = dataclasses.replace(setup, methods=methods)
                    trained = _trained(store.out, task, layer, head, region, data_of, sub, control)
                    control_data = data_of(region, CONTROL) if control else None
                    rows = sweep_site(
                        task, layer, region, methods, setup.lm, data, control_data, cache, setup.seed,
                        setup.dtype, *trained, setup.batch_size, component=ATTENTION_HEAD, head=head,
                    )  # fmt: skip
                    store.add({"results": [{**row, "head": head} for row in rows]})
                progress.update()
            finished = [
                {"task": task, "layer": layer, "head": head, "method": m.name, "control": int(control)}
                for m in setup.methods
            ]
            store.add({"finished": finished})
    return accuracy


def _plan(units, names: list[str], heads: list[int], control: frozenset[str]):
    """plan(store): the units with work left, and the finished sites (a site run without the
    control, on a task of `control`, is redone with it)."""

    def plan(store) -> tuple[list, set]:
        done = {
            (r["task"], r["method"], int(r["layer"]), int(r["head"]), r["region"])
            for r in store.rows("results")
            if r["control_odds"] or r["task"] not in control
        }
        finished = {
            (r["task"], int(r["layer"]), int(r["head"]), r["method"])
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


def run_heads(ranks, out: Path, meta: dict, units, layers: list[int], heads: list[int], setup, accuracy_table):
    """Claim (or resume) `out`, sweep this process's units at every head of `heads`, merge, write
    summary.csv and the heatmaps: the summary rows."""
    names = [m.name for m in setup.methods]
    tables = [HEAD_RESULTS, accuracy_table, HEAD_FINISHED]
    with distributed.ShardedRun(ranks, out, meta, tables, ignore=("templates", "pairs")) as run:
        todo, done = run.start(_plan(units, names, heads, setup.control))
        total = sum(len(group) * len(heads) * len(setup.tasks[task].regions) for task, group in todo)
        with Progress(total, "sites", "site") as progress:
            for task, group in run.take(todo, cost=lambda unit: len(unit[1]) * len(setup.tasks[unit[0]].regions)):
                accuracy = _sweep_unit(run.store, task, group, setup, heads, done, progress)
                run.store.add({"accuracy": [{"task": task, "accuracy": accuracy}]})
        scored = {name: task.scored_regions for name, task in setup.tasks.items()}
        summary = run.finish(
            unit_position(units), partial(_summary, scored=scored, names=names, layers=layers, heads=heads, out=out)
        )
        if ranks.is_main:  # the figures last: one not written leaves the results as they are
            rows = _rows(run.main, list(scored), names, layers, heads)
            write_head_heatmaps(rows, scored, summary, out)
        return summary


def _rows(store, tasks, names, layers, heads) -> list[dict]:
    return [
        r
        for r in store.rows("results")
        if r["task"] in tasks and r["method"] in names and int(r["layer"]) in layers and int(r["head"]) in heads
    ]


def head_summary(results: list[dict], accuracy: dict[str, float], scored: dict[str, list[str]]) -> list[dict]:
    """One row per (task, method, head): the task's Acc, the overall odds at that head (CausalGym
    eq. 19 over the head's sites: the mean over layers of the best scored region's odds) and,
    where every site has the control, the selectivity (`causalgym_report.summary_rows`)."""
    by_head = defaultdict(list)
    for row in results:
        by_head[int(row["head"])].append(row)
    lines = [
        {**line, "head": head}
        for head, rows in sorted(by_head.items())
        for line in summary_rows(rows, accuracy, scored)
    ]
    order = {(r["task"], r["method"]): i for i, r in enumerate(results)}
    return sorted(lines, key=lambda line: (order[(line["task"], line["method"])], line["head"]))


def _summary(store, scored, names, layers, heads, out: Path) -> list[dict]:
    """DIR/summary.csv of the store's rows (`head_summary`), written whole; its rows."""
    accuracy = {r["task"]: float(r["accuracy"]) for r in store.rows("accuracy")}
    summary = head_summary(_rows(store, list(scored), names, layers, heads), accuracy, scored)
    summary = [{c: row[c] for c in HEAD_SUMMARY_COLUMNS if c in row} for row in summary]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=HEAD_SUMMARY_COLUMNS)
    writer.writeheader()
    writer.writerows(summary)
    write_atomically(Path(out) / "summary.csv", text.getvalue())
    return summary


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


def write_head_heatmaps(results: list[dict], scored: dict[str, list[str]], summary: list[dict], out: Path):
    """DIR/heatmaps/TASK_METHOD_heads.png: per task and method, the layer × head grid of the best
    scored region's odds (`best_region_grid`); every one tried, the first not written raised."""
    grouped = defaultdict(list)
    for row in results:
        grouped[(row["task"], row["method"])].append(row)

    def figures():
        for task, method in dict.fromkeys((line["task"], line["method"]) for line in summary):
            matrix, layers, heads = best_region_grid(grouped[(task, method)], scored[task])
            title = f"{task} · {method} · best region's odds per head"
            fig = heatmap_figure(matrix, layers, heads, title, xlabel="attention head")[0]
            yield fig, Path(out) / "heatmaps" / f"{task}_{method}_heads.png"

    return save_figures(figures(), dpi=DPI)
