"""The CausalGym study in one command: every method at every layer × region of every task.

    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml [--tasks all] [--out DIR]
    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --pairs pairs.jsonl
    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --component value [--heads "[0,1]"]

The tasks are a template file's (default: CausalGym's 29) or, with `--pairs`, one counterfactual
pairs file's (its stem the task's name, its regions `site` and `last`; `causalgym_tasks`): each a
name, its regions, the regions its overall odds count, and a data factory the sweep asks for a
region's data module. `--positions official` reads a template task's source at the base's token
index, as CausalGym's code does (`CausalGymDataModule`; default `own`: each side at the last token
of its own region); meta.json records it, so a resumed run at the other setting is refused.

The methods are entries of the one registry (`lit_interventions.interventions.registry`): a
registered name (`--methods "[das,probe]"`; `all`: CausalGym's das, probe, diffmean, lda, pca,
kmeans, random, lat and vanilla; `dbm` and the other studies' names are registered too) or, in
the YAML, {name: NAME, model: <train.py's model section>}: of an InterchangeModule section its
intervention (or DAS of its k), lr, warmup_ratio and objective; any other class_path is the method
itself (a closed-form direction estimator). The sweep sets the LM, layer, region and dtype of every
site itself, whatever the section holds. Each is run by what it can do (`causalgym_scoring`):
trained, fitted in closed form, or fixed.

Per task, the frozen LM's residual stream at every swept layer is computed once for all train
and eval sentences (full batches, `ActivationCache.fill`). Each trained method (DAS, DBM, ...)
is trained at every layer and region of the task together, in one loop per method (Lightning,
the paper's setup per site, `MultiSiteInterchangeModule`: one stacked forward per step, each row
entering at its own layer; `causalgym_training`); each site (layer, region) then fits the
closed-form methods on the base train states, and every method at every site of the unit is
scored with the same 1-D interchange and the same odds metric as `train.py`
(`InterchangeModule.score`) in stacked no-grad forwards (`score_stacked`: each row enters at its
site's layer, runs only the blocks above it, and many sites and methods share each forward;
`--stacked_scoring false`: site by site).

Writes, resumably (a rerun skips finished sites and reuses trained interventions; an interruption
loses at most one unit's scoring (one site's, site by site) or one unit's training loop):
- DIR/results.csv: task, method, layer, region, odds, iia [, control_odds, control_iia];
- DIR/summary.csv: task, method, accuracy, overall_odds (CausalGym eq. 19), selectivity;
- DIR/heatmaps/TASK_METHOD.png: layer × region AvgOdds;
- DIR/METHOD/TASK_LAYER.safetensors: a trained method's interventions (DAS: {region: W (k × d)}).
Finished sites are kept in DIR/results.sqlite (one transaction per unit, or per site) and results.csv exported
from it, whole, after each (`lit_interventions.artifacts.results`); one run at a time holds DIR/.lock. So are
each task's Acc and the finished units (a rerun skips them whole). Every file is written whole (a temporary
file renamed over it), the results before the figures: a figure that cannot be written (a full disk) is one
`error:` line naming it and exit status 1, the results kept. SIGTERM / SIGINT: exit status 143 / 130, the
finished units kept (`lit_interventions.core.signals`).

`--component C` sweeps another component of `core.blocks.COMPONENTS` instead, site by site
(`run_components`): a head component (attention_head, query, key, value; key and value count the
key/value heads of grouped-query attention) at every layer × head × region (`--heads`: a list;
default every head), any other (block_input, attention_output, mlp_output, mlp_neuron) at every
layer × region. A site is (layer, head, region), its head None for a component without heads, at
the last token of the region (`sites.Site`). Each site runs on its own through the path `train.py`
runs (`InterchangeModule(component=..., head=h)`, the full forward, no activation cache): a trained
method is trained there by a Lightning loop of one epoch seeded as `train.py fit` seeds it
(`causalgym_training.train_at_site`); the closed-form methods are fitted and every method scored as
above, site by site (`sweep_site`). It writes, resumably (one transaction per site):
- DIR/results.csv with a `head` column (empty for a component without heads);
- DIR/summary.csv: task, method, head, accuracy, overall_odds (CausalGym eq. 19 at that head: the
  mean over layers of the best scored region's odds), selectivity; without heads, one row per
  (task, method) and no head column, as the block-output sweep writes it;
- DIR/heatmaps/TASK_METHOD_heads.png: layer × head, each cell the best scored region's odds;
  without heads, DIR/heatmaps/TASK_METHOD.png: layer × region;
- DIR/METHOD/TASK_LAYER[_hHEAD][_control].safetensors: a trained method's interventions ({region: W}).

The units of work are (task, layers) (`sweep_units`; `--layers_per_unit` splits a task's layers).
Under torchrun or srun each process, whenever it is free, takes the next unit with work left (the
ones with most sites first) and writes DIR/ranks/rank-R/; rank 0 merges them into the files
above, as one process would have written them, and a rerun at any world size resumes what any
rank finished (`lit_interventions.studies.distributed`):

    torchrun --standalone --nproc_per_node 4 -m lit_interventions sweep causalgym --config configs/sweep_causalgym.yaml

The file reads in that order: plan (methods, heads, units), the run at the block output, the run
at another component, the report, then `run_sweep` and `main`. What it runs on, the trained
methods' loop and the scoring are `causalgym_tasks`, `causalgym_training` and `causalgym_scoring`.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from lit_interventions.artifacts.plots import DPI, heatmap_figure, report_figures, save_figures
from lit_interventions.artifacts.results import Table, check_recorded
from lit_interventions.cli.studies import choose_layers, choose_names, run_cli
from lit_interventions.core.blocks import BLOCK_OUTPUT, COMPONENTS, HEAD_COMPONENTS, KEY, VALUE, head_counts
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.files import write_atomically
from lit_interventions.core.lm import DEFAULT_LM, DTYPES, hidden_size, load_config, load_lm, num_layers
from lit_interventions.core.parts import site_tap
from lit_interventions.core.progress import Progress, line_seconds
from lit_interventions.core.signals import raise_pending
from lit_interventions.datamodules.causalgym import OWN
from lit_interventions.interventions.registry import (
    TRAINED,
    MethodSpec,
    check_site_method,
    method_entry,
    method_spec,
    registered_methods,
)
from lit_interventions.modules.multisite import grid_objective
from lit_interventions.objectives import build_objective
from lit_interventions.studies import distributed
from lit_interventions.studies.causalgym_scoring import (
    CONTROL,
    StackedScoringFailed,
    method_kinds,
    score_unit,
    sweep_site,
    task_accuracy,
)
from lit_interventions.studies.causalgym_tasks import SweepTask, controlled_tasks, sweep_tasks
from lit_interventions.studies.causalgym_training import (
    saved_at_site,
    saved_trained,
    train_at_site,
    trained_path,
)

METHODS = ["das", "probe", "diffmean", "lda", "pca", "kmeans", "random", "lat", "vanilla"]  # `all`: CausalGym's
RESULT_COLUMNS = ["task", "method", "layer", "region", "odds", "iia", "control_odds", "control_iia"]
RESULTS = Table(
    "results",
    tuple(RESULT_COLUMNS),
    key=("task", "method", "layer", "region"),
    numeric=("layer", "odds", "iia", "control_odds", "control_iia"),
    optional=("control_odds", "control_iia"),
)
ACCURACY = Table(
    "accuracy", ("task", "accuracy"), key=("task",), numeric=("accuracy",), export=False
)  # summary.csv shows it
# a method is finished at a layer of a task once its unit ran (with the control task: control 1),
# empty regions included: a rerun skips the unit
FINISHED = Table(
    "finished",
    ("task", "layer", "method", "control"),
    key=("task", "layer", "method"),
    numeric=("layer", "control"),
    export=False,
)
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
SUMMARY_COLUMNS = ["task", "method", "accuracy", "overall_odds", "selectivity"]
HEAD_SUMMARY_COLUMNS = ["task", "method", "head", *SUMMARY_COLUMNS[2:]]


# --- plan: the methods, the heads, the units of work ----------------------------------------------
def choose_methods(methods: str | dict | list[str | dict]) -> list[MethodSpec]:
    """The methods asked for: a list of entries, each a registered name (`registry.registered_methods`)
    or {name: NAME, model: <train.py's model section>} (`registry.method_entry`: of an
    InterchangeModule section its intervention, lr, warmup_ratio and objective; the sweep sets the
    LM, layer, region and dtype), or 'all' (`METHODS`). Each name once. The option is typed
    `list[str | dict]`, not a TypedDict of {name, model}: jsonargparse would refuse another
    mapping with a message of its own (a YAML) or read it as a name (the command line), where
    `method_entry` names the entry and shows the form."""
    if methods == "all" or methods == ["all"]:
        return [method_spec(name) for name in METHODS]
    items = [methods] if isinstance(methods, (str, dict, MethodSpec)) else list(methods)
    choose_names([m for m in items if isinstance(m, str)], registered_methods(), "methods")
    specs = [method_entry(m) for m in items]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"methods {names} name a method twice: give each name once")
    for spec in specs:  # each method and its objective are checked here, before any work
        check_site_method(spec, "CausalGym sweep")
        objective = grid_objective(build_objective(spec))
        if objective.uses_iso:
            raise ValueError(
                f"method {spec.name!r}: objective {objective!r} trains on Iso pairs, which the sweep's "
                "counterfactual pairs do not hold; train it with `train.py fit --data.multitask true`"
            )
    return specs


@dataclass(frozen=True)
class Setup:
    """What every unit of a sweep shares."""

    methods: list[MethodSpec]
    kinds: dict[str, str]  # name -> registry.FITTED, TRAINED or FIXED
    tasks: dict[str, SweepTask]  # name -> its regions and its data factory (`causalgym_tasks`)
    lm: str
    control: frozenset[str]  # the tasks the control task runs on
    seed: int
    dtype: str
    batch_size: int
    stacked_scoring: bool = True


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


RECORDED = {"component": BLOCK_OUTPUT, "positions": OWN}  # in meta.json only where a sweep's differs from these


def sweep_units(
    tasks: list[str], layers: list[int], layers_per_unit: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep's units of work, (task, layers): per task, its layers in groups of
    `layers_per_unit` (None: all of them; one activation cache and one training loop per trained
    method per unit). Smaller groups spread a few tasks over many ranks."""
    if layers_per_unit is None:
        layers_per_unit = max(len(layers), 1)
    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int) or layers_per_unit < 1:
        raise ValueError(
            f"layers_per_unit={layers_per_unit!r} must be a positive integer (or None: all layers in one unit)"
        )
    groups = [tuple(layers[i : i + layers_per_unit]) for i in range(0, len(layers), layers_per_unit)]
    return [(task, group) for task in tasks for group in groups]


def unit_position(units: list[tuple[str, tuple[int, ...]]]):
    """A row's unit's place in `units` (-1: none of them), to merge the ranks' rows in that order."""
    index = {(task, layer): i for i, (task, group) in enumerate(units) for layer in group}
    first = {}
    for i, (task, _) in enumerate(units):
        first.setdefault(task, i)

    def position(table: str, row: dict) -> int:
        if table == "accuracy":
            return first.get(row["task"], -1)
        return index.get((row["task"], int(row["layer"])), -1)

    return position


def _plan(units, names: list[str], control: frozenset[str]):
    """plan(store): the units with work left; the finished sites, and the layers finished with
    the control (on the tasks of `control`)."""

    def plan(store) -> tuple[list, tuple[set, set]]:
        done = {
            (r["task"], r["method"], int(r["layer"]), r["region"])
            for r in store.rows("results")
            if r["control_odds"] or r["task"] not in control
        }  # a site run without the control is redone with it
        finished_rows = store.rows("finished")
        with_control = {(r["task"], int(r["layer"]), r["method"]) for r in finished_rows if r["control"] == "1"}
        finished = with_control | {
            (r["task"], int(r["layer"]), r["method"]) for r in finished_rows if r["task"] not in control
        }
        measured = {r["task"] for r in store.rows("accuracy")}
        todo = [
            (task, group)
            for task, group in units
            if task not in measured or any((task, layer, m) not in finished for layer in group for m in names)
        ]
        return todo, (done, with_control)

    return plan


# --- run at the block output: a unit's trained methods in one loop each, its sites scored together
def _train_unit(out: Path, task: str, todo: dict, data_of, cache, setup: Setup, shown: Progress) -> tuple[dict, dict]:
    """Each trained method at the sites of `todo` that still need it, every layer's in one loop
    (`saved_trained`), on the task and with the control on the control task: ({name: {site:
    intervention}}, the same on the control task). `shown`: the sweep's progress, told which."""
    trained, control_trained = {}, {}
    for method in setup.methods:
        sites = [site for site, methods in todo.items() if method in methods]
        if setup.kinds[method.name] != TRAINED or not sites:
            continue
        progress = out / method.name / "progress"  # the loop's state while it runs (`train_das`)
        for found, kind, name in [(trained, None, task), (control_trained, CONTROL, f"{task}_{CONTROL}")]:
            if kind is None or task in setup.control:
                shown.note(f"{name}: {method.name}")
                found[method.name] = saved_trained(
                    partial(trained_path, out, task, control=kind, method=method.name),
                    {site: data_of(site[1], kind) for site in sites},
                    setup.lm,
                    cache,
                    setup.seed,
                    setup.dtype,
                    progress / name,
                    setup.batch_size,
                    method,
                )
    return trained, control_trained


def _score_sites(store, task, todo, data_of, cache, setup: Setup, trained: tuple[dict, dict], progress) -> None:
    """The sites of `todo` scored and stored: together (`score_unit`, one transaction), or, with
    `stacked_scoring` false or where the stacked forwards fail, site by site (`sweep_site`)."""
    s = setup
    if s.stacked_scoring:  # every site at once: stored together (an interruption loses the unit's scoring)
        try:
            control = task in s.control
            rows = score_unit(task, todo, s.lm, data_of, cache, s.seed, s.dtype, *trained, s.batch_size, control)
        except StackedScoringFailed as error:  # only the stacked forwards: a failed fit is raised as it is
            warnings.warn(
                f"the stacked scoring failed on {s.lm} ({error}); each site is scored in its own "
                "forwards instead (same results, slower; --stacked_scoring false skips the attempt)",
                stacklevel=3,
            )
        else:
            store.add({"results": rows})
            progress.update(len(todo))
            return
    for (layer, region), methods in todo.items():
        if methods:
            at = [{n: f[(layer, region)] for n, f in t.items() if (layer, region) in f} for t in trained]
            control_data = data_of(region, CONTROL) if task in s.control else None
            rows = sweep_site(
                task,
                layer,
                region,
                methods,
                s.lm,
                data_of(region),
                control_data,
                cache,
                s.seed,
                s.dtype,
                *at,
                s.batch_size,
            )
            store.add({"results": rows})
        progress.update()


def _sweep(store, units, setup: Setup, done, accuracy) -> None:
    """The sites of `units` ([(task, layers)], `sweep_units`) not in `done`: each unit's trained
    methods trained (`_train_unit`), then its sites scored and stored (`_score_sites`); fills
    `accuracy` ({task: Acc})."""
    model = load_lm(setup.lm, setup.dtype).to("cuda" if torch.cuda.is_available() else "cpu")  # modules follow it
    total = sum(len(setup.tasks[task].regions) * len(layers) for task, layers in units)
    with Progress(total, "sites", "site") as progress:  # closed on its own line, however it ends
        for task, layers in units:
            cache = ActivationCache(model, layers)  # one cache per unit: every layer, computed once for its sentences
            # a region's data module (kind: None, or the control task), tokenised once per unit
            data_of = functools.cache(setup.tasks[task].data)
            accuracy[task] = task_accuracy(data_of(None, None), setup.lm, cache, setup.dtype, setup.batch_size)
            todo = {
                (layer, region): [m for m in setup.methods if (task, m.name, layer, region) not in done]
                for layer in layers
                for region in setup.tasks[task].regions
            }
            trained = _train_unit(store.out, task, todo, data_of, cache, setup, progress)
            progress.note(f"{task}: scoring")
            _score_sites(store, task, todo, data_of, cache, setup, trained, progress)


def _claimed_run(ranks, out: Path, meta: dict, units, names: list[str], layers: list[int], setup: Setup) -> list[dict]:
    """Claim (or resume) `out`, run this process's units, merge, summarise and draw the heatmaps."""
    found = setup.tasks
    with distributed.ShardedRun(ranks, out, meta, [RESULTS, ACCURACY, FINISHED], ignore=("templates", "pairs")) as run:
        todo, (done, with_control) = run.start(
            _plan(units, names, setup.control), hint=" (--layers_per_unit splits a task's layers into more units)"
        )
        _run_units(run, todo, setup, done, with_control)
        scored = {name: task.scored_regions for name, task in found.items()}
        summary = run.finish(
            unit_position(units), partial(store_summary, scored=scored, names=names, layers=layers, out=out)
        )
        if ranks.is_main:  # the figures last: one not written leaves the results as they are
            regions = {name: task.regions for name, task in found.items()}
            write_heatmaps(store_rows(run.main, list(found), names, layers), regions, summary, out)
        return summary


def _run_units(run, todo, setup: Setup, done: set, with_control: set) -> None:
    """This rank's units of `todo` (the most sites first), each swept (`_sweep`), then its Acc and
    its finished (task, layer, method) stored together."""
    names = [m.name for m in setup.methods]
    for task, group in run.take(todo, cost=lambda unit: len(unit[1]) * len(setup.tasks[unit[0]].regions)):  # its sites
        accuracy, control = {}, task in setup.control
        raise_pending()  # a signal a library swallowed stops the sweep between units
        _sweep(run.store, [(task, group)], setup, done, accuracy)
        finished = [
            {"task": task, "layer": layer, "method": m, "control": int(control)}
            for layer in group
            for m in names
            if control or (task, layer, m) not in with_control
        ]
        run.store.add({"accuracy": [{"task": task, "accuracy": accuracy[task]}], "finished": finished})


# --- run at another component (`--component`): site by site ---------------------------------------
def _component_plan(units, names: list[str], heads: list, control: frozenset[str]):
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


def run_components(ranks, out: Path, meta: dict, units, layers: list[int], heads: list, setup, accuracy_table):
    """Claim (or resume) `out`, sweep this process's units at meta's component, at every head of
    `heads` ([None]: a component without heads), merge, write summary.csv and the heatmaps: the
    summary rows."""
    names, component = [m.name for m in setup.methods], meta["component"]
    check_found(setup.lm, setup.dtype, component, layers[0], heads[0])  # before the directory is claimed
    tables = [SITE_RESULTS, accuracy_table, SITE_FINISHED]
    with distributed.ShardedRun(ranks, out, meta, tables, ignore=("templates", "pairs")) as run:
        todo, done = run.start(_component_plan(units, names, heads, setup.control))
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


# --- report: summary.csv (CausalGym eq. 19), the heatmaps -----------------------------------------
def overall(cells: dict[tuple[int, str], float], regions=None) -> float:
    """CausalGym eq. 19: the mean over layers of the best region's AvgOdds, the regions limited
    to `regions` if given (the task's `scored_regions`: from the first label-variable region on)."""
    best = defaultdict(lambda: -math.inf)
    for (layer, region), value in cells.items():
        if regions is None or region in regions:
            best[layer] = max(best[layer], value)
    return float(np.mean(list(best.values()))) if best else math.nan


def summarise(
    results: list[dict],
    accuracy: dict[str, float],
    regions: dict[str, list[str]],
    out: Path,
    scored: dict[str, list[str]] | None = None,
) -> list[dict]:
    """summary.csv (`write_summary`), then one heatmap per task and method (`write_heatmaps`):
    the summary rows. `scored` ({task: regions}, default: all of them) limits the overall odds and
    the selectivity to the regions from the first label-variable region on, as the paper's code
    does; the heatmaps show every region."""
    summary = write_summary(results, accuracy, out, scored)
    write_heatmaps(results, regions, summary, out)
    return summary


def store_rows(store, tasks: list[str], names: list[str], layers: list[int]) -> list[dict]:
    """The results rows of a sweep's store (`artifacts.results.ResultsStore`) of these tasks,
    methods and layers."""
    return [
        r for r in store.rows("results") if r["task"] in tasks and r["method"] in names and int(r["layer"]) in layers
    ]


def store_summary(store, scored: dict[str, list[str]], names, layers, out: Path) -> list[dict]:
    """summary.csv of a sweep's store rows of these tasks (`scored`: {task: its scored regions}),
    methods and layers (`write_summary`), the overall odds over each task's scored regions."""
    accuracy = {r["task"]: float(r["accuracy"]) for r in store.rows("accuracy")}
    return write_summary(store_rows(store, list(scored), names, layers), accuracy, out, scored)


def _cells(results: list[dict]) -> dict[tuple[str, str], dict[tuple[int, str], dict]]:
    """{(task, method): {(layer, region): row}}, in the rows' order."""
    grouped = defaultdict(dict)
    for row in results:
        grouped[(row["task"], row["method"])][(int(row["layer"]), row["region"])] = row
    return grouped


def summary_rows(
    results: list[dict], accuracy: dict[str, float], scored: dict[str, list[str]] | None = None
) -> list[dict]:
    """One row per (task, method): its Acc, overall odds and, where every site has the control,
    selectivity (see `summarise`)."""
    summary = []
    for (task, method), cells in _cells(results).items():
        odds = {site: float(r["odds"]) for site, r in cells.items()}
        kept = None if scored is None else scored[task]
        line = {
            "task": task,
            "method": method,
            "accuracy": accuracy.get(task, math.nan),
            "overall_odds": overall(odds, kept),
        }
        if all(r.get("control_odds") not in (None, "") for r in cells.values()):
            line["selectivity"] = overall(
                {s: float(r["odds"]) - float(r["control_odds"]) for s, r in cells.items()}, kept
            )
        summary.append(line)
    return summary


def write_summary(
    results: list[dict], accuracy: dict[str, float], out: Path, scored: dict[str, list[str]] | None = None
) -> list[dict]:
    """DIR/summary.csv (`summary_rows`), written whole; its rows."""
    return write_summary_csv(summary_rows(results, accuracy, scored), out)


def write_summary_csv(summary: list[dict], out: Path, columns: list[str] = SUMMARY_COLUMNS) -> list[dict]:
    """DIR/summary.csv of `summary` with `columns`, written whole; `summary`."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(summary)
    write_atomically(Path(out) / "summary.csv", text.getvalue())
    return summary


def write_heatmaps(results: list[dict], regions: dict[str, list[str]], summary: list[dict], out: Path) -> list[Path]:
    """DIR/heatmaps/TASK_METHOD.png, the layer × region odds of each (task, method) of `summary`,
    its overall odds in the title; every one tried, the first not written raised
    (`plots.FigureNotWritten`)."""
    return save_figures(_heatmaps(_cells(results), regions, summary, Path(out)), dpi=DPI)


def _heatmaps(grouped, regions, summary, out: Path):
    for line in summary:
        task, method = line["task"], line["method"]
        cells = grouped[(task, method)]
        layers = sorted({layer for layer, _ in cells})
        names = [r for r in regions[task] if any((layer, r) in cells for layer in layers)]
        matrix = np.full((len(layers), len(names)), np.nan)
        for (layer, region), row in cells.items():
            matrix[layers.index(layer), names.index(region)] = float(row["odds"])
        title = f"{task} · {method} · overall odds {line['overall_odds']:.2f}"
        yield heatmap_figure(matrix, layers, names, title)[0], out / "heatmaps" / f"{task}_{method}.png"


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
    (`summary_rows`)."""
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


# --- the study: plan, run, report -----------------------------------------------------------------
def run_sweep(
    tasks: str | list[str] | None = None,
    methods: str | list[str | dict] = "all",
    layers: str | list[int] = "all",
    templates: str | None = None,
    pairs: str | None = None,
    lm: str = DEFAULT_LM,
    control: bool | list[str] = False,
    out: str = "runs/sweep",
    train_pairs: int = 200,
    eval_pairs: int = 50,
    seed: int = 0,
    dtype: str = "float32",
    batch_size: int = 64,
    layers_per_unit: int | None = None,
    stacked_scoring: bool = True,
    component: str = "block_output",
    heads: str | int | list[int] | None = None,
    positions: str = OWN,
) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows.

    Under torchrun or srun each process takes its share of the units (`sweep_units`), writes
    DIR/ranks/rank-R/, and rank 0 merges them into the files one process would have written
    (`lit_interventions.studies.distributed`).

    Args:
        tasks: task names of the template file, or 'all' (default: agr_sv_num_pp).
        methods: registered names (das, probe, diffmean, lda, pca, kmeans, random, lat, vanilla,
            dbm, ...) and {name: NAME, model: <train.py's model section>} entries
            (`choose_methods`), a list of both; or 'all' (CausalGym's nine: all but dbm).
        layers: layer indices (-1 = embeddings), or 'all'.
        templates: a template file in the CausalGym schema (default: our 29 tasks).
        pairs: a counterfactual pairs file instead (`datamodules/pairs.py`): one task, named
            for its stem, regions `site` and `last`, split by `seed` as `train.py` splits it (the
            sizes do not apply). Not with `tasks`, `templates` or `control`.
        lm: the LM (embedded name, .gguf, local directory or hub id).
        control: also run the dog/give control task (adds control_odds and selectivity): true on
            every task, or a list of the tasks to run it on.
        out: output directory.
        train_pairs, eval_pairs: a template task's pairs before swap-doubling (the paper: 200, 50).
        seed: data and method seed.
        dtype: the frozen LM's dtype (float32, bfloat16, float16); trained methods train in float32.
        batch_size: rows per forward that only reads the frozen LM (the cache fill, the states
            closed-form methods are fitted on, scoring); trained methods train at the paper's
            batch of 4 whatever it is. Raise it to fill a GPU.
        layers_per_unit: layers per unit of work (default: all of a task's layers in one);
            smaller spreads a few tasks over many processes.
        stacked_scoring: score all sites × methods of a unit together, in stacked forwards of
            `batch_size` rows (`score_unit`); false: site by site (`sweep_site`). Same results
            to float rounding.
        component: the sites swept (`core.blocks.COMPONENTS`): block_output (the residual stream)
            or, site by site (`run_components`), any other: attention_head, query, key and
            value per head.
        heads: a head component's heads, a list (default or 'all': every one it has).
        positions: `own` or `official`, where a template task's source is read (`CausalGymDataModule`)."""
    ranks = distributed.detect()
    distributed.pin_device(ranks)  # before anything starts CUDA
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    sizes = {"train_pairs": train_pairs, "eval_pairs": eval_pairs, "seed": seed}
    # every input is checked before the output directory is claimed: a refused run leaves nothing
    specs = choose_methods(methods)
    found, data_meta = sweep_tasks(tasks, templates, pairs, control, lm, sizes, positions)
    config = load_config(lm)
    layers = choose_layers(layers, num_layers(config))
    heads = choose_heads(component, heads, config, layers)
    check_recorded(Path(out), {"component": component, "positions": positions}, RECORDED, "a sweep")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    units = sweep_units(list(found), layers, layers_per_unit)
    kinds = method_kinds(specs, hidden_size(config), seed)  # every class_path imported before any work
    setup = Setup(
        specs, kinds, found, lm, controlled_tasks(control, list(found)), seed, dtype, batch_size, stacked_scoring
    )
    meta = {"lm": lm, "dtype": dtype, **data_meta}  # a data file is known by its sha256, not its path
    if heads is not None:  # a component sweep's directory holds that component's sites only
        return run_components(ranks, Path(out), meta | {"component": component}, units, layers, heads, setup, ACCURACY)
    return _claimed_run(ranks, Path(out), meta, units, [spec.name for spec in specs], layers, setup)


def main(args=None) -> None:
    """`lit-interventions sweep causalgym`."""
    with report_figures():
        run_cli(distributed.printed_by_rank_zero(run_sweep), __doc__, args)
