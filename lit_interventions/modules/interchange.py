"""Interchange interventions on a frozen LM: any intervention, at a site, under any objective.

One step (DESIGN.md "Data flow"): read f(s) at the site from a source forward that stops at the
layer; run the base forward with f(b) replaced by f*(f(b), f(s)); take logits at the last
position only; apply the objective. The intervention is a `class_path` in the YAML (DAS, DBM,
PCA/SAE feature interchange, a closed-form direction, the full swap, ...), the objective a
component (CausalGym's counterfactual loss, RAVEL's Cause + Iso); validation and test return the
standard output that the data's metric callbacks score (`callbacks/metrics.py`).

Interventions are dispatched on their declared capabilities (`interventions.capabilities`). A
`Fitted` one (closed-form directions, PCA/SAE featurizers: `fit(states, labels)`) is fitted when
`fit` starts, on what `fit_states` reads (the site's states of the train split, on the sides the
data module names, and the classes it gives them: CausalGym's base states and their sentence
types, as CausalGym fits its directions and as the sweep does, by the same two functions,
`fit_states` and `fit_closed_form`); they take no optimizer step. One that is also
`DevCandidates` (RAVEL's PCA/SAE: one per L1 strength C) has each scored on the val split with
the data's `dev_metric()` (RAVEL: Disentangle) and keeps the best (`choose`); on data without one
(CausalGym) it keeps its default.

The odds are read from the two labels' logits alone (`label_logits`), by validation and test
(`OddsCallback`), by `score` and by the sweep, through the one metric (`InterchangeOdds`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
from torch import nn

from lit_interventions.core.batch import PairBatch
from lit_interventions.core.blocks import BLOCK_OUTPUT
from lit_interventions.core.forward import final_logits, read_site, run_body
from lit_interventions.core.hooks import site_hook
from lit_interventions.core.lm import DEFAULT_LM, load_config, num_layers
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.core.sites import Site
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.interventions.capabilities import (
    Annealed,
    DevCandidates,
    DirectionEstimator,
    Fitted,
    NeedsFit,
    Penalised,
    Summarised,
    Tempered,
    intervene,
    needs_source,
)
from lit_interventions.interventions.compose import Composition
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.metrics.odds import InterchangeOdds, label_ids
from lit_interventions.modules.site import SiteModule
from lit_interventions.objectives import CounterfactualLoss, Objective


class InterchangeModule(SiteModule):
    """An interchange intervention at one site (layer, region) of a frozen LM. Only the
    intervention is trained and saved.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (see `lit_interventions.core.lm`).
        layer: residual stream after this decoder block; -1 is the embedding output. Default: the
            middle layer.
        region: template region whose last token is the site (default: the label variable). The
            data module reads it (train.py links `model.region` to `data.region`).
        intervention: the intervention's class, built with the hidden size: a `class_path` and its
            `init_args` in the YAML. Default: DAS of rank `k` (`RotatedSpaceIntervention`).
        objective: the training loss. Default: −log p_{f←f*}(y_s | b, s) (CausalGym).
        k: rank of the default DAS subspace (1 = the paper's 1-D DAS).
        lr: learning rate; warmup_ratio: linear warmup share, then linear decay to 0 (Adam).
        dtype: the LM's dtype (float32, bfloat16, float16).
        cache: reuse the frozen LM's states at the layer, and the keys and values above it of the
            tokens before the site (computed once per distinct sentence), so a step runs only the
            blocks above the layer, from the site on; False recomputes everything every step.
            The cache serves one site at the block output; other sites run the full forward.
        component: where in block `layer` the site is: block_output (the residual stream),
            block_input, attention_output, mlp_output, attention_head, query, key, value or
            mlp_neuron (`sites.Site`).
        head: the head (an int) or heads (a list) of a head component (attention_head, query,
            key, value); the intervention sees head_dim × the number of heads features.
        sites: several sites intervened on together in one forward (each `Site(layer, component,
            position, region)` gets its own `intervention(d)`): a composition, e.g. DAS on the
            subject and on the object. Replaces `layer`, `region` and `component`.
        device_map: spread a frozen LM larger than one GPU over the devices (accelerate): "auto",
            "balanced", "sequential", a device, or {module name: device}; the intervention trains
            on the Trainer's device in float32. quantization: "8bit" or "4bit" frozen weights
            (bitsandbytes). max_memory: {device: size} for the strategies; offload_folder: where
            "disk" weights go. See `lit_interventions.core.sharding`.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        region: str | None = None,
        intervention: Callable[[int], nn.Module] | None = None,
        objective: Objective | None = None,
        k: int = 1,
        lr: float = 5e-3,
        warmup_ratio: float = 0.1,
        dtype: str = "float32",
        cache: bool = True,
        component: str = BLOCK_OUTPUT,
        head: int | list[int] | None = None,
        sites: list[Site] | None = None,
        device_map: str | int | dict | None = None,
        quantization: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | None = None,
    ):
        super().__init__()
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)
        if sites is not None and not sites:
            raise ValueError("sites is empty: give at least one Site, or leave it null for layer/region/component")
        sites = None if sites is None else [Site(**site) if isinstance(site, dict) else site for site in sites]
        self.sites = sites  # (the hparams keep what was given: dicts when the CLI built the module)
        layer = self._check_site(lm, sites[0].layer if sites else layer, dtype)
        config = load_config(lm)
        n_layers = num_layers(config)
        for site in sites or [Site(layer, component, head=head)]:
            site.check(n_layers, config)  # component and heads too (layer -1 has only block_output), no weights load
        self.optimizer_args = OptimizerArgs(lr=lr, warmup_ratio=warmup_ratio)  # validates both
        self.save_hyperparameters()
        self.hparams.layer = layer
        if sites is not None or component != BLOCK_OUTPUT:
            self.hparams.cache = False  # the cached fast path reads one site's block output
        build = partial(RotatedSpaceIntervention, k=k) if intervention is None else intervention
        if sites is None:
            self.intervention = build(Site(layer, component, head=head).width(config))
        else:
            self.intervention = Composition([build(site.width(config)) for site in sites])
        self.objective = CounterfactualLoss() if objective is None else objective
        self.eval_outputs: set[str] = set()  # what callbacks also need: "clean", "label_logits", "generated"

    # --- what the data supports -----------------------------------------------------------------

    def configure_callbacks(self):
        """The metric callbacks the data module lists (`metric_callbacks()`), unless the Trainer
        already has one of that type."""
        data = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(data, BenchmarkDataModule):
            return []
        present = {type(callback) for callback in self.trainer.callbacks}
        return [callback for callback in data.metric_callbacks() if type(callback) not in present]

    def check_data(self, data) -> None:
        """Refuse data this module cannot train on (the CLI calls it before any work)."""
        if self.objective.uses_iso and not getattr(data.hparams, "multitask", False):
            raise ValueError(f"objective {self.objective!r} trains on Iso examples: set --data.multitask true")
        regions = getattr(getattr(data, "template", None), "regions", None)
        for site in self.sites or []:
            if site.position == "region" and site.region is not None and regions and site.region not in regions:
                raise ValueError(
                    f"site region {site.region!r} is not a region of task {data.task!r}; regions: {', '.join(regions)}"
                )

    # --- several sites, composed ----------------------------------------------------------------

    def _positions(self, batch: PairBatch, side: str, site: Site) -> torch.Tensor:
        """The token of `site` in each row of one side: a region's last token, or the last token."""
        states = batch.side(side)
        if site.position == "last":
            return states.last
        if site.position != "region":
            raise ValueError(f"an interchange site reads one token per row, not position={site.position!r}")
        if site.region is None:
            return states.pos
        regions = states.regions
        if site.region not in regions:
            raise ValueError(
                f"region {site.region!r} is not in every {side} sentence of this batch "
                f"(found: {', '.join(regions) or 'none'})"
            )
        return regions[site.region]

    @property
    def generates(self) -> bool:
        return "generated" in self.eval_outputs

    def intervened_logits(self, batch: PairBatch, vocab: torch.Tensor | None = None) -> torch.Tensor:
        if self.sites is None:
            return super().intervened_logits(batch, vocab)
        sites = self.sites
        sources = [
            read_site(
                self.lm,
                site.layer,
                batch.source.input_ids,
                batch.source.attention_mask,
                self._positions(batch, "source", site),
                component=site.component,
                head=site.head,
            )
            if needs_source(part)
            else None
            for site, part in zip(sites, self.intervention.parts)
        ]
        with ExitStack() as stack:
            for site, part, source in zip(sites, self.intervention.parts, sources):
                stack.enter_context(
                    site_hook(
                        self.lm,
                        site.layer,
                        site.component,
                        _writer(part, source, self._positions(batch, "base", site)),
                        batch.base.input_ids.device,
                        site.head,
                    )
                )
            hidden = run_body(self.lm, batch.base.input_ids, batch.base.attention_mask).last_hidden_state
        rows = torch.arange(len(hidden), device=hidden.device)
        return final_logits(self.lm, hidden[rows, batch.base.last], vocab)

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule if self._trainer is not None else None
        if data is not None:
            self.check_data(data)

    # --- training -------------------------------------------------------------------------------

    @property
    def trains(self) -> bool:
        """Whether the intervention has parameters to learn (a fitted or fixed one has none)."""
        return any(p.requires_grad for p in self.intervention.parameters())

    def on_fit_start(self) -> None:
        if isinstance(self.intervention, Fitted):
            self.fit_intervention(self.trainer.datamodule)

    @torch.no_grad()
    def fit_intervention(self, data) -> None:
        """Fit a closed-form intervention on the site's train states and their classes
        (`fit_states`; every process reads the whole split), by `fit_closed_form`."""
        self.intervention = fit_closed_form(self.intervention, *fit_states(self, data))
        self.intervention.to(self.device)
        candidates = self.intervention.dev_candidates() if isinstance(self.intervention, DevCandidates) else {}
        if candidates and isinstance(data, BenchmarkDataModule) and data.dev_metric() is not None:
            self.intervention.choose(self.dev_scores(data, candidates))
        elif candidates:  # e.g. CausalGym: no Disentangle to choose by; the intervention's default stays
            self.print(
                f"{type(data).__name__} has no dev_metric: {type(self.intervention).__name__} keeps its "
                "default among its candidates"
            )
        if isinstance(self.intervention, Summarised):
            self.print(self.intervention.summary())

    @torch.no_grad()
    def dev_scores(self, data, candidates: dict[str, nn.Module]) -> dict[str, dict]:
        """{name: the data's `dev_metric()` of that intervention on the whole val split (fed
        its greedy answers)}."""
        metrics = {name: data.dev_metric() for name in candidates}
        own = self.intervention
        try:
            for batch in data.loader("val", data.hparams.eval_batch_size, shard=False):
                batch = self.transfer_batch_to_device(batch, self.device, 0)
                for name, candidate in candidates.items():
                    self.intervention = candidate.to(self.device)
                    metrics[name].update(self.intervened_answers(batch)[1].cpu(), batch)
        finally:
            self.intervention = own
        return {name: metric.compute() for name, metric in metrics.items()}

    def on_train_batch_start(self, batch, batch_idx):
        if isinstance(self.intervention, Annealed):  # e.g. DBM's temperature schedule
            self.intervention.anneal(self.global_step, max(1, int(self.trainer.estimated_stepping_batches)))

    def training_step(self, batch, batch_idx):
        if not self.trains:
            return None  # fitted or fixed: fit only runs validation
        logits = self.intervened_logits(batch)
        loss = self.objective(logits, batch, self.intervention)
        size = len(batch)
        if isinstance(self.intervention, Penalised):
            self.log("train/mask_size", self.intervention.penalty(), batch_size=size)
        if isinstance(self.intervention, Tempered) and torch.is_tensor(self.intervention.temperature):  # DBM's T
            self.log("train/temperature", self.intervention.temperature, batch_size=size)
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        return loss

    def configure_optimizers(self):
        if not self.trains:
            return None
        return self.optimizer_args.lightning(self.intervention.parameters(), self.trainer.estimated_stepping_batches)

    # --- evaluation -----------------------------------------------------------------------------

    def _evaluate(self, batch, stage: str) -> dict:
        """The standard output the metric callbacks read (`callbacks/metrics.py`): intervened
        logits, and where a callback needs them, clean logits, the two labels' logits and the
        greedy answer (`intervened_answers`)."""
        if isinstance(self.intervention, NeedsFit) and self.intervention.needs_fit:
            raise ValueError(
                f"{type(self.intervention).__name__} is fitted from the training data: run `fit`, not "
                "`validate` or `test` alone"
            )
        if self.generates:
            intervened, generated = self.intervened_answers(batch)
        else:
            intervened, generated = self.intervened_logits(batch), None
        clean = self.clean_logits(batch) if "clean" in self.eval_outputs else None
        labels = self.label_logits(batch) if "label_logits" in self.eval_outputs else None
        loss = self.objective.task_loss(intervened, batch)
        self.log(f"{stage}/loss", loss, batch_size=len(batch), sync_dist=True)
        return {"intervened": intervened, "clean": clean, "label_logits": labels, "generated": generated}

    def label_logits(self, batch: PairBatch, clean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(p(· | b), p*(· | b, s)) at the base's last token of the two labels alone, (batch, 2)
        each, columns y_b and y_s (`label_ids`): what the odds read. Only those rows of the LM
        head are computed (the softmax normaliser cancels in the odds ratio). `clean`: the
        unintervened ones, if already computed for this batch."""
        labels = label_ids(batch)
        if clean is None:
            clean = self.clean_logits(batch, labels)
        return clean, self.intervened_logits(batch, labels)

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test")

    @torch.no_grad()
    def score(self, batches, interventions: dict[str, torch.nn.Module] | None = None) -> dict:
        """AvgOdds and IIA over `batches`, as validation scores them (`label_logits` into
        `InterchangeOdds`, what `OddsCallback` does): of the module's own intervention, or of each
        of `interventions` ({name: {odds, iia}}), sharing the unintervened forward of each batch."""
        candidates = interventions if interventions is not None else {"": self.intervention}
        candidates = {name: intervention.to(self.device) for name, intervention in candidates.items()}
        metrics = {name: InterchangeOdds().to(self.device) for name in candidates}
        own = self.intervention
        try:
            for batch in batches:
                batch = self.transfer_batch_to_device(batch, self.device, 0)
                clean = None
                for name, intervention in candidates.items():
                    self.intervention = intervention
                    clean, intervened = self.label_logits(batch, clean)
                    metrics[name].update_labels(clean, intervened)
        finally:
            self.intervention = own
        scores = {name: {k: v.item() for k, v in metric.compute().items()} for name, metric in metrics.items()}
        return scores if interventions is not None else scores[""]


@torch.no_grad()
def fit_states(module: SiteModule, data, batch_size: int | None = None) -> tuple[torch.Tensor, list]:
    """What a closed-form intervention at `module`'s site is fitted on: the site's states on the
    train split, (n, d) float32 on the CPU, of the sides `data.FIT_SIDES` names, and their
    classes, `data.site_labels` (CausalGym: the base states and their sentence types, as
    CausalGym's code fits its directions; RAVEL: base and source states and their entity's
    target value), in the loader's order (unshuffled; every process reads the whole split).
    `batch_size`: rows per read (default: the data's `eval_batch_size`)."""
    states, labels = [], []
    for batch in data.loader("train", batch_size or data.hparams.eval_batch_size, shard=False):
        batch = module.transfer_batch_to_device(batch, module.device, 0)
        for side in data.FIT_SIDES:
            states.append(module.site_representation(batch, side).float().cpu())
            labels += data.site_labels(batch, side)
    return torch.cat(states), labels


def fit_closed_form(method: Any, states: torch.Tensor, labels: list) -> nn.Module:
    """`method` fitted on `states` and `labels` (`fit_states`), as the intervention to run: a
    `Fitted` intervention itself, a direction estimator (`DirectionEstimator`) the interchange
    on its direction (`to_intervention()`). The one fitting step of `InterchangeModule` and the
    CausalGym sweep."""
    method.fit(states, labels)
    return method.to_intervention() if isinstance(method, DirectionEstimator) else method


def _writer(intervention: nn.Module, source: torch.Tensor | None, positions: torch.Tensor):
    """A hook that replaces the states at `positions` (one per row) by f* (`intervene`: of f(b)
    and f(s), or of f(b) alone for a source-free intervention)."""

    def write(hidden):  # (batch, seq, d)
        hidden = hidden.clone()
        rows = torch.arange(len(hidden), device=hidden.device)
        hidden[rows, positions] = intervene(intervention, hidden[rows, positions], source).to(hidden.dtype)
        return hidden

    return write
