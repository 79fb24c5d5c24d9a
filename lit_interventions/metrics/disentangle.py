"""RAVEL's metrics (Huang et al. 2024, §3): Cause, Iso and Disentangle, as torchmetrics.

An answer is right when the intervened model's greedy generation starts with the label's tokens
(the official `compute_metrics`: the label's first n tokens, n = 3, each equal to the generated
token at its place; a label shorter than n is checked on its own tokens only). n = 1 is the
first-token rule (the argmax next token against the label's first token).

- Cause: accuracy on the Cause examples (the base queries the target attribute A*; the intervened
  model must answer A*(E′) of the source entity).
- Iso: accuracy on the Iso examples (the base queries another attribute A; the answer A(E) must not
  change), the mean over the other attributes.
- Disentangle = (Cause + Iso) / 2.

`average="templates"` (the official `compute_disentangle_score`): an attribute's accuracy is the
mean over its prompt templates of each template's accuracy, and Cause / Iso the mean over the
attributes with examples of that kind. `average="examples"` pools an attribute's examples instead.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lit_interventions.core.batch import CAUSE, ISO, PairBatch

AVERAGES = ("templates", "examples")


def answer_hits(generated: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether each generation starts with its label: generated (batch, n) token ids (or (batch,)),
    labels (batch, m) token ids, −100 (or any negative id) past a shorter label (or (batch,)).
    A row is right when every label token equals the generated token at its place (the official
    `compute_metrics`, padding counted as a match); m > n is refused."""
    generated = generated.reshape(len(generated), -1)
    labels = labels.reshape(len(labels), -1)
    if labels.shape[1] > generated.shape[1]:
        raise ValueError(f"labels of {labels.shape[1]} tokens against generations of {generated.shape[1]}")
    match = (generated[:, : labels.shape[1]] == labels) | (labels < 0)
    return match.all(-1)


class Disentanglement(Metric):
    """Counts per (kind, template): right answers, answers changed from the base's own answer (the
    "A changes B" matrix of the paper's Figure 3a), and examples.

    Args:
        num_attributes: the attributes of the data.
        group_attribute: the attribute of each template (the `group` a batch gives each row);
            None: one group per attribute (then `group` is not needed).
        average: "templates" (the official mean over templates within an attribute) or "examples".
    """

    full_state_update = False
    higher_is_better = True

    def __init__(
        self, num_attributes: int, group_attribute: list[int] | None = None, average: str = "templates", **kwargs
    ):
        super().__init__(**kwargs)
        if average not in AVERAGES:
            raise ValueError(f"average={average!r}; choose one of {', '.join(AVERAGES)}")
        groups = list(range(num_attributes)) if group_attribute is None else list(group_attribute)
        if any(not 0 <= a < num_attributes for a in groups):
            raise ValueError(f"group_attribute holds attributes outside 0..{num_attributes - 1}: {groups}")
        self.num_attributes, self.average, self.by_attribute = num_attributes, average, group_attribute is None
        self.register_buffer("group_attribute", torch.tensor(groups, dtype=torch.long), persistent=False)
        for name in ("correct", "changed", "count"):
            self.add_state(name, default=torch.zeros(2, len(groups), dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        generated: torch.Tensor,
        label: torch.Tensor,
        base_label: torch.Tensor,
        attribute: torch.Tensor,
        kind: torch.Tensor,
        group: torch.Tensor | None = None,
    ) -> None:
        """generated: the intervened model's greedy tokens, (batch, n) (or (batch,)); label: the
        answer it should give, base_label: the base's own answer, (batch, m) with −100 past a
        shorter answer (or (batch,)); attribute: the queried attribute; kind: CAUSE or ISO;
        group: each row's template (None: the attribute)."""
        if group is None:
            if not self.by_attribute:
                raise ValueError("this metric averages over templates: give each row's group (template)")
            group = attribute
        index = kind * self.group_attribute.numel() + group  # flat index into (2, groups)
        self.correct.view(-1).index_add_(0, index, answer_hits(generated, label).long())
        self.changed.view(-1).index_add_(0, index, (~answer_hits(generated, base_label)).long())
        self.count.view(-1).index_add_(0, index, torch.ones_like(index))

    def update_batch(self, generated: torch.Tensor, batch: PairBatch) -> None:
        """From a RAVEL `PairBatch`: its `answers` (else `target` and the base's label), attribute,
        kind and `group`."""
        if batch.answers is not None:
            label, base_label = batch.answers[:, 0], batch.answers[:, 1]
        else:
            label, base_label = batch.target, batch.base.label
        group = batch.group if not self.by_attribute else None
        fields = [t if t is None else t.to(generated.device) for t in (label, base_label, batch.attribute, batch.kind)]
        self.update(generated, *fields, None if group is None else group.to(generated.device))

    def _per_attribute(self, name: str) -> torch.Tensor:
        """(2, A) sums of a state over each attribute's templates."""
        state = getattr(self, name)
        out = torch.zeros(2, self.num_attributes, dtype=torch.long, device=state.device)
        return out.index_add_(1, self.group_attribute.to(state.device), state)

    def compute(self) -> dict[str, torch.Tensor]:
        """cause, iso (mean over attributes with Iso examples), disentangle; iso_per_attribute and
        change_rate per attribute (pooled over its examples; NaN where there were none)."""
        count = self._per_attribute("count")
        if self.average == "templates":
            accuracy = self.correct.double() / self.count.double()  # (2, G); NaN where count is 0
            seen = self.count > 0
            sums = torch.zeros(2, self.num_attributes, dtype=torch.float64, device=accuracy.device)
            sums.index_add_(1, self.group_attribute.to(accuracy.device), torch.where(seen, accuracy, 0.0))
            templates = torch.zeros_like(count).index_add_(1, self.group_attribute.to(seen.device), seen.long())
            per_attribute = sums / templates.double()  # (2, A): mean over templates
            has_cause = count[CAUSE] > 0
            cause = per_attribute[CAUSE][has_cause].mean() if has_cause.any() else _nan()
        else:
            per_attribute = self._per_attribute("correct").double() / count.double()  # (2, A)
            cause = self.correct[CAUSE].sum().double() / self.count[CAUSE].sum().clamp(min=1)
        iso_per_attribute = per_attribute[ISO]
        has_iso = count[ISO] > 0
        iso = iso_per_attribute[has_iso].mean() if has_iso.any() else _nan()
        change_rate = self._per_attribute("changed").sum(0).double() / count.sum(0).double()  # (A,)
        return {
            "cause": cause.float(),
            "iso": iso.float(),
            "disentangle": ((cause + iso) / 2).float(),
            "iso_per_attribute": iso_per_attribute.float(),
            "change_rate": change_rate.float(),
            "count": count,
        }


def _nan() -> torch.Tensor:
    return torch.tensor(float("nan"), dtype=torch.float64)


class DevDisentangle:
    """Cause, Iso and Disentangle of one intervention over RAVEL batches (`Disentanglement.
    update_batch`): the dev score fitted interventions are chosen by."""

    def __init__(self, num_attributes: int, group_attribute: list[int] | None = None, average: str = "templates"):
        self.metric = Disentanglement(num_attributes, group_attribute, average)

    def update(self, generated: torch.Tensor, batch: PairBatch) -> None:
        """generated: the intervened model's greedy tokens for the batch, (batch, n)."""
        self.metric.update_batch(generated, batch)

    def compute(self) -> dict[str, float]:
        values = self.metric.compute()
        return {name: float(values[name]) for name in ("cause", "iso", "disentangle")}
