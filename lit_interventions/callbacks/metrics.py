"""Each benchmark's scoring as a Lightning callback holding its torchmetrics (synced under DDP).

An interchange module's `validation_step` / `test_step` returns the standard output
`{"intervened": (batch, vocab) logits at the base's last token, "clean": the same unintervened,
or None, "label_logits": (p(· | b), p*(· | b, s)) of the two labels alone, (batch, 2) each
(`metrics.odds.label_ids`), or None, "generated": (batch, n) the intervened model's greedy
tokens (`modules.generation`), or None}`; the optional entries are computed when a callback `needs`
them. A callback reads the output with the batch, updates its metric and logs at the epoch's end.
A data module lists the callbacks its data supports (`metric_callbacks()`), and the module adds
them to the Trainer (`configure_callbacks`), so one method is scored by any benchmark's metric.
"""

from __future__ import annotations

import re

import torch
from lightning import Callback

from lit_interventions.core.batch import ISO
from lit_interventions.metrics.detection import ConceptAUROC, per_concept_shapes
from lit_interventions.metrics.disentangle import Disentanglement
from lit_interventions.metrics.odds import InterchangeOdds

STAGES = ("validation", "test")
PREFIX = {"validation": "val", "test": "test"}


class _MetricCallback(Callback):
    """One metric per stage, created on the module's device; `needs` names the optional entries
    of the standard output it reads ("clean", "label_logits"), which the module then computes."""

    needs: tuple[str, ...] = ()

    def __init__(self):
        self.metrics: dict[str, torch.nn.Module] = {}

    def make_metric(self, trainer, pl_module) -> torch.nn.Module:
        raise NotImplementedError

    def update(self, metric, outputs: dict, batch: dict) -> None:
        raise NotImplementedError

    def log_values(self, pl_module, values: dict, prefix: str, metric) -> None:
        raise NotImplementedError

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.needs:
            pl_module.eval_outputs.update(self.needs)
        self.metrics = {}

    def _metric(self, stage, trainer, pl_module):
        """The stage's metric, made on first use (a module may learn its concepts in configure_model)."""
        if stage not in self.metrics:
            self.metrics[stage] = self.make_metric(trainer, pl_module)
        return self.metrics[stage].to(pl_module.device)

    def _batch_end(self, stage, trainer, pl_module, outputs, batch):
        if outputs is not None:
            self.update(self._metric(stage, trainer, pl_module), outputs, batch)

    def _epoch_end(self, stage, trainer, pl_module):
        metric = self._metric(stage, trainer, pl_module)
        self.log_values(pl_module, metric.compute(), PREFIX[stage], metric)
        metric.reset()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._batch_end("validation", trainer, pl_module, outputs, batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._batch_end("test", trainer, pl_module, outputs, batch)

    def on_validation_epoch_end(self, trainer, pl_module):
        self._epoch_end("validation", trainer, pl_module)

    def on_test_epoch_end(self, trainer, pl_module):
        self._epoch_end("test", trainer, pl_module)


class OddsCallback(_MetricCallback):
    """CausalGym: AvgOdds, the mean log odds-ratio (eq. 18), and IIA, logged as `val/odds`, `val/iia`,
    from the two labels' logits (`label_logits`): the same metric, fed the same way, as
    `InterchangeModule.score` and the sweep's scoring."""

    needs = ("label_logits",)

    def make_metric(self, trainer, pl_module):
        return InterchangeOdds()

    def update(self, metric, outputs, batch):
        metric.update_labels(*outputs["label_logits"])

    def log_values(self, pl_module, values, prefix, metric):
        pl_module.log_dict({f"{prefix}/{name}": value for name, value in values.items()}, prog_bar=True)


class DisentangleCallback(_MetricCallback):
    """RAVEL: Cause, Iso and Disentangle = (Cause + Iso)/2, per queried attribute too (`val/iso/A`)
    and the change rate of each attribute's answer (`val/change/A`), from the intervened model's
    greedy answers (`generated`). The attributes come from the data module's `attributes`;
    `group_attribute` and `average` go to `Disentanglement`."""

    needs = ("generated",)

    def __init__(self, group_attribute: list[int] | None = None, average: str = "templates"):
        super().__init__()
        self.group_attribute, self.average = group_attribute, average

    def make_metric(self, trainer, pl_module):
        self.attributes = list(trainer.datamodule.attributes)
        return Disentanglement(len(self.attributes), self.group_attribute, self.average)

    def update(self, metric, outputs, batch):
        metric.update_batch(outputs["generated"], batch)

    def log_values(self, pl_module, values, prefix, metric):
        logged = {f"{prefix}/{name}": values[name] for name in ("cause", "iso", "disentangle")}
        count = values["count"]  # (2, A)
        for a, name in enumerate(self.attributes):
            if count[ISO, a] > 0:
                logged[f"{prefix}/iso/{name}"] = values["iso_per_attribute"][a]
            if count[:, a].sum() > 0:
                logged[f"{prefix}/change/{name}"] = values["change_rate"][a]
        shown = (f"{prefix}/cause", f"{prefix}/iso")
        finite = {k: v for k, v in logged.items() if torch.isfinite(v)}
        pl_module.log_dict({k: v for k, v in finite.items() if k in shown}, prog_bar=True)
        pl_module.log_dict({k: v for k, v in finite.items() if k not in shown})


class AUROCCallback(_MetricCallback):
    """AxBench detection: each row's token scores Ψ(h_i) max-pooled (over the output's `pool_mask`,
    else the response), min-max normalised per concept,
    AUROC per concept (`val/auroc/<concept>`) and their mean (`val/auroc`). The module's
    `record_detection(stage, result)` receives the result (its max activations)."""

    def make_metric(self, trainer, pl_module):
        return ConceptAUROC(len(pl_module.concepts))

    def update(self, metric, outputs, batch):
        mask = outputs.get("pool_mask")  # which tokens the module pools over; default the response
        metric.update(
            outputs["token_scores"],
            batch["response_mask"] if mask is None else mask,
            batch["concept_id"],
            batch["label"],
        )

    def log_values(self, pl_module, result, prefix, metric):
        result = per_concept_shapes(result)
        values = {f"{prefix}/auroc": result["auroc"]}
        for name, value in zip(pl_module.concepts, result["auroc_per_concept"]):
            values[f"{prefix}/auroc/{safe_name(name)}"] = value
        pl_module.log_dict({k: v.float() for k, v in values.items()})
        record = getattr(pl_module, "record_detection", None)
        if record is not None:
            record(prefix, result)


def safe_name(name: str) -> str:
    """A concept name as a metric key: no slashes, runs of other characters kept readable."""
    return re.sub(r"\s+", " ", name.replace("/", "∕")).strip()
