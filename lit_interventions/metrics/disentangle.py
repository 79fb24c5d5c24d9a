"""RAVEL's metrics (Huang et al. 2024, §3): Cause, Iso and Disentangle, as torchmetrics.

- Cause: accuracy on the Cause examples (the base queries the target attribute A*; the intervened
  model must answer A*(E′) of the source entity).
- Iso: accuracy on the Iso examples (the base queries another attribute A; the answer A(E) must not
  change), the mean over the other attributes.
- Disentangle = (Cause + Iso) / 2.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lit_interventions.core.batch import CAUSE, ISO, PairBatch


class Disentanglement(Metric):
    """Counts per (kind, queried attribute): correct answers, and answers changed from the base's
    own answer (the "A changes B" matrix of the paper's Figure 3a)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_attributes: int, **kwargs):
        super().__init__(**kwargs)
        self.num_attributes = num_attributes
        for name in ("correct", "changed", "count"):
            self.add_state(name, default=torch.zeros(2, num_attributes, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        logits: torch.Tensor,
        label: torch.Tensor,
        base_label: torch.Tensor,
        attribute: torch.Tensor,
        kind: torch.Tensor,
    ) -> None:
        """logits: intervened next-token logits (batch, vocab); label: the answer the intervened
        model should give; base_label: the base's own answer; attribute: the queried attribute;
        kind: CAUSE or ISO."""
        predicted = logits.argmax(-1)
        index = kind * self.num_attributes + attribute  # flat index into (2, num_attributes)
        ones = torch.ones_like(index)
        self.correct.view(-1).index_add_(0, index, (predicted == label).long())
        self.changed.view(-1).index_add_(0, index, (predicted != base_label).long())
        self.count.view(-1).index_add_(0, index, ones)

    def compute(self) -> dict[str, torch.Tensor]:
        """cause, iso (mean over attributes with Iso examples), disentangle; iso_per_attribute and
        change_rate per attribute (NaN where there were no examples)."""
        accuracy = self.correct.double() / self.count.double()  # (2, A); NaN where count is 0
        cause_count = self.count[CAUSE].sum().clamp(min=1)
        cause = self.correct[CAUSE].sum().double() / cause_count
        iso_per_attribute = accuracy[ISO]
        has_iso = self.count[ISO] > 0
        iso = iso_per_attribute[has_iso].mean() if has_iso.any() else torch.tensor(float("nan"), dtype=torch.float64)
        change_rate = self.changed.sum(0).double() / self.count.sum(0).double()  # (A,)
        return {
            "cause": cause.float(),
            "iso": iso.float(),
            "disentangle": ((cause + iso) / 2).float(),
            "iso_per_attribute": iso_per_attribute.float(),
            "change_rate": change_rate.float(),
        }


class DevDisentangle:
    """Cause, Iso and Disentangle of one intervention over RAVEL batches (each `PairBatch`'s
    target, base label, attribute and kind): the dev score fitted interventions are chosen by."""

    def __init__(self, num_attributes: int):
        self.metric = Disentanglement(num_attributes)

    def update(self, logits: torch.Tensor, batch: PairBatch) -> None:
        fields = [t.to(logits.device) for t in (batch.target, batch.base.label, batch.attribute, batch.kind)]
        self.metric.update(logits, *fields)

    def compute(self) -> dict[str, float]:
        values = self.metric.compute()
        return {name: float(values[name]) for name in ("cause", "iso", "disentangle")}
