"""Counterfactual (interchange) training of a DAS subspace on a frozen LM.

One step (DESIGN.md "Data flow"): read f(s) at the site from a source forward that stops at the
layer; run the base forward with f(b) replaced by f*(f(b), f(s)); take logits at the last
position only; minimise −log p_{f←f*}(y_s | b, s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_interventions.interventions import RotatedSpaceIntervention
from lit_interventions.lm import DEFAULT_LM, hidden_size, load_config
from lit_interventions.metrics import InterchangeOdds
from lit_interventions.modules.site import SiteModule


class InterchangeModule(SiteModule):
    """DAS on one site (layer, region) of a frozen LM. Only the intervention is trained and saved.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (see `lit_interventions.lm`).
        layer: residual stream after this decoder block; -1 is the embedding output. Default: the
            middle layer.
        region: template region whose last token is the site (default: the label variable). The
            data module reads it (train.py links `model.region` to `data.region`).
        k: rank of the subspace (1 = the paper's 1-D DAS).
        lr: Adam learning rate; warmup_ratio: linear warmup share, then linear decay to 0.
        dtype: the LM's dtype (float32, bfloat16, float16).
        cache: reuse the frozen LM's states at the layer, and the keys and values above it of the
            tokens before the site (computed once per distinct sentence), so a step runs only the
            blocks above the layer, from the site on; False recomputes everything every step.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        region: str | None = None,
        k: int = 1,
        lr: float = 5e-3,
        warmup_ratio: float = 0.1,
        dtype: str = "float32",
        cache: bool = True,
    ):
        super().__init__()
        layer = self._check_site(lm, layer)  # the config only: layers are checked before weights load
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={warmup_ratio!r} must be in [0, 1)")
        self.save_hyperparameters()
        self.hparams.layer = layer
        self.intervention = RotatedSpaceIntervention(hidden_size(load_config(lm)), k)
        self.val_odds = InterchangeOdds()
        self.test_odds = InterchangeOdds()

    @torch.no_grad()
    def score(self, batches, interventions: dict[str, torch.nn.Module] | None = None) -> dict:
        """AvgOdds and IIA over `batches` with the validation metric: of the module's own
        intervention, or of each of `interventions` ({name: {odds, iia}}), sharing the
        unintervened forward of each batch. Only the two labels' rows of the LM head are computed:
        the odds ratio needs no other logit (the softmax normaliser cancels)."""
        candidates = interventions if interventions is not None else {"": self.intervention}
        candidates = {name: intervention.to(self.device) for name, intervention in candidates.items()}
        metrics = {name: InterchangeOdds().to(self.device) for name in candidates}
        own = self.intervention
        try:
            for batch in batches:
                batch = self.transfer_batch_to_device(batch, self.device, 0)
                labels = torch.stack([batch["base_label"], batch["source_label"]], dim=1)  # columns 0 and 1
                base_column, source_column = torch.zeros_like(labels[:, 0]), torch.ones_like(labels[:, 0])
                clean = self.clean_logits(batch, labels)
                for name, intervention in candidates.items():
                    self.intervention = intervention
                    metrics[name].update(clean, self.intervened_logits(batch, labels), base_column, source_column)
        finally:
            self.intervention = own
        scores = {name: {k: v.item() for k, v in metric.compute().items()} for name, metric in metrics.items()}
        return scores if interventions is not None else scores[""]

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.intervened_logits(batch).float(), batch["source_label"])
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["source_label"]))
        return loss

    def _evaluate(self, batch, metric: InterchangeOdds, stage: str) -> None:
        intervened = self.intervened_logits(batch)
        clean = self.clean_logits(batch)
        metric.update(clean, intervened, batch["base_label"], batch["source_label"])
        loss = F.cross_entropy(intervened.float(), batch["source_label"])
        self.log(f"{stage}/loss", loss, batch_size=len(batch["source_label"]), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, self.val_odds, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, self.test_odds, "test")

    def _log_odds(self, metric: InterchangeOdds, stage: str) -> None:
        self.log_dict({f"{stage}/{name}": value for name, value in metric.compute().items()}, prog_bar=True)
        metric.reset()

    def on_validation_epoch_end(self):
        self._log_odds(self.val_odds, "val")

    def on_test_epoch_end(self):
        self._log_odds(self.test_odds, "test")

    def configure_optimizers(self):
        return self._adam_with_linear_schedule(self.intervention.parameters(), self.hparams.lr, self.hparams.warmup_ratio)
