"""RAVEL: isolate one attribute of an entity at one site (Huang et al. 2024, §4).

The site is the residual stream after `layer` at the last token of the entity, in base and source.
A batch holds Cause examples (the base queries the target attribute A*; the label is A*(E′) of the
source entity) and, for validation and multi-task training, Iso examples (the base queries another
attribute A; the label is A(E): the answer must not change).

Methods (one intervention each):
- das:  f* = (I − WᵀW) f(b) + WᵀW f(s), W (k × d) with orthonormal rows; loss CE on Cause.
- dbm:  f* = (1 − σ(m/T)) ∘ f(b) + σ(m/T) ∘ f(s); loss CE + λ‖σ(m/T)‖₁, T annealed 1e-2 → 1e-7.
- pca, sae: featurizers (PCA of the site's train states, or a trained SAE); the features that an
  L1 logistic regression uses to predict the target attribute are swapped, f* = f(b) +
  dec(z_mix) − dec(z(b)) (`interventions/featurizers.py`); fitted when `fit` starts, not trained.
- full_swap: f* = f(s), the baseline; nothing to train.
With `multitask` (MDAS, MDBM): loss = L_Cause + mean over the other attributes of L_Iso.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_interventions.interventions.featurizers import (
    FeatureInterchange,
    FullVectorSwap,
    SAEFeaturizer,
    fit_feature_interchange,
)
from lit_interventions.interventions.mask import SigmoidMaskIntervention, linear_temperature
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.lm import DEFAULT_LM, hidden_size, load_config
from lit_interventions.metrics.disentangle import CAUSE, ISO, Disentanglement
from lit_interventions.modules.site import SiteModule

TRAINED = ("das", "dbm")
FITTED = ("pca", "sae")
METHODS = TRAINED + FITTED + ("full_swap",)


def multitask_loss(logits: torch.Tensor, label: torch.Tensor, attribute: torch.Tensor, kind: torch.Tensor,
                   multitask: bool) -> torch.Tensor:  # fmt: skip
    """L_Cause (+ with `multitask`, the mean over the attributes present of each one's L_Iso)."""
    losses = F.cross_entropy(logits.float(), label, reduction="none")  # (batch,)
    parts = []
    cause = kind == CAUSE
    if cause.any():
        parts.append(losses[cause].mean())
    if multitask:
        iso = kind == ISO
        per_attribute = [losses[iso & (attribute == a)].mean() for a in attribute[iso].unique()]
        if per_attribute:
            parts.append(torch.stack(per_attribute).mean())
    if not parts:  # a batch of Iso examples only, without multitask: nothing to learn from
        return losses.sum() * 0.0
    return torch.stack(parts).sum()


class DisentangleModule(SiteModule):
    """DAS, MDAS, DBM, MDBM or a full-vector swap at the entity site of a frozen LM.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (linked to the data module's lm).
        layer: residual stream after this block (default: the middle layer).
        method: das, dbm, pca, sae or full_swap (see the module docstring).
        multitask: add the Iso loss of the other attributes (MDAS / MDBM). Linked to the data
            module's `multitask`, which then puts Iso examples in the training batches.
        k: rank of the DAS subspace.
        l1: DBM's λ for ‖σ(m/T)‖₁ (the paper: about 1e-3 for DBM, 0 for MDBM).
        temperature_start, temperature_end: DBM's T, linear over the training steps.
        sae: the trained SAE (`sae.safetensors`, `python -m lit_interventions.modules.sae`) for
            method sae.
        max_features: at most this many features selected (pca, sae; default: no cap).
        lr, warmup_ratio: Adam, linear warmup then linear decay to 0.
        dtype, cache: as for `InterchangeModule`.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        method: str = "das",
        multitask: bool = False,
        k: int = 64,
        l1: float = 0.0,
        temperature_start: float = 1e-2,
        temperature_end: float = 1e-7,
        sae: str | None = None,
        max_features: int | None = None,
        lr: float = 1e-3,
        warmup_ratio: float = 0.1,
        dtype: str = "float32",
        cache: bool = True,
    ):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
        if l1 < 0:
            raise ValueError(f"l1={l1!r} must be >= 0")
        if not temperature_start >= temperature_end > 0:
            raise ValueError(f"temperatures must satisfy start >= end > 0, got {temperature_start!r}, {temperature_end!r}")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={warmup_ratio!r} must be in [0, 1)")
        if method == "sae" and not sae:
            raise ValueError("method='sae' needs --model.sae PATH (a trained sae.safetensors)")
        layer = self._check_site(lm, layer)
        self.save_hyperparameters()
        self.hparams.layer = layer
        d = hidden_size(load_config(lm))
        if method == "das":
            self.intervention = RotatedSpaceIntervention(d, k)
        elif method == "dbm":
            self.intervention = SigmoidMaskIntervention(d, temperature_start)
        elif method == "full_swap":
            self.intervention = FullVectorSwap()
        else:
            self.intervention = None  # fitted from the training data when fit starts
        self.attributes: list[str] = []
        self.val_metric: Disentanglement | None = None
        self.test_metric: Disentanglement | None = None

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "attributes"):
            self.set_attributes(list(datamodule.attributes))

    def set_attributes(self, attributes: list[str]) -> None:
        """The entity type's attributes, in the data module's order (for the per-attribute metrics)."""
        if attributes != self.attributes or self.val_metric is None:
            self.attributes = attributes
            self.val_metric = Disentanglement(len(attributes)).to(self.device)
            self.test_metric = Disentanglement(len(attributes)).to(self.device)

    # training

    def on_fit_start(self):
        if self.hparams.method in FITTED:
            self.intervention = self.fit_featurizer(self.trainer.datamodule)

    @torch.no_grad()
    def fit_featurizer(self, data) -> FeatureInterchange:
        """PCA (or the given SAE) on the site's states of the train split (base and source sides,
        every process the whole split), and the features an L1 logistic regression uses to
        predict the target attribute of each state's entity."""
        values = data.values(data.target_attribute)
        states, entities = [], []
        for batch in data.loader("train", data.hparams.eval_batch_size, shard=False):
            batch = self.transfer_batch_to_device(batch, self.device, 0)
            for side in ("base", "source"):
                states.append(self.site_representation(batch, side).float().cpu())
                entities += batch[f"{side}_entity"].tolist()
        labels = [values[e] for e in entities]
        featurizer = "pca" if self.hparams.method == "pca" else SAEFeaturizer.load(self.hparams.sae)
        # C is chosen on a random 20% of the states. Holding out whole entities instead (groups=)
        # asks the classifier for the country of cities it never saw: near chance for every C on
        # gemma-3-270m's built-in cities, so the smallest C (no feature at all) was chosen.
        fitted = fit_feature_interchange(torch.cat(states), labels, featurizer=featurizer,
                                         max_features=self.hparams.max_features)  # fmt: skip
        self.print(f"{self.hparams.method}: {len(fitted.selected)} of {fitted.featurizer.n_features} features "
                   f"selected (C={fitted.selection.C})")  # fmt: skip
        return fitted.to(self.device)

    def on_train_batch_start(self, batch, batch_idx):
        if self.hparams.method == "dbm":
            total = max(1, int(self.trainer.estimated_stepping_batches))
            t = linear_temperature(self.global_step, total, self.hparams.temperature_start, self.hparams.temperature_end)
            self.intervention.temperature.fill_(t)

    def training_step(self, batch, batch_idx):
        if self.hparams.method not in TRAINED:
            return None  # nothing to train: fit only runs validation
        logits = self.intervened_logits(batch)
        loss = multitask_loss(logits, batch["label"], batch["attribute"], batch["kind"], self.hparams.multitask)
        size = len(batch["label"])
        if self.hparams.method == "dbm":
            penalty = self.intervention.penalty()
            self.log("train/mask_size", penalty, batch_size=size)
            self.log("train/temperature", self.intervention.temperature, batch_size=size)
            loss = loss + self.hparams.l1 * penalty
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        return loss

    def configure_optimizers(self):
        if self.hparams.method not in TRAINED:
            return None
        return self._adam_with_linear_schedule(self.intervention.parameters(), self.hparams.lr, self.hparams.warmup_ratio)

    # evaluation

    def _evaluate(self, batch, metric: Disentanglement) -> None:
        if self.intervention is None:
            raise ValueError(f"method={self.hparams.method!r} is fitted from the training data: run `fit`, not "
                             "`validate` or `test` alone")  # fmt: skip
        metric.update(self.intervened_logits(batch), batch["label"], batch["base_label"], batch["attribute"], batch["kind"])

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, self.val_metric)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, self.test_metric)

    def _log_metric(self, metric: Disentanglement, stage: str) -> dict[str, torch.Tensor]:
        values = metric.compute()
        logged = {f"{stage}/{name}": values[name] for name in ("cause", "iso", "disentangle")}
        for a, name in enumerate(self.attributes):
            if metric.count[ISO, a] > 0:
                logged[f"{stage}/iso/{name}"] = values["iso_per_attribute"][a]
            if metric.count[:, a].sum() > 0:
                logged[f"{stage}/change/{name}"] = values["change_rate"][a]
        shown = (f"{stage}/cause", f"{stage}/iso")
        finite = {k: v for k, v in logged.items() if torch.isfinite(v)}
        self.log_dict({k: v for k, v in finite.items() if k in shown}, prog_bar=True)
        self.log_dict({k: v for k, v in finite.items() if k not in shown})
        metric.reset()
        return values

    def on_validation_epoch_end(self):
        self._log_metric(self.val_metric, "val")

    def on_test_epoch_end(self):
        self._log_metric(self.test_metric, "test")
