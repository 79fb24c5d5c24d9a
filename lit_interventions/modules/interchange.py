"""Counterfactual (interchange) training of a DAS subspace on a frozen LM.

One step (DESIGN.md "Data flow"): read f(s) at the site from a source forward that stops at the
layer; run the base forward with f(b) replaced by f*(f(b), f(s)); take logits at the last
position only; minimise −log p_{f←f*}(y_s | b, s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning import LightningModule
from transformers import get_linear_schedule_with_warmup

from lit_interventions.cache import ActivationCache
from lit_interventions.interventions import RotatedSpaceIntervention
from lit_interventions.lm import DEFAULT_LM, hidden_size, load_config, load_lm, num_layers
from lit_interventions.metrics import InterchangeOdds
from lit_interventions.sites import check_layer, logits_at, read_site


class InterchangeModule(LightningModule):
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
        cache: reuse the frozen LM's states at the layer (computed once per distinct sentence),
            so a step runs only the blocks above the site; False recomputes them every step.
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
        config = load_config(lm)  # the config only: layers are checked before weights load
        if layer is None:
            layer = num_layers(config) // 2
        check_layer(layer, num_layers(config))
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={warmup_ratio!r} must be in [0, 1)")
        self.save_hyperparameters()
        self.hparams.layer = layer
        self.intervention = RotatedSpaceIntervention(hidden_size(config), k)
        self.val_odds = InterchangeOdds()
        self.test_odds = InterchangeOdds()
        self._frozen: dict[str, torch.nn.Module] = {}  # the LM, kept out of state_dict and DDP

    @property
    def lm(self) -> torch.nn.Module:
        model = self._frozen.get("lm")
        if model is None:
            model = self._frozen["lm"] = load_lm(self.hparams.lm, self.hparams.dtype)
        if model.device != self.device:
            model.to(self.device)
        return model

    @property
    def activations(self) -> ActivationCache | None:
        if not self.hparams.cache:
            return None
        if "cache" not in self._frozen:
            self._frozen["cache"] = ActivationCache(self.lm, [self.hparams.layer])
        return self._frozen["cache"]

    def _states(self, batch, side: str) -> torch.Tensor | None:
        """The cached residual stream at the layer for one side of the batch (None: no cache)."""
        cache = self.activations
        if cache is None:
            return None
        return cache.states(self.hparams.layer, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"],
                            batch.get(f"{side}_keys"))  # fmt: skip

    def site_representation(self, batch, side: str = "source") -> torch.Tensor:
        """f(x) at the site of one side ("base" or "source") of the batch, (batch, d)."""
        states = self._states(batch, side)
        if states is None:
            return read_site(self.lm, self.hparams.layer, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"],
                             batch[f"{side}_pos"])  # fmt: skip
        return states[torch.arange(len(states), device=states.device), batch[f"{side}_pos"]]

    def intervened_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of p_{f←f*}(· | b, s) at the base's last token, (batch, vocab)."""
        source = self.site_representation(batch, "source")
        return logits_at(
            self.lm,
            batch["base_input_ids"],
            batch["base_attention_mask"],
            batch["base_last"],
            layer=self.hparams.layer,
            site_positions=batch["base_pos"],
            intervention=lambda base: self.intervention(base, source),
            start_states=self._states(batch, "base"),
        )

    def clean_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of the unintervened model p(· | b) at the base's last token, (batch, vocab)."""
        return logits_at(self.lm, batch["base_input_ids"], batch["base_attention_mask"], batch["base_last"],
                         layer=self.hparams.layer, start_states=self._states(batch, "base"))  # fmt: skip

    def share_cache(self, cache: ActivationCache) -> None:
        """Use activations already computed (a sweep computes every layer once per dataset)."""
        if self.hparams.layer not in cache.layers:
            raise ValueError(f"the cache holds layers {cache.layers}, not layer {self.hparams.layer}")
        self._frozen["cache"] = cache

    @torch.no_grad()
    def score(self, batches, interventions: dict[str, torch.nn.Module] | None = None) -> dict:
        """AvgOdds and IIA over `batches` with the validation metric: of the module's own
        intervention, or of each of `interventions` ({name: {odds, iia}}), sharing the
        unintervened forward of each batch."""
        candidates = interventions if interventions is not None else {"": self.intervention}
        metrics = {name: InterchangeOdds().to(self.device) for name in candidates}
        own = self.intervention
        try:
            for batch in batches:
                batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                clean = self.clean_logits(batch)
                for name, intervention in candidates.items():
                    self.intervention = intervention
                    metrics[name].update(clean, self.intervened_logits(batch), batch["base_label"], batch["source_label"])
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
        optimizer = torch.optim.Adam(self.intervention.parameters(), lr=self.hparams.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = get_linear_schedule_with_warmup(optimizer, int(self.hparams.warmup_ratio * total), total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
