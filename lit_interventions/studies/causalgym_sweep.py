"""The CausalGym study in one command: every method at every layer × region of every task.

    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml [--tasks all] [--out DIR]
    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml --pairs pairs.jsonl

The tasks are a template file's (default: CausalGym's 29) or, with `--pairs`, one counterfactual
pairs file's (its stem the task's name, its regions `site` and `last`; `causalgym_tasks`): each a
name, its regions, the regions its overall odds count, and a data factory the sweep asks for a
region's data module.

The methods are `class_path` configs ({name, class_path, init_args}, and for a trained one lr,
warmup_ratio, objective; `lit_interventions.interventions.registry.MethodSpec`), listed in the
YAML or named by their registered short names (`--methods "[das,probe]"`; `all`: CausalGym's
das, probe, diffmean, lda, pca, kmeans, random, lat and vanilla; `dbm` is registered too). Each
is run by what it can do (`causalgym_scoring`): trained, fitted in closed form, or fixed.

Per task, the frozen LM's residual stream at every swept layer is computed once for all train
and eval sentences (full batches, `ActivationCache.fill`). Each trained method (DAS, DBM, ...)
is trained at every layer and region of the task together, in one loop per method (Lightning,
the paper's setup per site, `MultiSiteInterchangeModule`: one stacked forward per step, each row
entering at its own layer; `causalgym_training`); each site (layer, region) then fits the
closed-form methods on the base train states, and every method at every site of the unit is
scored with the same 1-D interchange and the same odds metric as `train.py`
(`InterchangeModule.score`) in stacked no-grad forwards (`stacked_scoring`: each row enters at its
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
(`causalgym_components`): a head component (attention_head, query, key, value) at every layer ×
head × region (`--heads`: a list; default every head), any other (block_input,
attention_output, mlp_output, mlp_neuron) at every layer × region; results.csv has a `head`
column, empty without heads.

The units of work are (task, layers) (`sweep_units`; `--layers_per_unit` splits a task's layers).
Under torchrun or srun each process, whenever it is free, takes the next unit with work left (the
ones with most sites first) and writes DIR/ranks/rank-R/; rank 0 merges them into the files
above, as one process would have written them, and a rerun at any world size resumes what any
rank finished (`lit_interventions.studies.distributed`):

    torchrun --standalone --nproc_per_node 4 -m lit_interventions sweep causalgym --config configs/sweep_causalgym.yaml
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from lit_interventions.artifacts.plots import report_figures
from lit_interventions.artifacts.results import Table
from lit_interventions.cli.studies import choose_layers, choose_names, run_cli
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.lm import DEFAULT_LM, DTYPES, hidden_size, load_config, load_lm, num_layers
from lit_interventions.core.progress import Progress, line_seconds
from lit_interventions.core.signals import raise_pending
from lit_interventions.interventions.registry import TRAINED, MethodSpec, method_spec, registered_methods
from lit_interventions.modules.multisite import grid_objective
from lit_interventions.objectives import build_objective
from lit_interventions.studies import distributed
from lit_interventions.studies.causalgym_components import check_component, choose_heads, run_components
from lit_interventions.studies.causalgym_report import overall, store_rows, store_summary, summarise, write_heatmaps
from lit_interventions.studies.causalgym_scoring import (
    CONTROL,
    StackedScoringFailed,
    _region_data,
    method_kinds,
    score_unit,
    sweep_site,
    task_accuracy,
)
from lit_interventions.studies.causalgym_tasks import SweepTask, controlled_tasks, sweep_tasks
from lit_interventions.studies.causalgym_training import saved_trained, train_das, trained_path, unchanged_sites
from lit_interventions.studies.causalgym_units import sweep_units, unit_position

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
__all__ = ["METHODS", "run_sweep", "main", "overall", "summarise", "train_das", "unchanged_sites", "_region_data"]


def choose_methods(methods: str | dict | list[str | dict]) -> list[MethodSpec]:
    """The methods asked for: registered short names (`registry.registered_methods`), method
    configs ({name, class_path, init_args, ...}, `MethodSpec.from_config`), a list of both, or
    'all' (`METHODS`). Each name once."""
    if methods == "all" or methods == ["all"]:
        return [method_spec(name) for name in METHODS]
    items = [methods] if isinstance(methods, (str, dict, MethodSpec)) else list(methods)
    choose_names([m for m in items if isinstance(m, str)], registered_methods(), "methods")
    specs = [
        method_spec(m) if isinstance(m, str) else m if isinstance(m, MethodSpec) else MethodSpec.from_config(m)
        for m in items
    ]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"methods {names} name a method twice: give each name once")
    for spec in specs:  # each objective is checked here, before any work
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
) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows.

    Under torchrun or srun each process takes its share of the units (`sweep_units`), writes
    DIR/ranks/rank-R/, and rank 0 merges them into the files one process would have written
    (`lit_interventions.studies.distributed`).

    Args:
        tasks: task names of the template file, or 'all' (default: agr_sv_num_pp).
        methods: registered names (das, probe, diffmean, lda, pca, kmeans, random, lat, vanilla,
            dbm), method configs ({name, class_path, init_args[, lr, warmup_ratio, objective]}),
            a list of both; or 'all' (CausalGym's: all of these but dbm).
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
            or, site by site (`causalgym_components`), any other: attention_head, query, key and
            value per head.
        heads: a head component's heads, a list (default or 'all': every one it has)."""
    ranks = distributed.detect()
    distributed.pin_device(ranks)  # before anything starts CUDA
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    sizes = {"train_pairs": train_pairs, "eval_pairs": eval_pairs, "seed": seed}
    # every input is checked before the output directory is claimed: a refused run leaves nothing
    found, data_meta = sweep_tasks(tasks, templates, pairs, control, lm, sizes)
    specs = choose_methods(methods)
    names = [spec.name for spec in specs]
    config = load_config(lm)
    layers = choose_layers(layers, num_layers(config))
    heads = choose_heads(component, heads, config, layers)
    check_component(Path(out), component)
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
    return _claimed_run(ranks, Path(out), meta, units, names, layers, setup)


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


def main(args=None) -> None:
    """`lit-interventions sweep causalgym`."""
    with report_figures():
        run_cli(distributed.printed_by_rank_zero(run_sweep), __doc__, args)
