"""Every site × method of a sweep unit scored in a few no-grad stacked forwards.

The rows of a unit's scoring are (site, method or the clean forward, eval example): each one
enters the frozen LM at its site's layer from its cached state there, with its method's
f*(f(b), f(s)) written at the site (`sites.stacked_hidden`), and only the two label rows of the
LM head are computed. Rows are packed `rows` at a time whatever site or method they belong to,
so every block's weights are read once per forward for many sites, instead of once per site,
method and eval batch. Each site's clean rows are computed at its own layer, as
`InterchangeModule.score` does, and every row goes through the same `InterchangeOdds` (AvgOdds and
IIA are sums over rows): the scores equal the per-site ones to float rounding. The control task's
rows that equal the task's but for their labels (the clean rows and every fitted direction: only
DAS is retrained on the control labels) are not run again: the same rows give both tasks' labels.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_interventions.cache import ActivationCache
from lit_interventions.metrics import InterchangeOdds
from lit_interventions.modules.multisite import stack_batches
from lit_interventions.sites import final_logits, stacked_hidden

CLEAN = None  # the job of a site's unintervened rows, p(· | b)
TASK, CONTROL = "task", "control"  # whose labels a job's logits are
LABELS = ("base_label", "source_label", "label")  # what a control batch may change


def _rows_of(batch: dict, a: int, b: int) -> dict:
    """Rows a:b of a collated batch: what `stack_batches` reads of each side."""
    part = {}
    for side in ("base", "source"):
        for name in ("input_ids", "attention_mask", "pos", "last", "label"):
            part[f"{side}_{name}"] = batch[f"{side}_{name}"][a:b]
        keys, starts = batch[f"{side}_keys"]
        part[f"{side}_keys"] = (keys[a:b], starts[a:b])
        if batch.get(f"{side}_pos_list"):
            part[f"{side}_pos_list"] = batch[f"{side}_pos_list"][a:b]
    return part


def _pieces(jobs: list[tuple[object, int]], rows: int):
    """`jobs` ([(job, n rows)]) cut into forwards of at most `rows` rows: [[(job, a, b)]]."""
    chunk, room = [], rows
    for job, n in jobs:
        a = 0
        while a < n:
            b = min(n, a + room)
            chunk.append((job, a, b))
            room -= b - a
            a = b
            if room == 0:
                yield chunk
                chunk, room = [], rows
    if chunk:
        yield chunk


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
    Only what differs (DAS, retrained on the control labels) gets rows of its own."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be a positive integer")
    device = next(model.parameters()).device
    tasks = {TASK: (found, evals)} | ({CONTROL: control} if control is not None else {})
    jobs, read_from = _jobs(tasks, device)
    width = cache.longest_prefix()
    logits = defaultdict(list)  # job -> its rows' label logits, (n, columns), in row order
    for chunk in _pieces([(key, len(labels)) for key, (_, labels, _) in jobs.items()], rows):
        parts = [_rows_of(jobs[key][0], a, b) for key, a, b in chunk]
        stacked = stack_batches(parts)
        layers = [key[1][0] for key, a, b in chunk for _ in range(b - a)]
        base = cache.states(layers, stacked["base_input_ids"], stacked["base_attention_mask"], stacked["base_keys"])
        source = cache.states(layers, stacked["source_input_ids"], stacked["source_attention_mask"], stacked["source_keys"])
        source = source[torch.arange(len(source), device=source.device), stacked["source_pos"]]
        bounds = [0]
        for _, a, b in chunk:
            bounds.append(bounds[-1] + b - a)

        def edit(h, chunk=chunk, source=source, bounds=bounds):  # each piece through its own method
            return torch.cat([h[s:e] if jobs[key][2] is None else jobs[key][2](h[s:e], source[s:e]).to(h.dtype)
                              for (key, _, _), s, e in zip(chunk, bounds, bounds[1:])])  # fmt: skip

        vocab = torch.cat([jobs[key][1][a:b] for key, a, b in chunk])
        # a fixed prefix width: a row's bits do not depend on the rows beside it (exact resumes)
        prefix = cache.row_prefix(min(layers), stacked["base_keys"], stacked["base_pos_list"], width)
        hidden = stacked_hidden(model, stacked["base_input_ids"], stacked["base_attention_mask"], stacked["base_last"],
                                layers, stacked["base_pos"], edit, base, prefix)  # fmt: skip
        out = final_logits(model, hidden, vocab)
        for (key, _, _), s, e in zip(chunk, bounds, bounds[1:]):
            logits[key].append(out[s:e])
    scores = {}
    for task, (task_found, task_evals) in tasks.items():
        scores[task] = {}
        for site, methods in task_found.items():
            scores[task][site] = {}
            for name in methods:
                metric = InterchangeOdds().to(device)
                for i in range(len(task_evals[site[1]])):
                    (clean, c), (intervened, k) = (read_from[(task, site, n, i)] for n in (CLEAN, name))
                    clean, intervened = torch.cat(logits[clean])[:, c : c + 2], torch.cat(logits[intervened])[:, k : k + 2]
                    columns = torch.arange(2, device=device).expand(len(clean), 2)
                    metric.update(clean, intervened, columns[:, 0], columns[:, 1])
                scores[task][site][name] = {k: v.item() for k, v in metric.compute().items()}
    return scores[TASK] if control is None else (scores[TASK], scores[CONTROL])


def _jobs(tasks: dict, device) -> tuple[dict, dict]:
    """The forwards' jobs and where each task's logits are read.

    jobs: {(task, site, method or CLEAN, batch index): (batch, label ids (n, columns), intervention
    or None)}; read_from: {(task, site, method, i): (job, first column)}. A control job whose batch
    inputs and intervention equal a task job's is not a job: its labels become that job's columns
    2 and 3. Every job has as many columns (the first two repeated where there is nothing to add)."""
    jobs, read_from, evals = {}, {}, {}
    for task, (task_found, task_evals) in tasks.items():
        evals[task] = {region: [move_data_to_device(batch, device) for batch in task_evals[region]]
                       for _, region in task_found}  # fmt: skip
        shared = {(region, i): task == CONTROL and i < len(evals[TASK].get(region, ())) and
                  _same_inputs(evals[TASK][region][i], batch)
                  for region, batches in evals[task].items() for i, batch in enumerate(batches)}  # fmt: skip
        for site, methods in task_found.items():
            for i, batch in enumerate(evals[task][site[1]]):
                labels = torch.stack([batch["base_label"], batch["source_label"]], dim=1)
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
    return {key: (batch, labels.repeat(1, width // labels.shape[1]), f) for key, (batch, labels, f) in jobs.items()}, read_from


def _same_inputs(a: dict, b: dict) -> bool:
    """Whether two collated eval batches differ at most in their labels."""
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a if k not in LABELS)


def _equal(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y
