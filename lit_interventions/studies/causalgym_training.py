"""The CausalGym sweep's trained methods: one multi-site loop per method and task, kept on disk.

A trained method (its spec builds an intervention with `trains` True: DAS, DBM, ...) is trained
at every layer and region of a unit together (`MultiSiteInterchangeModule`), from its
`class_path`/`init_args` per site, with its spec's lr, warmup and objective. Its loop's state is
saved as it runs (a rerun resumes it), and the trained interventions are kept per layer in
DIR/<method>/TASK_LAYER[_control].safetensors (`trained_path`), which a rerun scores instead of
training again.

A sweep of another component (`--component`) trains each site on its own instead (`train_at_site`:
what `train.py fit --model.component C [--model.head H]` trains there, one epoch), kept in the same
files, one per layer and head (`saved_at_site`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from safetensors import safe_open
from safetensors.torch import save_file

from lit_interventions.callbacks.progress import LoopProgress
from lit_interventions.callbacks.resume import SaveProgress
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.files import write_atomically
from lit_interventions.interventions.base import Intervention, import_class
from lit_interventions.interventions.registry import MethodSpec, method_spec
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.modules.multisite import MultiSiteInterchangeModule
from lit_interventions.objectives import build_objective

BASIS = "basis"  # the tensor kept under the region's name alone (DAS: {region: W})


def _module(method: MethodSpec, lm, sites, dtype, seed) -> MultiSiteInterchangeModule:
    return MultiSiteInterchangeModule(
        lm=lm,
        grid=sites,
        dtype=dtype,
        seed=seed,
        lr=method.lr,
        warmup_ratio=method.warmup_ratio,
        intervention=method.build,
        objective=build_objective(method),
    )


def one_epoch_trainer(callbacks: list | None = None) -> L.Trainer:
    """The sweep's training loop: one epoch on one device, no validation, logger or checkpoint."""
    return L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks or [],
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=1,
    )


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
    method: MethodSpec | None = None,
) -> dict:
    """A trained method (`method`, default DAS, the paper's setup) at every site of `datas`
    ({(layer, region): data module, or None for an empty region}): {(layer, region): trained
    intervention}. All sites train together in one Lightning loop (`MultiSiteInterchangeModule`:
    one stacked forward per step for every layer and region); each site gets the result it would
    get alone, for a fraction of the time. `progress`: a loop's state is saved every `every` to
    PROGRESS-<digest of its sites and setup>.ckpt, which a rerun resumes from (same result as no
    interruption) and which is deleted once the loop ends. `one_loop=False`: one loop per layer
    (kept for benchmarks/sweep_speed.py). A site where every train pair's base and source states
    are equal (`unchanged_sites`, reading `batch_size` rows at a time) keeps its initial
    intervention: there is nothing to train."""
    method = method_spec("das") if method is None else method
    datas = {site: data for site, data in datas.items() if data is not None}
    unchanged = unchanged_sites(datas, cache, batch_size)  # nothing to learn there: their initial state, untrained
    trained = _module(method, lm, sorted(unchanged), dtype, seed).trained() if unchanged else {}
    datas = {site: data for site, data in datas.items() if site not in unchanged}
    layers = sorted({layer for layer, _ in datas})
    groups = [datas] if one_loop else [{s: d for s, d in datas.items() if s[0] == layer} for layer in layers]
    for group in groups:
        if not group:
            continue
        module = _module(method, lm, list(group), dtype, seed)
        module.attach(group).share_cache(cache)
        saved = None if progress is None else progress_path(progress, module, method)
        trainer = one_epoch_trainer([LoopProgress(), *([] if saved is None else [SaveProgress(saved, every)])])
        trainer.fit(module, ckpt_path=saved if saved is not None and saved.is_file() else None, weights_only=True)
        trained |= module.trained()
        if saved is not None:
            saved.unlink(missing_ok=True)
    return trained


@torch.no_grad()
def unchanged_sites(datas: dict, cache: ActivationCache, batch_size: int = 64) -> set:
    """The sites of `datas` ({(layer, region): data module}) where every train pair's base and
    source have the same state, bit for bit: a site before the pairs' first difference, under
    causal attention. An interchange leaves such a site as it is (DAS: f* = f(b) + Wᵀ(W f(s) −
    W f(b)) = f(b)), so the task loss does not depend on the intervention there: nothing to learn."""
    device = next(cache.model.parameters()).device
    found = set()
    for (layer, region), data in datas.items():
        batches = (move_data_to_device(batch, device) for batch in data.loader("train", batch_size))
        if all(torch.equal(cache.at_site(layer, batch.base), cache.at_site(layer, batch.source)) for batch in batches):
            found.add((layer, region))
    return found


def progress_path(progress: Path, module: MultiSiteInterchangeModule, method: MethodSpec | None = None) -> Path:
    """Where `train_das` keeps the loop's progress: PROGRESS-<digest>.ckpt, the digest of what
    the loop's result depends on (its sites, LM, dtype, seed, each site's number of batches, and
    the method's spec where it is not the registered DAS), so a changed setup never resumes
    another's loop."""
    batches = [len(loader) for loader in module._frozen["loaders"].values()]
    setup = (module.grid, module.hparams.lm, module.hparams.dtype, module.hparams.seed, batches)
    if method is not None and method.loop_options() != method_spec("das").loop_options():
        setup += (method.loop_options(),)
    return progress.with_name(f"{progress.name}-{hashlib.sha256(repr(setup).encode()).hexdigest()[:12]}.ckpt")


def trained_path(
    out: Path, task: str, layer: int, control: str | None = None, method: str = "das", head: int | None = None
) -> Path:
    """Where a trained method's interventions at a task's layer (and head, in the head sweep) are
    kept: DIR/<method>/TASK_LAYER[_hHEAD][_control].safetensors."""
    at = f"{layer}" if head is None else f"{layer}_h{head}"
    return out / method / f"{task}_{at}{'' if control is None else '_' + control}.safetensors"


def read_trained(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """{region: {tensor name: tensor}} and the config a layer's file holds (key "region" is the
    region's `basis`, "region/name" its tensor `name`)."""
    if not path.is_file():
        return {}, {}
    found: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(path, "pt") as f:
        config = json.loads((f.metadata() or {}).get("config", "{}"))
        for key in f.keys():
            region, _, name = key.partition("/")
            found.setdefault(region, {})[name or BASIS] = f.get_tensor(key)
    return found, config


def write_trained(path: Path, regions: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    tensors = {
        region if name == BASIS else f"{region}/{name}": tensor.detach().float().cpu().contiguous()
        for region, named in regions.items()
        for name, tensor in named.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"config": json.dumps(config)} if config else None
    write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))  # never a half-written file


def frozen_intervention(method: MethodSpec, tensors: dict[str, torch.Tensor], config: dict):
    """The fixed intervention a trained one acts as, rebuilt from its exported tensors: by its
    class's `frozen_class` (DAS: `FixedSubspaceIntervention(W)`) or its own `from_tensors`."""
    cls = import_class(method.class_path)
    frozen = (cls.frozen_class if issubclass(cls, Intervention) else None) or cls
    return frozen.from_tensors(tensors, **config)


def saved_trained(
    paths: Callable[[int], Path],
    datas: dict,
    lm,
    cache,
    seed,
    dtype="float32",
    progress: Path | None = None,
    batch_size: int = 64,
    method: MethodSpec | None = None,
) -> dict:
    """`train_das`, kept in one file per layer (`paths(layer)`, `trained_path`: {region: its
    exported tensors}): a rerun scores the saved interventions and trains, in one loop, only the
    sites the files lack, so an interruption after training loses no training; during it, with
    `progress` (`train_das`), at most its last few minutes. {(layer, region): the fixed
    intervention each trained one acts as}."""
    method = method_spec("das") if method is None else method
    saved = {layer: read_trained(paths(layer)) for layer in {layer for layer, _ in datas}}
    missing = {(layer, region): data for (layer, region), data in datas.items() if region not in saved[layer][0]}
    if missing:
        trained = train_das(missing, lm, cache, seed, dtype, progress=progress, batch_size=batch_size, method=method)
        for layer in sorted({layer for layer, _ in trained}):
            regions, config = saved[layer]
            for (at, region), intervention in trained.items():
                if at == layer:
                    regions[region] = intervention.export()
                    config = intervention.config()
            write_trained(paths(layer), regions, config)
            saved[layer] = regions, config
    return {
        (layer, region): frozen_intervention(method, saved[layer][0][region], saved[layer][1])
        for layer, region in datas
        if region in saved[layer][0]
    }


# --- one site at a time: the sweep of another component -------------------------------------------
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
