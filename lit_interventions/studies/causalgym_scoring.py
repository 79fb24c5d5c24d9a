"""The CausalGym sweep's sites: each method made ready at a site, then scored.

A method is handled by the capability of what its spec builds (`registry.kind`): a closed-form
one is fitted on the site's base train states with their sentence types, by the functions
`train.py` fits with (`interchange.fit_states`, `interchange.fit_closed_form`; a scikit-learn
style direction estimator gives the interchange on its direction, f* = f(b) + (a·f(s) − a·f(b)) a;
CausalGym §4.2); a trained one comes from its multi-site loop (`causalgym_training`); a fixed one
(vanilla: W = I_d, f* = f(s)) is used as it is. Every method at every site is scored by the
metric validation uses (`InterchangeOdds` fed the two labels' logits, as `OddsCallback` is): site
by site through `InterchangeModule.score` (`sweep_site`), the code `train.py validate` runs
(equal to it bit for bit wherever the cached frozen states are: `tests/test_scoring_path.py`), or
a unit's sites at once in stacked forwards (`score_unit`, `score_stacked`; equal
to float rounding: a stacked forward's bits for a row depend on the rows that share it).

A unit's sites are scored together in a few no-grad stacked forwards (`score_stacked`). The rows of
a unit's scoring are (site, method or the clean forward, eval example): each one enters the frozen
LM at its site's layer from its cached state there, with its method's f*(f(b), f(s)) written at the
site (`sites.stacked_hidden`), and only the two label rows of the LM head are computed. Rows are
packed `rows` at a time whatever site or method they belong to, shortest runs first (a forward is as
wide as its longest row), so every block's weights are read once per forward for many sites, instead
of once per site, method and eval batch. Each site's clean rows are computed at its own layer, as
`InterchangeModule.score` does, and every row goes through the metric validation uses, fed as
`OddsCallback` feeds it (`InterchangeOdds.update_labels` on the two labels' logits; AvgOdds and IIA
are sums over rows): the scores equal the per-site ones to float rounding (a stacked forward's bits
for a row depend on the rows and prefix width it shares). A row its method leaves unchanged (f* =
f(b) bit for bit: a site before the pair's first difference) is its clean row: it is not run, its
odds are exactly 0. The control task's rows that equal the task's but for their labels (the clean
rows and every fitted direction: only the trained methods are retrained on the control labels) are
not run again: the same rows give both tasks' labels.
"""

from __future__ import annotations

from itertools import chain

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_interventions.core.batch import PairBatch, Side
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.forward import final_logits
from lit_interventions.core.progress import stage
from lit_interventions.core.stacked import stacked_hidden
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.interventions.capabilities import intervene
from lit_interventions.interventions.registry import FITTED, MethodSpec, kind
from lit_interventions.interventions.rotation import FixedSubspaceIntervention
from lit_interventions.metrics.odds import InterchangeOdds, label_ids
from lit_interventions.modules.interchange import InterchangeModule, fit_closed_form, fit_states

CONTROL = "dog_give"  # the control task (Arora et al. 2024, §4.3)


# --- each site's methods made ready, and scored site by site --------------------------------------
def method_kinds(methods: list[MethodSpec], hidden: int, seed: int) -> dict[str, str]:
    """{name: FITTED, TRAINED or FIXED} of each method (`registry.kind` of one built instance;
    the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        return {method.name: kind(method.build(hidden, seed)) for method in methods}


def fit_method(method: MethodSpec, types: list[str], X: torch.Tensor, seed: int, hidden: int):
    """The intervention of a closed-form or fixed method at a site whose train states are `X`
    (n, d) with classes `types` (`fit_states`): fitted (`fit_closed_form`), or as built."""
    built = method.build(hidden, seed)
    if kind(built) != FITTED:
        return built
    try:
        return fit_closed_form(built, X, types)
    except ValueError:
        # Degenerate site: every base has the same state here (a token before the alternation,
        # under causal attention), so f(b) = f(s) and any interchange is a no-op: odds 0.
        return FixedSubspaceIntervention(torch.zeros(hidden))


def fit_site(layer, region, methods, lm, data, cache, seed, dtype="float32", trained=None, batch_size=64, **site):
    """The site's module (`InterchangeModule` on the shared cache) and each method's intervention,
    {name: f}: `methods` are MethodSpecs; the closed-form ones are fitted on what `train.py`
    fits them on (`fit_states`: the base train states and their types), the trained ones taken
    from `trained` ({name: this site's trained intervention}). `site`: the module's `component`
    and `head` (default: the block output, read from the cache; a head runs the full forward)."""
    trained = trained or {}
    module = InterchangeModule(lm=lm, layer=layer, region=region, dtype=dtype, **site).to(cache.model.device)
    module.share_cache(cache)
    X, types = fit_states(module, data, batch_size)
    return module, {
        m.name: trained[m.name] if m.name in trained else fit_method(m, types, X, seed, X.shape[-1]) for m in methods
    }


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
    trained=None,
    control_trained=None,
    batch_size=64,
    **site,
) -> list[dict]:
    """Every method (MethodSpecs) at one site; one row per method. `data` and `control_data`
    (None: no control) are the region's data modules; `trained` and `control_trained` ({name:
    intervention}) the trained methods' interventions at this site on the task and on the control
    task (`train_das`); `batch_size` the rows of each forward that reads states or scores. (The
    sweep scores a unit's sites together, `score_unit`; this is the one-site path, kept for
    benchmarks and as its reference, and the path of the head sweep: `site` gives the module's
    `component` and `head`, `run_components` in `causalgym_sweep`.)"""
    if data is None:
        return []
    module, found = fit_site(layer, region, methods, lm, data, cache, seed, dtype, trained, batch_size, **site)
    scores = module.score(list(data.loader("eval", batch_size)), found)
    control_scores = None
    if control_data is not None:  # the trained methods are retrained on the control labels; the fitted stay
        found |= {name: f for name, f in (control_trained or {}).items() if name in found}
        control_scores = module.score(control_data.loader("eval", batch_size), found)
    return site_rows(task, layer, region, [m.name for m in methods], scores, control_scores)


class StackedScoringFailed(RuntimeError):
    """The stacked forwards of `score_unit` failed (not the fitting before them)."""


def _at(trained: dict, site) -> dict:
    """{name: the intervention at `site`} of {name: {site: intervention}}."""
    return {name: found[site] for name, found in trained.items() if site in found}


def score_unit(
    task,
    todo,
    lm,
    data_of,
    cache,
    seed,
    dtype="float32",
    trained=None,
    control_trained=None,
    batch_size=64,
    control=False,
) -> list[dict]:
    """Every method at every site of a unit, `todo` ({(layer, region): MethodSpecs}): each site's
    closed-form methods are fitted first, then all sites × methods × eval rows are scored in
    stacked no-grad forwards of `batch_size` rows (`score_stacked`), the control
    task in the same call (the trained methods retrained on it, `control_trained`, the fitted ones
    as fitted, so only the trained ones need rows of their own). `trained`: {name: {site:
    intervention}}. The rows `sweep_site` gives, site after site."""
    trained, control_trained = trained or {}, control_trained or {}
    sites = [site for site, methods in todo.items() if methods and data_of(site[1]) is not None]
    found = {}
    with stage(len(sites), "fitted sites", "site") as shown:
        for site in sites:
            at = _at(trained, site)
            found[site] = fit_site(*site, todo[site], lm, data_of(site[1]), cache, seed, dtype, at, batch_size)[1]
            shown.update()
    evals = {r: list(data_of(r).loader("eval", batch_size)) for r in {region for _, region in sites}}
    if control:
        kept = [site for site in sites if data_of(site[1], CONTROL) is not None]
        controlled = {
            site: found[site] | {n: f for n, f in _at(control_trained, site).items() if n in found[site]}
            for site in kept
        }
        control_evals = {
            r: list(data_of(r, CONTROL).loader("eval", batch_size)) for r in {region for _, region in kept}
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
    return [
        row
        for site in sites
        for row in site_rows(task, *site, [m.name for m in todo[site]], scores[site], control_scores.get(site))
    ]


@torch.no_grad()
def task_accuracy(data: BenchmarkDataModule, lm, cache, dtype="float32", batch_size=64) -> float:
    """Acc: the share of `data`'s eval pairs (a task's data module, set up) where the
    unintervened model ranks y_b above y_s.

    Before that, the cache is filled with every train and eval sentence of the task, in a few
    full batches (the sites' loaders then find them all: every region's data module holds the
    same sentences), with the keys and values of all their tokens above the lowest layer: a
    trained method at any region then runs the upper blocks from its site on."""
    loaders = chain(data.loader("train", batch_size), data.loader("eval", batch_size))
    cache.fill(loaders, batch_size=batch_size, prefix="all")
    module = InterchangeModule(lm=lm, layer=cache.layers[-1], dtype=dtype).to(cache.model.device)
    module.share_cache(cache)
    right = total = 0
    for batch in data.loader("eval", batch_size):
        batch = module.transfer_batch_to_device(batch, module.device, 0)
        logits = module.clean_logits(batch, label_ids(batch))
        right += (logits[:, 0] > logits[:, 1]).sum().item()
        total += len(logits)
    return right / total


# --- a unit's sites × methods scored in stacked forwards ------------------------------------------
CLEAN = None  # the job of a site's unintervened rows, p(· | b)
TASK_LABELS, CONTROL_LABELS = "task", "control"  # whose labels a job's logits are


def _runs(cache: ActivationCache, batch: PairBatch) -> list[int]:
    """The columns each base row runs in `stacked_hidden`: from after its cached ones to its logits."""
    starts = cache.run_starts(batch.base)
    return [last - start for last, start in zip(batch.base.last.tolist(), starts)]


def _pieces(runs: dict[object, dict[int, int]], rows: int):
    """The jobs' rows (`runs`: {job: {row: its run, in columns}}) in forwards of at most `rows`
    rows, shortest runs first: a forward is as wide as its longest run, so rows of equal runs
    share forwards and few columns are padding. [[(job, its rows in this forward)]]."""
    jobs = list(runs)
    order = sorted((run, n, i) for n, job in enumerate(jobs) for i, run in runs[job].items())
    for a in range(0, len(order), rows):
        chunk: dict[object, list[int]] = {}
        for _, n, i in order[a : a + rows]:
            chunk.setdefault(jobs[n], []).append(i)
        yield list(chunk.items())


@torch.no_grad()
def score_stacked(
    model: torch.nn.Module,
    cache: ActivationCache,
    found: dict[tuple[int, str], dict[str, torch.nn.Module]],
    evals: dict[str, list[dict]],
    rows: int = 64,
    control: tuple[dict, dict] | None = None,
):
    """AvgOdds and IIA of each site's interventions on its region's eval batches, in stacked
    forwards of at most `rows` rows: {(layer, region): {method: {odds, iia}}}.

    `found` is {(layer, region): {method: intervention (f(b), f(s)) -> f*}}; `evals` {region:
    collated eval batches}; `cache` holds every site's layer and every eval sentence.

    `control` = (its `found`, its `evals`) scores the control task as well and returns
    (scores, control scores). A control batch that is the task's batch with other labels (the
    dog/give control) shares the task's forwards wherever the intervention is the same object (the
    clean rows and every fitted direction): its two labels' logits are read off the same rows.
    Only what differs (a trained method, retrained on the control labels) gets rows of its own."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be a positive integer")
    device = next(model.parameters()).device
    tasks = {TASK_LABELS: (found, evals)} | ({CONTROL_LABELS: control} if control is not None else {})
    jobs, read_from = _jobs(tasks, device)
    width = cache.longest_prefix()
    runs = {id(batch): _runs(cache, batch) for batch, _, _ in jobs.values()}  # jobs share their eval batches
    # a row its method leaves unchanged is its clean row: not run again, its logits are the clean ones
    edited, unchanged = _edits(cache, jobs)
    todo = {}  # job -> {row: its run} of the rows to run
    for key, (batch, _, _) in jobs.items():
        same = unchanged[key].tolist() if key in unchanged else [False] * len(runs[id(batch)])
        todo[key] = {i: run for i, (run, skip) in enumerate(zip(runs[id(batch)], same)) if not skip}
    logits = {}  # job -> its rows' label logits, (n, columns), in row order (unchanged rows: not filled)
    pieces = list(_pieces(todo, rows))
    with stage(len(pieces), "scoring forwards", "forward") as shown:
        for chunk in pieces:
            _forward(model, cache, jobs, edited, chunk, width, logits)
            shown.update()
    scores = _scores(tasks, read_from, logits, unchanged, device)
    return scores[TASK_LABELS] if control is None else (scores[TASK_LABELS], scores[CONTROL_LABELS])


def _forward(model, cache: ActivationCache, jobs: dict, edited: dict, chunk: list, width: int, logits: dict) -> None:
    """One stacked forward of `chunk` ([(job, its rows)], `_pieces`): each row from its site's
    cached state, its f* written there (`edited`), the label logits stored in `logits` ({job: (n,
    columns)})."""
    stacked = Side.cat([jobs[key][0].base.rows(index) for key, index in chunk])
    layers = [key[1][0] for key, index in chunk for _ in index]
    base = cache.states(layers, stacked)
    bounds = [0]
    for _, index in chunk:
        bounds.append(bounds[-1] + len(index))

    def edit(h, chunk=chunk, bounds=bounds):  # each row's f*, or f(b) in a clean row
        return torch.cat(
            [
                h[s:e] if jobs[key][2] is None else edited[key][index].to(h.dtype)
                for (key, index), s, e in zip(chunk, bounds, bounds[1:])
            ]
        )

    vocab = torch.cat([jobs[key][1][index] for key, index in chunk])
    # a fixed prefix width: a row's key length does not depend on the rows beside it (exact resumes)
    prefix = cache.row_prefix(min(layers), stacked, width)
    hidden = stacked_hidden(
        model,
        stacked.input_ids,
        stacked.attention_mask,
        stacked.last,
        layers,
        stacked.pos,
        edit,
        base,
        prefix,
    )
    out = final_logits(model, hidden, vocab)
    for (key, index), s, e in zip(chunk, bounds, bounds[1:]):
        if key not in logits:
            logits[key] = out.new_full((len(jobs[key][1]), out.shape[1]), float("nan"))
        logits[key][index] = out[s:e]


def _scores(tasks: dict, read_from: dict, logits: dict, unchanged: dict, device) -> dict:
    """{task: {site: {method: {odds, iia}}}} from the jobs' label logits: each method's rows
    against its site's clean rows, through `InterchangeOdds` (a row its method leaves unchanged
    is its clean row)."""
    scores = {}
    for task, (task_found, task_evals) in tasks.items():
        scores[task] = {}
        for site, methods in task_found.items():
            scores[task][site] = {}
            for name in methods:
                metric = InterchangeOdds().to(device)
                for i in range(len(task_evals[site[1]])):
                    (clean, c), (job, k) = (read_from[(task, site, n, i)] for n in (CLEAN, name))
                    clean = logits[clean][:, c : c + 2]
                    intervened = clean if job not in logits else logits[job][:, k : k + 2]
                    if job in unchanged:
                        intervened = torch.where(unchanged[job][:, None], clean, intervened)
                    metric.update_labels(clean, intervened)
                scores[task][site][name] = {k: v.item() for k, v in metric.compute().items()}
    return scores


def _edits(cache: ActivationCache, jobs: dict) -> tuple[dict, dict]:
    """Each method job's f*(f(b), f(s)) at its site, (n, d), and which of its rows it leaves as
    they are (f* = f(b) bit for bit: a site before the pair's first difference, under causal
    attention). f* is computed on the job's whole eval batch at once, as `InterchangeModule.score`
    does, so a row's f* does not depend on the rows that share its forward (a matrix product's bits
    can depend on its row count)."""
    states, edited, unchanged = {}, {}, {}
    for key, (batch, _, f) in jobs.items():
        if f is None:
            continue
        layer = key[1][0]
        if (layer, id(batch)) not in states:  # f(b), f(s) at the site, shared by the site's methods
            states[(layer, id(batch))] = [cache.at_site(layer, side) for side in (batch.base, batch.source)]
        base, source = states[(layer, id(batch))]
        edited[key] = intervene(f, base, source).to(base.dtype)
        unchanged[key] = (edited[key] == base).all(dim=-1)
    return edited, unchanged


def _jobs(tasks: dict, device) -> tuple[dict, dict]:
    """The forwards' jobs and where each task's logits are read.

    jobs: {(task, site, method or CLEAN, batch index): (batch, label ids (n, columns), intervention
    or None)}; read_from: {(task, site, method, i): (job, first column)}. A control job whose batch
    inputs and intervention equal a task job's is not a job: its labels become that job's columns
    2 and 3. Every job has as many columns (the first two repeated where there is nothing to add)."""
    jobs, read_from, evals = {}, {}, {}
    for task, (task_found, task_evals) in tasks.items():
        evals[task] = {
            region: [move_data_to_device(batch, device) for batch in task_evals[region]] for _, region in task_found
        }
        shared = {
            (region, i): task == CONTROL_LABELS
            and i < len(evals[TASK_LABELS].get(region, ()))
            and evals[TASK_LABELS][region][i].same_inputs(batch)
            for region, batches in evals[task].items()
            for i, batch in enumerate(batches)
        }
        for site, methods in task_found.items():
            for i, batch in enumerate(evals[task][site[1]]):
                labels = label_ids(batch)
                for name in (CLEAN, *methods):
                    f = None if name is CLEAN else methods[name].to(device)
                    twin = jobs.get((TASK_LABELS, site, name, i)) if shared[(site[1], i)] else None
                    if twin is not None and twin[2] is f:  # the task's rows give this task's labels too
                        jobs[(TASK_LABELS, site, name, i)] = (twin[0], torch.cat([twin[1], labels], dim=1), f)
                        read_from[(task, site, name, i)] = ((TASK_LABELS, site, name, i), 2)
                    else:
                        jobs[(task, site, name, i)] = (batch, labels, f)
                        read_from[(task, site, name, i)] = ((task, site, name, i), 0)
    width = max((labels.shape[1] for _, labels, _ in jobs.values()), default=2)
    return {
        key: (batch, labels.repeat(1, width // labels.shape[1]), f) for key, (batch, labels, f) in jobs.items()
    }, read_from
