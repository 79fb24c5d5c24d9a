"""Every site × method of a sweep unit scored in a few no-grad stacked forwards.

The rows of a unit's scoring are (site, method or the clean forward, eval example): each one
enters the frozen LM at its site's layer from its cached state there, with its method's
f*(f(b), f(s)) written at the site (`sites.stacked_hidden`), and only the two label rows of the
LM head are computed. Rows are packed `rows` at a time whatever site or method they belong to,
shortest runs first (a forward is as wide as its longest row), so every block's weights are read
once per forward for many sites, instead of once per site, method and eval batch. Each site's
clean rows are computed at its own layer, as `InterchangeModule.score` does, and every row goes
through the metric validation uses, fed as `OddsCallback` feeds it (`InterchangeOdds.update_labels`
on the two labels' logits; AvgOdds and IIA are sums over rows): the scores equal the per-site
ones to float rounding (a stacked forward's bits for a row depend on the rows and prefix width
it shares). A row its method leaves unchanged (f* = f(b) bit for bit: a site
before the pair's first difference) is its clean row: it is not run, its odds are exactly 0. The control task's
rows that equal the task's but for their labels (the clean rows and every fitted direction: only
the trained methods are retrained on the control labels) are not run again: the same rows give both tasks' labels.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_interventions.core.batch import PairBatch, Side
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.progress import stage
from lit_interventions.core.sites import final_logits, stacked_hidden
from lit_interventions.interventions.capabilities import intervene
from lit_interventions.metrics.odds import InterchangeOdds, label_ids

CLEAN = None  # the job of a site's unintervened rows, p(· | b)
TASK, CONTROL = "task", "control"  # whose labels a job's logits are


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
    tasks = {TASK: (found, evals)} | ({CONTROL: control} if control is not None else {})
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
    return scores[TASK] if control is None else (scores[TASK], scores[CONTROL])


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
            (region, i): task == CONTROL
            and i < len(evals[TASK].get(region, ()))
            and evals[TASK][region][i].same_inputs(batch)
            for region, batches in evals[task].items()
            for i, batch in enumerate(batches)
        }
        for site, methods in task_found.items():
            for i, batch in enumerate(evals[task][site[1]]):
                labels = label_ids(batch)
                for name in (CLEAN, *methods):
                    f = None if name is CLEAN else methods[name].to(device)
                    twin = jobs.get((TASK, site, name, i)) if shared[(site[1], i)] else None
                    if twin is not None and twin[2] is f:  # the task's rows give this task's labels too
                        jobs[(TASK, site, name, i)] = (twin[0], torch.cat([twin[1], labels], dim=1), f)
                        read_from[(task, site, name, i)] = ((TASK, site, name, i), 2)
                    else:
                        jobs[(task, site, name, i)] = (batch, labels, f)
                        read_from[(task, site, name, i)] = ((task, site, name, i), 0)
    width = max((labels.shape[1] for _, labels, _ in jobs.values()), default=2)
    return {
        key: (batch, labels.repeat(1, width // labels.shape[1]), f) for key, (batch, labels, f) in jobs.items()
    }, read_from
