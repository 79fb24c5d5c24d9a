"""Every site × method of a sweep unit scored in a few no-grad stacked forwards.

The rows of a unit's scoring are (site, method or the clean forward, eval example): each one
enters the frozen LM at its site's layer from its cached state there, with its method's
f*(f(b), f(s)) written at the site (`sites.stacked_logits`), and only the two label rows of the
LM head are computed. Rows are packed `rows` at a time whatever site or method they belong to,
so every block's weights are read once per forward for many sites, instead of once per site,
method and eval batch. Each site's clean rows are computed at its own layer, as
`InterchangeModule.score` does, and every row goes through the same `InterchangeOdds` (AvgOdds and
IIA are sums over rows): the scores equal the per-site ones to float rounding.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_interventions.cache import ActivationCache
from lit_interventions.metrics import InterchangeOdds
from lit_interventions.modules.multisite import stack_batches
from lit_interventions.sites import stacked_logits

CLEAN = None  # the job of a site's unintervened rows, p(· | b)


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
) -> dict[tuple[int, str], dict[str, dict[str, float]]]:
    """AvgOdds and IIA of each site's interventions on its region's eval batches, in stacked
    forwards of at most `rows` rows: {(layer, region): {method: {odds, iia}}}.

    `found` is {(layer, region): {method: intervention (f(b), f(s)) -> f*}}; `evals` {region:
    collated eval batches}; `cache` holds every site's layer and every eval sentence."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be a positive integer")
    device = next(model.parameters()).device
    evals = {region: [move_data_to_device(batch, device) for batch in evals[region]] for _, region in found}
    found = {site: {name: f.to(device) for name, f in methods.items()} for site, methods in found.items()}
    jobs = [((site, name, i), len(batch["base_label"]))
            for site in found for i, batch in enumerate(evals[site[1]]) for name in (CLEAN, *found[site])]  # fmt: skip
    logits = defaultdict(list)  # job -> its rows' label logits, (n, 2), in row order
    for chunk in _pieces(jobs, rows):
        parts = [_rows_of(evals[site[1]][i], a, b) for (site, _, i), a, b in chunk]
        stacked = stack_batches(parts)
        layers = [site[0] for (site, _, _), a, b in chunk for _ in range(b - a)]
        base = cache.states(layers, stacked["base_input_ids"], stacked["base_attention_mask"], stacked["base_keys"])
        source = cache.states(layers, stacked["source_input_ids"], stacked["source_attention_mask"], stacked["source_keys"])
        source = source[torch.arange(len(source), device=source.device), stacked["source_pos"]]
        bounds = [0]
        for _, a, b in chunk:
            bounds.append(bounds[-1] + b - a)

        def edit(h, chunk=chunk, source=source, bounds=bounds):  # each piece through its own method
            return torch.cat([h[s:e] if name is CLEAN else found[site][name](h[s:e], source[s:e]).to(h.dtype)
                              for ((site, name, _), _, _), s, e in zip(chunk, bounds, bounds[1:])])  # fmt: skip

        vocab = torch.stack([stacked["base_label"], stacked["source_label"]], dim=1)  # columns 0 and 1
        prefix = cache.prefix(min(layers), stacked["base_keys"], stacked["base_pos_list"])
        out = stacked_logits(model, stacked["base_input_ids"], stacked["base_attention_mask"], stacked["base_last"],
                             layers, stacked["base_pos"], edit, base, vocab=vocab, prefix=prefix)  # fmt: skip
        for (job, _, _), s, e in zip(chunk, bounds, bounds[1:]):
            logits[job].append(out[s:e])
    scores = {}
    for site, methods in found.items():
        scores[site] = {}
        for name in methods:
            metric = InterchangeOdds().to(device)
            for i in range(len(evals[site[1]])):
                clean, intervened = torch.cat(logits[(site, CLEAN, i)]), torch.cat(logits[(site, name, i)])
                columns = torch.arange(2, device=device).expand(len(clean), 2)
                metric.update(clean, intervened, columns[:, 0], columns[:, 1])
            scores[site][name] = {k: v.item() for k, v in metric.compute().items()}
    return scores
