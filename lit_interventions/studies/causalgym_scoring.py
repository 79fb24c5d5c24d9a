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
a unit's sites at once in stacked forwards (`score_unit`, `stacked_scoring.score_stacked`; equal
to float rounding: a stacked forward's bits for a row depend on the rows that share it).
"""

from __future__ import annotations

import warnings
from itertools import chain

import torch

from lit_interventions.core.progress import stage
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.causalgym import CausalGymDataModule, EmptyRegionError
from lit_interventions.interventions import FixedSubspaceIntervention
from lit_interventions.interventions.registry import FITTED, MethodSpec, kind
from lit_interventions.metrics.odds import label_ids
from lit_interventions.modules.interchange import InterchangeModule, fit_closed_form, fit_states
from lit_interventions.studies.stacked_scoring import score_stacked

CONTROL = "dog_give"  # the control task (Arora et al. 2024, §4.3)


def _region_data(task, templates, lm, region, control, sizes) -> CausalGymDataModule | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pairs where this region is empty are expected: skipped quietly
        data = CausalGymDataModule(task=task, templates=templates, lm=lm, region=region, control=control, **sizes)
        try:
            data.setup("fit")
        except EmptyRegionError:
            return None  # the region is empty in every pair: no site (any other error is the user's to see)
    return data


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
    `component` and `head`, `causalgym_components`.)"""
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
    stacked no-grad forwards of `batch_size` rows (`stacked_scoring.score_stacked`), the control
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
