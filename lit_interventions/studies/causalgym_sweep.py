"""The CausalGym study in one command: every method at every layer × region of every task.

    lit-interventions sweep causalgym --config configs/sweep_causalgym.yaml [--tasks all] [--out DIR]

Per task, the frozen LM's residual stream at every swept layer is computed once for all train
and eval sentences (full batches, `ActivationCache.fill`). DAS is trained at every layer and
region of the task together, in one loop (Lightning, the paper's setup per site,
`MultiSiteInterchangeModule`: one stacked forward per step, each row entering at its own
layer); each site (layer, region) then fits the closed-form directions on the base train
states, and every method at every site of the unit is scored with the same 1-D interchange and
the same odds metric as `train.py` (`InterchangeModule.score`) in stacked no-grad forwards
(`stacked_scoring`: each row enters at its site's layer, runs only the blocks above it, and many
sites and methods share each forward; `--stacked_scoring false`: site by site).

Writes, resumably (a rerun skips finished sites and reuses trained DAS subspaces; an interruption
loses at most one unit's scoring (one site's, site by site) or one unit's DAS training loop):
- DIR/results.csv: task, method, layer, region, odds, iia [, control_odds, control_iia];
- DIR/summary.csv: task, method, accuracy, overall_odds (CausalGym eq. 19), selectivity;
- DIR/heatmaps/TASK_METHOD.png: layer × region AvgOdds;
- DIR/das/TASK_LAYER.safetensors: the trained DAS subspaces, {region: W (k × d)}.
Finished sites are kept in DIR/results.sqlite (one transaction per unit, or per site) and results.csv exported
from it, whole, after each (`lit_interventions.artifacts.results`); one run at a time holds DIR/.lock. So are
each task's Acc and the finished units (a rerun skips them whole).

The units of work are (task, layers) (`sweep_units`; `--layers_per_unit` splits a task's layers).
Under torchrun or srun each process, whenever it is free, takes the next unit with work left (the
ones with most sites first) and writes DIR/ranks/rank-R/; rank 0 merges them into the files
above, as one process would have written them, and a rerun at any world size resumes what any
rank finished (`lit_interventions.studies.distributed`):

    torchrun --standalone --nproc_per_node 4 -m lit_interventions sweep causalgym --config configs/sweep_causalgym.yaml
"""

from __future__ import annotations

import csv
import functools
import hashlib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from itertools import chain
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lit_interventions.artifacts.plots import odds_heatmap
from lit_interventions.artifacts.results import Table
from lit_interventions.callbacks.resume import SaveProgress
from lit_interventions.cli.studies import choose_layers, choose_names, run_cli
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.lm import DEFAULT_LM, DTYPES, load_config, load_lm, num_layers
from lit_interventions.datamodules.causalgym import CausalGymDataModule, EmptyRegionError
from lit_interventions.datamodules.templates import BUILTIN_TEMPLATES, load_task, load_templates
from lit_interventions.interventions import FixedSubspaceIntervention
from lit_interventions.interventions.directions import METHODS as DIRECTION_METHODS
from lit_interventions.interventions.directions import fit_direction
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.modules.multisite import MultiSiteInterchangeModule
from lit_interventions.studies import distributed
from lit_interventions.studies.stacked_scoring import score_stacked

METHODS = ["das", *DIRECTION_METHODS, "vanilla"]
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


def _region_data(task, templates, lm, region, control, sizes) -> CausalGymDataModule | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pairs where this region is empty are expected: skipped quietly
        data = CausalGymDataModule(task=task, templates=templates, lm=lm, region=region, control=control, **sizes)
        try:
            data.setup("fit")
        except EmptyRegionError:
            return None  # the region is empty in every pair: no site (any other error is the user's to see)
    return data


def train_das(
    datas: dict,
    lm,
    cache,
    seed,
    dtype="float32",
    one_loop: bool = True,
    progress: Path | None = None,
    every: timedelta = timedelta(minutes=5),
    batch_size: int = 64,
) -> dict:
    """DAS at every site of `datas` ({(layer, region): data module, or None for an empty
    region}), the paper's setup: {(layer, region): trained subspace}. All sites train together in
    one Lightning loop (`MultiSiteInterchangeModule`: one stacked forward per step for every
    layer and region); each site gets the result it would get alone, for a fraction of the time.
    `progress`: a loop's state is saved every `every` to PROGRESS-<digest of its sites and
    setup>.ckpt, which a rerun resumes from (same result as no interruption) and which is
    deleted once the loop ends. `one_loop=False`: one loop per layer (the earlier sweep, kept
    for benchmarks/sweep_speed.py). A site where every train pair's base and source states are
    equal (`unchanged_sites`, reading `batch_size` rows at a time) keeps its initial subspace:
    there is nothing to train."""
    datas = {site: data for site, data in datas.items() if data is not None}
    unchanged = unchanged_sites(datas, cache, batch_size)  # nothing to learn there: their initial subspaces, untrained
    trained = (
        MultiSiteInterchangeModule(lm=lm, sites=sorted(unchanged), dtype=dtype, seed=seed).trained()
        if unchanged
        else {}
    )
    datas = {site: data for site, data in datas.items() if site not in unchanged}
    groups = (
        [datas]
        if one_loop
        else [
            {site: data for site, data in datas.items() if site[0] == layer}
            for layer in sorted({layer for layer, _ in datas})
        ]
    )
    for group in groups:
        if not group:
            continue
        module = MultiSiteInterchangeModule(lm=lm, sites=list(group), dtype=dtype, seed=seed)
        module.attach(group).share_cache(cache)
        saved = None if progress is None else progress_path(progress, module)
        trainer = L.Trainer(
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[] if saved is None else [SaveProgress(saved, every)],
            accelerator="cpu" if not torch.cuda.is_available() else "auto",
            devices=1,
        )
        trainer.fit(module, ckpt_path=saved if saved is not None and saved.is_file() else None, weights_only=True)
        trained |= module.trained()
        if saved is not None:
            saved.unlink(missing_ok=True)
    return trained


@torch.no_grad()
def unchanged_sites(datas: dict, cache: ActivationCache, batch_size: int = 64) -> set:
    """The sites of `datas` ({(layer, region): data module}) where every train pair's base and
    source have the same state, bit for bit: a site before the pairs' first difference, under
    causal attention. Every intervention leaves such a site as it is (f* = f(b) + Wᵀ(W f(s) − W f(b))
    = f(b)), so the loss does not depend on W there: DAS has nothing to learn."""
    device = next(cache.model.parameters()).device
    found = set()
    for (layer, region), data in datas.items():
        batches = (move_data_to_device(batch, device) for batch in data.loader("train", batch_size))
        if all(
            torch.equal(cache.at_site(layer, batch, "base"), cache.at_site(layer, batch, "source")) for batch in batches
        ):
            found.add((layer, region))
    return found


def progress_path(progress: Path, module: MultiSiteInterchangeModule) -> Path:
    """Where `train_das` keeps the loop's progress: PROGRESS-<digest>.ckpt, the digest of what
    the loop's result depends on (its sites, LM, dtype, seed, each site's number of batches), so
    a changed setup never resumes another's loop."""
    batches = [len(loader) for loader in module._frozen["loaders"].values()]
    setup = repr((module.sites, module.hparams.lm, module.hparams.dtype, module.hparams.seed, batches))
    return progress.with_name(f"{progress.name}-{hashlib.sha256(setup.encode()).hexdigest()[:12]}.ckpt")


def das_path(out: Path, task: str, layer: int, control: str | None = None) -> Path:
    """Where the DAS subspaces of a task's layer are kept: DIR/das/TASK_LAYER[_control].safetensors."""
    return out / "das" / f"{task}_{layer}{'' if control is None else '_' + control}.safetensors"


def saved_das(
    paths: Callable[[int], Path],
    datas: dict,
    lm,
    cache,
    seed,
    dtype="float32",
    progress: Path | None = None,
    batch_size: int = 64,
) -> dict:
    """`train_das`, kept in one file per layer (`paths(layer)`, `das_path`: {region: basis W,
    k × d}): a rerun scores the saved subspaces and trains, in one loop, only the sites the files
    lack, so an interruption after training loses no training; during it, with `progress`
    (`train_das`), at most its last few minutes."""
    saved = {
        layer: load_file(paths(layer)) if paths(layer).is_file() else {} for layer in {layer for layer, _ in datas}
    }
    missing = {(layer, region): data for (layer, region), data in datas.items() if region not in saved[layer]}
    if missing:
        trained = train_das(missing, lm, cache, seed, dtype, progress=progress, batch_size=batch_size)
        for layer in sorted({layer for layer, _ in trained}):
            saved[layer] |= {
                region: intervention.basis.detach().float().cpu().contiguous()
                for (at, region), intervention in trained.items()
                if at == layer
            }
            path = paths(layer)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(saved[layer], path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)  # never a half-written file
    return {
        (layer, region): FixedSubspaceIntervention(saved[layer][region])
        for layer, region in datas
        if region in saved[layer]
    }


def _intervention(method: str, types: list[str], X: torch.Tensor, seed: int, hidden: int, das=None):
    if method == "das":
        return das
    if method == "vanilla":
        return FixedSubspaceIntervention(torch.eye(hidden))  # f* = f(s)
    seeded = {"random_state": seed} if "random_state" in DIRECTION_METHODS[method]().get_params() else {}
    try:
        direction = fit_direction(method, X.float().cpu(), np.array(types), **seeded)
    except ValueError:
        # Degenerate site: every base has the same state here (a token before the alternation,
        # under causal attention), so f(b) = f(s) and any interchange is a no-op: odds 0.
        direction = torch.zeros(hidden)
    return FixedSubspaceIntervention(direction)


def fit_site(layer, region, methods, lm, data, cache, seed, dtype="float32", das=None, batch_size=64):
    """The site's module (`InterchangeModule` on the shared cache) and each method's intervention:
    the closed-form directions fitted on the base train states, `das` as trained, {method: f}."""
    module = InterchangeModule(lm=lm, layer=layer, region=region, dtype=dtype).to(cache.model.device)
    module.share_cache(cache)
    batches = [module.transfer_batch_to_device(batch, module.device, 0) for batch in data.loader("train", batch_size)]
    X = torch.cat([module.site_representation(batch, "base") for batch in batches])  # what directions are fitted on
    types = [e.base_type for e in data.splits["train"]]
    return module, {method: _intervention(method, types, X, seed, X.shape[-1], das) for method in methods}


def site_rows(task, layer, region, methods, scores, control_scores=None) -> list[dict]:
    """results.csv rows of one site: {method: {odds, iia}} and, with the control, its scores."""
    rows = [{"task": task, "method": m, "layer": layer, "region": region, **scores[m]} for m in methods]
    if control_scores is not None:
        for row in rows:
            row |= {
                "control_odds": control_scores[row["method"]]["odds"],
                "control_iia": control_scores[row["method"]]["iia"],
            }
    return rows


def sweep_site(
    task,
    layer,
    region,
    methods,
    lm,
    data,
    control_data,
    cache,
    seed,
    dtype="float32",
    das=None,
    control_das=None,
    batch_size=64,
) -> list[dict]:
    """Every method at one site; one row per method. `data` and `control_data` (None: no control)
    are the region's data modules; `das` and `control_das` the subspaces trained at this site on
    the task and on the control task (`train_das`); `batch_size` the rows of each forward that
    reads states or scores. (The sweep scores a unit's sites together, `score_unit`; this is
    the one-site path, kept for benchmarks and as its reference.)"""
    if data is None:
        return []
    module, found = fit_site(layer, region, methods, lm, data, cache, seed, dtype, das, batch_size)
    scores = module.score(list(data.loader("eval", batch_size)), found)
    control_scores = None
    if control_data is not None:
        if "das" in found:  # DAS is retrained on the control labels; the directions stay as fitted
            found["das"] = control_das
        control_scores = module.score(control_data.loader("eval", batch_size), found)
    return site_rows(task, layer, region, methods, scores, control_scores)


class StackedScoringFailed(RuntimeError):
    """The stacked forwards of `score_unit` failed (not the fitting before them)."""


def score_unit(
    task, todo, lm, data_of, cache, seed, dtype="float32", das=None, control_das=None, batch_size=64, control=False
) -> list[dict]:
    """Every method at every site of a unit, `todo` ({(layer, region): methods}): each site's
    directions are fitted first, then all sites × methods × eval rows are scored in stacked
    no-grad forwards of `batch_size` rows (`stacked_scoring.score_stacked`), the control task in
    the same call (DAS retrained on it, the directions as fitted, so only DAS needs rows of its
    own). The rows `sweep_site` gives, site after site."""
    das, control_das = das or {}, control_das or {}
    sites = [site for site, names in todo.items() if names and data_of(site[1]) is not None]
    found = {
        site: fit_site(*site, todo[site], lm, data_of(site[1]), cache, seed, dtype, das.get(site), batch_size)[1]
        for site in sites
    }
    evals = {r: list(data_of(r).loader("eval", batch_size)) for r in {region for _, region in sites}}
    if control:
        kept = [site for site in sites if data_of(site[1], "dog_give") is not None]
        controlled = {
            site: found[site] | ({"das": control_das.get(site)} if "das" in found[site] else {}) for site in kept
        }
        control_evals = {
            r: list(data_of(r, "dog_give").loader("eval", batch_size)) for r in {region for _, region in kept}
        }
    control_scores = {}
    try:  # only the stacked forwards: the fits and the data above fail as they are
        if control:  # one call: the control's rows that equal the task's but for the labels are shared
            scores, control_scores = score_stacked(
                cache.model, cache, found, evals, batch_size, (controlled, control_evals)
            )
        else:
            scores = score_stacked(cache.model, cache, found, evals, batch_size)
    except Exception as error:  # noqa: BLE001 -- e.g. blocks that cannot run on rows entering at different layers
        raise StackedScoringFailed(f"{type(error).__name__}: {error}") from error
    return [row for site in sites for row in site_rows(task, *site, todo[site], scores[site], control_scores.get(site))]


@torch.no_grad()
def task_accuracy(task, templates, lm, sizes, cache, dtype="float32", batch_size=64) -> float:
    """Acc: the share of eval pairs where the unintervened model ranks y_b above y_s.

    Before that, the cache is filled with every train and eval sentence of the task, in a few
    full batches (the sites' loaders then find them all), with the keys and values of all their
    tokens above the lowest layer: DAS at any region then runs the upper blocks from its site on."""
    data = _region_data(task, templates, lm, None, None, sizes)
    loaders = chain(data.loader("train", batch_size), data.loader("eval", batch_size))
    cache.fill(loaders, batch_size=batch_size, prefix="all")
    module = InterchangeModule(lm=lm, layer=cache.layers[-1], dtype=dtype).to(cache.model.device)
    module.share_cache(cache)
    right = total = 0
    for batch in data.loader("eval", batch_size):
        batch = module.transfer_batch_to_device(batch, module.device, 0)
        logits = module.clean_logits(batch, torch.stack([batch["base_label"], batch["source_label"]], dim=1))
        right += (logits[:, 0] > logits[:, 1]).sum().item()
        total += len(logits)
    return right / total


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
    """summary.csv and one heatmap per task and method. `scored` ({task: regions}, default: all
    of them) limits the overall odds and the selectivity to the regions from the first
    label-variable region on, as the paper's code does; the heatmaps show every region."""
    grouped = defaultdict(dict)
    for row in results:
        grouped[(row["task"], row["method"])][(int(row["layer"]), row["region"])] = row
    summary = []
    for (task, method), cells in grouped.items():
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
        layers = sorted({layer for layer, _ in cells})
        names = [r for r in regions[task] if any((layer, r) in cells for layer in layers)]
        matrix = np.full((len(layers), len(names)), np.nan)
        for (layer, region), value in odds.items():
            matrix[layers.index(layer), names.index(region)] = value
        odds_heatmap(
            matrix,
            layers,
            names,
            f"{task} · {method} · overall odds {line['overall_odds']:.2f}",
            out / "heatmaps" / f"{task}_{method}.png",
        )
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "method", "accuracy", "overall_odds", "selectivity"])
        writer.writeheader()
        writer.writerows(summary)
    return summary


def check_inputs(tasks: list[str], templates, dtype: str, sizes: dict) -> None:
    """What can be refused before the output directory is claimed and the model loaded."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    for name in ("train_pairs", "eval_pairs"):
        if not isinstance(sizes[name], int) or sizes[name] < 1:
            raise ValueError(f"{name}={sizes[name]!r} must be a positive integer")
    for task in tasks:
        available = load_task(task, templates).distinct_pairs()
        for name in ("train_pairs", "eval_pairs"):
            if sizes[name] > available:
                raise ValueError(
                    f"{name}={sizes[name]} but task {task!r} has only {available} distinct pairs; "
                    f"ask for at most {available}"
                )


def sweep_units(
    tasks: list[str], layers: list[int], layers_per_unit: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep's units of work, (task, layers): per task, its layers in groups of
    `layers_per_unit` (None: all of them; one activation cache and one DAS training loop per
    unit). Smaller groups spread a few tasks over many ranks."""
    if layers_per_unit is None:
        layers_per_unit = max(len(layers), 1)
    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int) or layers_per_unit < 1:
        raise ValueError(
            f"layers_per_unit={layers_per_unit!r} must be a positive integer (or None: all layers in one unit)"
        )
    groups = [tuple(layers[i : i + layers_per_unit]) for i in range(0, len(layers), layers_per_unit)]
    return [(task, group) for task in tasks for group in groups]


def _sweep(
    store,
    units,
    methods,
    templates,
    lm,
    control,
    sizes,
    seed,
    dtype,
    batch_size,
    regions,
    done,
    accuracy,
    stacked_scoring=True,
) -> None:
    """The sites of `units` ([(task, layers)], `sweep_units`) not in `done`, each unit's stored
    together (`stacked_scoring`, `score_unit`) or each site as it is scored (`sweep_site`);
    fills `accuracy` ({task: Acc})."""
    out = store.out
    model = load_lm(lm, dtype).to("cuda" if torch.cuda.is_available() else "cpu")  # every site's module follows it
    progress = tqdm(total=sum(len(regions[task]) * len(layers) for task, layers in units), desc="sites", unit="site")
    for task, layers in units:
        cache = ActivationCache(model, layers)  # one cache per unit: every layer, computed once for its sentences
        accuracy[task] = task_accuracy(task, templates, lm, sizes, cache, dtype, batch_size)

        @functools.cache
        def data_of(region, kind=None, task=task):
            """A region's data module (kind: None, or the control task), tokenised once per task."""
            return _region_data(task, templates, lm, region, kind, sizes)

        todo = {
            (layer, region): [m for m in methods if (task, m, layer, region) not in done]
            for layer in layers
            for region in regions[task]
        }
        das_sites = [site for site, names in todo.items() if "das" in names]  # every layer's, trained in one loop
        das_progress = out / "das" / "progress"  # the DAS loop's state while it runs (`train_das`)
        das = (
            saved_das(
                partial(das_path, out, task),
                {site: data_of(site[1]) for site in das_sites},
                lm,
                cache,
                seed,
                dtype,
                das_progress / task,
                batch_size,
            )
            if das_sites
            else {}
        )
        control_das = (
            saved_das(
                partial(das_path, out, task, control="dog_give"),
                {site: data_of(site[1], "dog_give") for site in das_sites},
                lm,
                cache,
                seed,
                dtype,
                das_progress / f"{task}_dog_give",
                batch_size,
            )
            if das_sites and control
            else {}
        )
        if stacked_scoring:  # every site at once: stored together (an interruption loses the unit's scoring)
            try:
                rows = score_unit(task, todo, lm, data_of, cache, seed, dtype, das, control_das, batch_size, control)
            except StackedScoringFailed as error:  # only the stacked forwards: a failed fit is raised as it is
                warnings.warn(
                    f"the stacked scoring failed on {lm} ({error}); each site is scored in its own "
                    "forwards instead (same results, slower; --stacked_scoring false skips the attempt)",
                    stacklevel=2,
                )
            else:
                store.add({"results": rows})
                progress.update(len(todo))
                continue
        for (layer, region), names in todo.items():
            if names:
                store.add(
                    {
                        "results": sweep_site(
                            task,
                            layer,
                            region,
                            names,
                            lm,
                            data_of(region),
                            data_of(region, "dog_give") if control else None,
                            cache,
                            seed,
                            dtype,
                            das.get((layer, region)),
                            control_das.get((layer, region)),
                            batch_size,
                        )
                    }
                )
            progress.update()
    progress.close()


def run_sweep(
    tasks: str | list[str] = "agr_sv_num_pp",
    methods: str | list[str] = "all",
    layers: str | list[int] = "all",
    templates: str | None = None,
    lm: str = DEFAULT_LM,
    control: bool = False,
    out: str = "runs/sweep",
    train_pairs: int = 200,
    eval_pairs: int = 50,
    seed: int = 0,
    dtype: str = "float32",
    batch_size: int = 64,
    layers_per_unit: int | None = None,
    stacked_scoring: bool = True,
) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows.

    Under torchrun or srun each process takes its share of the units (`sweep_units`), writes
    DIR/ranks/rank-R/, and rank 0 merges them into the files one process would have written
    (`lit_interventions.studies.distributed`).

    Args:
        tasks: task names, or 'all'.
        methods: from das, probe, diffmean, lda, pca, kmeans, random, vanilla; or 'all'.
        layers: layer indices (-1 = embeddings), or 'all'.
        templates: a template file in the CausalGym schema (default: our 29 tasks).
        lm: the LM (embedded name, .gguf, local directory or hub id).
        control: also run the dog/give control task (adds control_odds and selectivity).
        out: output directory.
        train_pairs, eval_pairs: pairs before swap-doubling (the paper: 200, 50).
        seed: data and method seed.
        dtype: the frozen LM's dtype (float32, bfloat16, float16); DAS trains in float32.
        batch_size: rows per forward that only reads the frozen LM (the cache fill, the states
            directions are fitted on, scoring); DAS trains at the paper's batch of 4 whatever it
            is. Raise it to fill a GPU.
        layers_per_unit: layers per unit of work (default: all of a task's layers in one);
            smaller spreads a few tasks over many processes.
        stacked_scoring: score all sites × methods of a unit together, in stacked forwards of
            `batch_size` rows (`score_unit`); false: site by site (`sweep_site`), the earlier
            sweep, kept for benchmarks. Same results to float rounding.
    """
    ranks = distributed.detect()
    distributed.pin_device(ranks)  # before anything starts CUDA
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    template_path = Path(templates) if templates else BUILTIN_TEMPLATES
    tasks = choose_names(tasks, list(load_templates(template_path)), "tasks")
    methods = choose_names(methods, METHODS, "methods")
    layers = choose_layers(layers, num_layers(load_config(lm)))
    units = sweep_units(tasks, layers, layers_per_unit)
    out = Path(out)
    digest = hashlib.sha256(template_path.read_bytes()).hexdigest()
    sizes = {"train_pairs": train_pairs, "eval_pairs": eval_pairs, "seed": seed}
    check_inputs(tasks, templates, dtype, sizes)  # before the output directory is claimed: a refused run leaves nothing
    regions = {task: load_task(task, templates).regions for task in tasks}
    meta = {"lm": lm, "dtype": dtype, "templates": templates or "builtin", "templates_sha256": digest, **sizes}

    def plan(store) -> tuple[list, tuple[set, set]]:
        """The units with work left; the finished sites, and the layers finished with the control."""
        done = {
            (r["task"], r["method"], int(r["layer"]), r["region"])
            for r in store.rows("results")
            if r["control_odds"] or not control
        }  # a site run without the control is redone with it
        with_control = {
            (r["task"], int(r["layer"]), r["method"]) for r in store.rows("finished") if r["control"] == "1"
        }
        finished = with_control | {
            (r["task"], int(r["layer"]), r["method"]) for r in store.rows("finished") if not control
        }
        measured = {r["task"] for r in store.rows("accuracy")}
        todo = [
            (task, group)
            for task, group in units
            if task not in measured or any((task, layer, m) not in finished for layer in group for m in methods)
        ]
        return todo, (done, with_control)

    def summary(store) -> list[dict]:
        accuracy = {r["task"]: float(r["accuracy"]) for r in store.rows("accuracy")}
        results = [
            r
            for r in store.rows("results")
            if r["task"] in tasks and r["method"] in methods and int(r["layer"]) in layers
        ]
        return summarise(
            results, accuracy, regions, out, {task: load_task(task, templates).scored_regions for task in tasks}
        )

    with distributed.ShardedRun(
        ranks, out, meta, [RESULTS, ACCURACY, FINISHED], ignore=("templates",)
    ) as run:  # the file is known by its sha256
        todo, (done, with_control) = run.start(plan, hint=" (--layers_per_unit splits a task's layers into more units)")
        for task, group in run.take(todo, cost=lambda unit: len(unit[1]) * len(regions[unit[0]])):  # its sites
            accuracy = {}
            _sweep(
                run.store,
                [(task, group)],
                methods,
                templates,
                lm,
                control,
                sizes,
                seed,
                dtype,
                batch_size,
                regions,
                done,
                accuracy,
                stacked_scoring,
            )
            finished = [
                {"task": task, "layer": layer, "method": m, "control": int(control)}
                for layer in group
                for m in methods
                if control or (task, layer, m) not in with_control
            ]
            run.store.add({"accuracy": [{"task": task, "accuracy": accuracy[task]}], "finished": finished})
        return run.finish(_position(units), summary)


def _position(units: list[tuple[str, tuple[int, ...]]]):
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


def main(args=None) -> None:
    """`lit-interventions sweep causalgym`."""
    run_cli(distributed.printed_by_rank_zero(run_sweep), __doc__, args)
