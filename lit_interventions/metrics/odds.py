"""CausalGym's log odds-ratio and interchange intervention accuracy (IIA): one metric, which
every CausalGym score goes through (`OddsCallback` at validation and test,
`InterchangeModule.score`, the sweep's stacked scoring), each updating it with the logits of
the two labels alone (`label_ids`, `InterchangeOdds.update_labels`)."""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lit_interventions.core.batch import PairBatch


def _gap(logits: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """log p(first) − log p(second): the softmax normaliser cancels, so logits suffice."""
    return logits.gather(-1, first[:, None])[:, 0] - logits.gather(-1, second[:, None])[:, 0]


def label_ids(batch: PairBatch) -> torch.Tensor:
    """Each row's (y_b, y_s) token ids, (batch, 2): the only rows of the LM head the odds read
    (`final_logits(..., vocab=label_ids(batch))` gives the label logits, columns y_b and y_s)."""
    return torch.stack([batch.base.label, batch.source.label], dim=1)


def log_odds_ratio(
    base_logits: torch.Tensor, intervened_logits: torch.Tensor, base_label: torch.Tensor, source_label: torch.Tensor
) -> torch.Tensor:
    """Per example: log[ p(y_b|b)/p(y_s|b) · p*(y_s|b,s)/p*(y_b|b,s) ] (CausalGym eq. 18), (batch,).

    0 means the intervention had no effect; positive means it moved the prediction toward y_s.
    """
    return _gap(base_logits.float(), base_label, source_label) + _gap(
        intervened_logits.float(), source_label, base_label
    )


class InterchangeOdds(Metric):
    """AvgOdds (mean log odds-ratio) and IIA (fraction where p* ranks y_s above y_b)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("odds_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("iia_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        base_logits: torch.Tensor,
        intervened_logits: torch.Tensor,
        base_label: torch.Tensor,
        source_label: torch.Tensor,
    ) -> None:
        odds = log_odds_ratio(base_logits, intervened_logits, base_label, source_label)
        flipped = _gap(intervened_logits.float(), source_label, base_label) > 0
        self.odds_sum += odds.double().sum()
        self.iia_sum += flipped.double().sum()
        self.count += odds.numel()

    def update_labels(self, clean: torch.Tensor, intervened: torch.Tensor) -> None:
        """`update` from label logits: `clean` and `intervened` (batch, ≥ 2) hold the logits of
        y_b in column 0 and of y_s in column 1 (`label_ids`), p(· | b) and p*(· | b, s)."""
        columns = torch.arange(2, device=clean.device).expand(len(clean), 2)
        self.update(clean, intervened, columns[:, 0], columns[:, 1])

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.count.clamp(min=1).double()
        return {"odds": (self.odds_sum / count).float(), "iia": (self.iia_sum / count).float()}
