"""A trained intervention at many sites (layer, region) trained together: the sweep's whole
layer × region grid of a task in one loop. DAS by default; any `trains` intervention built from
the hidden size, with its capabilities as `InterchangeModule` gives them: an `Annealed` one (DBM's
temperature) is annealed at each of its site's steps, and the objective's sparsity λ adds λ·penalty()
of a `Penalised` one (DBM: λ‖σ(m/T)‖₁) to its site's loss.

Each site keeps its own intervention, Adam optimiser and linear schedule, and sees exactly its own
batches. One step stacks the sites' batches into one forward per region (`stacked.stacked_hidden`,
each row from its own site's column): each row enters at its own site's layer from its cached state
there, block j runs only the rows whose site is below it, so every frozen block's weights are read
once per step and region for all layers, and the LM head's (which dominate a step on a 262k-token
vocabulary) once for all. The loss is the sum
of the sites' losses, so each subspace gets exactly the gradient it would get alone: the result
equals training the sites one by one with the same seed and batch order (to float rounding).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from itertools import accumulate

import torch
from lightning.pytorch.utilities import CombinedLoader
from torch import nn

from lit_interventions.core.batch import PairBatch
from lit_interventions.core.blocks import site_layer
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.forward import final_logits, logits_at, read_layers
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config
from lit_interventions.core.loaders import ResumableLoader
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.core.stacked import stacked_hidden
from lit_interventions.interventions.capabilities import Annealed, Penalised, intervene, is_trained, needs_source
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.modules.site import SiteModule
from lit_interventions.objectives import CounterfactualLoss, Objective

SiteKey = tuple[int, str]  # (layer, region)


def site_name(layer: int, region: str) -> str:
    """The name of site (layer, region) among the module's interventions: "layer/region", with a
    dot in the region's name (a dotted template variable, `clause.verb`) written as ":", since a
    submodule's name cannot hold one."""
    return f"{layer}/{region.replace('.', ':')}"


class MultiSiteInterchangeModule(SiteModule):
    """An intervention at each site (layer, region), each trained as if alone, in one loop (see
    the module doc): the sweep's grid. `InterchangeModule` is the one-site case.

    Its sites, each trained as if alone (not composed, as `InterchangeModule`'s `sites` are): the
    grid `grid=[(layer, region), ...]`, or the regions of one layer, `layer=` and `regions=`.
    Give it the regions' data with `attach(datas)`, then `Trainer.fit(module)`. `trained()`
    returns the interventions, {(layer, region): intervention}: `intervention(d)` (default: DAS
    of rank `k`), each initialised from `seed`, as `InterchangeModule` is after
    `seed_everything(seed)`; `objective` (default `CounterfactualLoss()`; any `Objective` with a
    `row_losses`: the loss of each site is `reduce` of its own rows, plus λ·penalty() of its
    intervention for a sparsity λ). With `cache=False` (or a model whose blocks cannot run on a subset
    of rows, with a warning), each layer's sites run in their own forward instead: same results.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        grid: list[SiteKey] = (),
        layer: int | None = None,
        regions: list[str] = (),
        k: int = 1,
        lr: float = 5e-3,
        warmup_ratio: float = 0.1,
        dtype: str = "float32",
        cache: bool = True,
        seed: int = 0,
        padding_side: str = "right",
        intervention: Callable[[int], nn.Module] | None = None,
        objective: Objective | None = None,
    ):
        super().__init__()
        check_dtype(dtype)
        if grid and (regions or layer is not None):
            raise ValueError(f"give grid={list(grid)!r} or layer= and regions=, not both")
        config = load_config(lm)
        if not grid:
            if not regions:
                raise ValueError("regions is empty: name at least one region to train")
            layer = site_layer(config, layer)
            grid = [(layer, region) for region in regions]
        grid = [(site_layer(config, layer), region) for layer, region in grid]
        if len(set(grid)) != len(grid):
            raise ValueError(f"grid {grid} names a site twice: each (layer, region) once")
        self.optimizer_args = OptimizerArgs(lr=lr, warmup_ratio=warmup_ratio)  # validated before any load
        self.objective = grid_objective(objective)
        self.save_hyperparameters(ignore=["layer", "regions", "intervention", "objective"])  # plain values only
        self.hparams.grid = self.grid = sorted(grid, key=lambda site: site[0])  # stacked by layer
        self.hparams.layer = min(layer for layer, _ in self.grid)
        self.automatic_optimization = False  # one optimiser and schedule per site
        self._stacked = None  # whether the stacked forward works for this model (None: not tried yet)
        self._steps = 0  # training steps taken: the batches each site's loader has given (resumable)
        d = hidden_size(config)
        build = partial(RotatedSpaceIntervention, k=k) if intervention is None else intervention
        self.interventions = nn.ModuleDict()
        for layer, region in self.grid:
            torch.manual_seed(seed)
            self.interventions[site_name(layer, region)] = built = build(d)
            if not is_trained(built):
                raise ValueError(f"{type(built).__name__} has no parameters to train (trains is not True)")
            if self.objective.sparsity and not isinstance(built, Penalised):
                raise ValueError(
                    f"sparsity={self.objective.sparsity} needs an intervention with a penalty() (a mask); "
                    f"got {type(built).__name__}"
                )

    def trained(self) -> dict[SiteKey, nn.Module]:
        """{(layer, region): intervention}."""
        return {(layer, region): self.interventions[site_name(layer, region)] for layer, region in self.grid}

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.grid})

    @property
    def activations(self):
        if not self.hparams.cache:
            return None
        if "cache" not in self._frozen:
            self._frozen["cache"] = ActivationCache(self.lm, self.layers)
        return self._frozen["cache"]

    def share_cache(self, cache) -> None:
        """Use activations already computed at every site's layer (a sweep computes them once per task)."""
        missing = [layer for layer in self.layers if layer not in cache.layers]
        if missing:
            raise ValueError(f"the cache holds layers {cache.layers}, not layers {missing}")
        self._frozen["cache"] = cache

    def attach(self, datas: dict, batch_size: int = 4) -> MultiSiteInterchangeModule:
        """The sites' data: {region: CausalGymDataModule} (shared by the region's sites at every
        layer) or {(layer, region): ...}, set up. Training draws each site's batches shuffled in
        the order `seed` gives it."""
        found = {site: datas.get(site, datas.get(site[1])) for site in self.grid}
        missing = sorted({region for (_, region), data in found.items() if data is None})
        if missing:
            raise ValueError(f"no data for regions {missing}; given: {sorted(map(str, datas))}")
        self._frozen["loaders"] = {
            site_name(*site): data.loader("train", batch_size, shuffle=True, seed=self.hparams.seed)
            for site, data in found.items()
        }
        return self

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:  # each site's batch order comes from its own seeded loader
            raise ValueError(
                f"MultiSiteInterchangeModule runs in one process (the sweep's DAS), not in {self.trainer.world_size} "
                "DDP processes: for several GPUs, start the sweep under torchrun or srun (one GPU per rank, docs/multi-gpu.md)"
            )

    def train_dataloader(self) -> CombinedLoader:
        loaders = {
            name: ResumableLoader(loader, lambda: self._steps) for name, loader in self._frozen["loaders"].items()
        }
        return CombinedLoader(loaders, mode="max_size")  # a site with fewer pairs stops early

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["steps"] = self._steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._steps = checkpoint["steps"]  # the loaders skip the batches these steps used

    def _logits(self, stacked: PairBatch, layers: list[int], edit: Callable, groups: list[list[int]]) -> torch.Tensor:
        """Logits at the bases' last tokens with each row's site edited by `edit` (all rows at
        once, (batch, d) -> (batch, d)): one stacked forward for all layers per group of rows
        (`groups`: the row indices of each region), then the LM head
        once; or, without a cache or where it failed, one forward per layer's rows."""
        cache = self.activations
        if cache is not None and self._stacked is not False:
            try:
                logits = self._stacked_logits(stacked, layers, edit, groups)
                self._stacked = True
                return logits
            except Exception as error:  # noqa: BLE001 -- tried once per model: any failure means "not this way"
                if self._stacked:  # it worked before: a real error
                    raise
                self._stacked = False
                warnings.warn(
                    f"the stacked forward failed on {type(self.lm).__name__} ({type(error).__name__}: "
                    f"{error}); each layer's sites run in their own forward instead (same results, slower)",
                    stacklevel=2,
                )
        edited = edit(self._site_states(stacked, layers, "base"))
        logits, a = [], 0
        for layer in sorted(set(layers)):
            b = a + layers.count(layer)
            part = stacked.base.rows(range(a, b))
            rows = edited[a:b]
            start = None if cache is None else cache.states(layer, part)
            prefix = None if cache is None else cache.prefix(layer, part)
            logits.append(
                logits_at(
                    self.lm,
                    part.input_ids,
                    part.attention_mask,
                    part.last,
                    layer=layer,
                    site_positions=part.pos,
                    intervention=lambda _, rows=rows: rows,
                    start_states=start,
                    prefix=prefix,
                )
            )
            a = b
        return torch.cat(logits)

    def _stacked_logits(
        self, stacked: PairBatch, layers: list[int], edit: Callable, groups: list[list[int]]
    ) -> torch.Tensor:
        """`_logits` by `stacked.stacked_hidden`, one forward per group of rows (a region's rows
        have runs of similar length, so little padding): each row runs the blocks from its own
        site's column on (the keys and values before it are cached, `ActivationCache.row_prefix`)."""
        cache = self.activations
        base = cache.states(layers, stacked.base)
        edited = edit(base[torch.arange(len(base), device=base.device), stacked.base.pos])
        hidden = []
        for rows in groups:
            part, index = stacked.base.rows(rows), torch.tensor(rows, device=base.device)
            at = [layers[i] for i in rows]
            prefix = cache.row_prefix(min(at), part)
            hidden.append(
                stacked_hidden(
                    self.lm,
                    part.input_ids,
                    part.attention_mask,
                    part.last,
                    at,
                    part.pos,
                    lambda _, new=edited[index]: new,
                    base[index],
                    prefix,
                )
            )
        order = torch.tensor([i for rows in groups for i in rows], device=base.device)
        return final_logits(self.lm, torch.cat(hidden)[torch.argsort(order)])  # rows back in stacked order

    def _site_states(self, stacked: PairBatch, layers: list[int], side: str) -> torch.Tensor:
        """f(x) at each row's site on `side`, at the row's own layer, (batch, d)."""
        cache, states = self.activations, stacked.side(side)
        if cache is not None:
            return cache.at_site(layers, states)
        found = read_layers(self.lm, sorted(set(layers)), states.input_ids, states.attention_mask)
        return torch.stack([found[layer][i, p] for i, (layer, p) in enumerate(zip(layers, states.sites))])

    def training_step(self, batch: dict, batch_idx):
        """`batch` is {site name: its `PairBatch`, or None once that site's loader is exhausted}."""
        present = [site for site in self.grid if batch.get(site_name(*site)) is not None]
        parts = [batch[site_name(*site)] for site in present]
        stacked = PairBatch.cat(parts, self.hparams.padding_side)
        stacked = self.transfer_batch_to_device(stacked, self.device, 0)
        sizes = [len(part) for part in parts]
        bounds = [0, *accumulate(sizes)]  # site i: rows bounds[i]:bounds[i+1]
        layers = [layer for (layer, _), size in zip(present, sizes) for _ in range(size)]
        interventions = [self.interventions[site_name(*site)] for site in present]
        reads = any(needs_source(intervention) for intervention in interventions)
        source = self._site_states(stacked, layers, "source") if reads else None
        for site, intervention in zip(present, interventions):
            if isinstance(intervention, Annealed):  # at its own step of its own loader's batches
                intervention.anneal(self._steps, max(1, len(self._frozen["loaders"][site_name(*site)])))

        def edit(base):  # each site's rows through its own subspace
            return torch.cat(
                [
                    intervene(intervention, base[a:b], None if source is None else source[a:b])
                    for intervention, a, b in zip(interventions, bounds, bounds[1:])
                ]
            )

        regions = defaultdict(list)  # the rows of each region: one forward each
        for (_, region), a, b in zip(present, bounds, bounds[1:]):
            regions[region] += range(a, b)
        logits = self._logits(stacked, layers, edit, list(regions.values()))
        # per row, then each site's mean: slicing the (rows, vocab) logits per site would cost a
        # vocabulary-wide zero-filled gradient per site in the backward (sites² × rows × vocab)
        per_row = self.objective.row_losses(logits, stacked)
        losses = [self.objective.reduce(per_row[a:b], stacked.rows(range(a, b))) for a, b in zip(bounds, bounds[1:])]
        if self.objective.sparsity:  # + λ·penalty() of each site's own intervention
            losses = [loss + self.objective.sparsity * f.penalty() for loss, f in zip(losses, interventions)]
        optimizers, schedules = self.optimizers(), self.lr_schedulers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedules = schedules if isinstance(schedules, list) else [schedules]
        index = {site: i for i, site in enumerate(self.grid)}
        self.manual_backward(torch.stack(losses).sum())
        for site in present:
            optimizers[index[site]].step()
            optimizers[index[site]].zero_grad()
            schedules[index[site]].step()
        self._steps += 1
        self.log("train/loss", torch.stack(losses).mean(), prog_bar=True, batch_size=len(logits))

    def configure_optimizers(self):
        """Per site: Adam, linear warmup over `warmup_ratio` of its own steps, then decay to 0."""
        loaders = self._frozen["loaders"]
        built = [
            self.optimizer_args.build(self.interventions[site_name(*site)].parameters(), len(loaders[site_name(*site)]))
            for site in self.grid
        ]
        return [optimizer for optimizer, _ in built], [schedule for _, schedule in built]


def grid_objective(objective: Objective | None) -> Objective:
    """The loop's objective (None: −log p*(y_s), `CounterfactualLoss()`): one that gives a loss per
    row (`Objective.row_losses`), which the loop computes once on every site's rows stacked."""
    if objective is None:
        return CounterfactualLoss()
    if not isinstance(objective, Objective) or type(objective).row_losses is Objective.row_losses:
        raise ValueError(
            f"objective={objective!r}: the multi-site loop takes an Objective that defines row_losses(logits, "
            "batch), a loss per row (CounterfactualLoss, CauseIsoLoss, or your own)"
        )
    return objective
