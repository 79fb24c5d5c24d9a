"""AxBench concept detection: max-pooled, min-max normalised AUROC per concept (AxBench §3.2).

Per example: ŷ = max_i Ψ(h_i) over the scored tokens (eq. 2); the mask passed to `update` says
which tokens those are. Per concept, over the eval set: ŷ ← (ŷ − min)/(max − min), then AUROC of
ŷ against the labels; the reported number is the mean over concepts. (AUROC depends only on the
order of the scores, so the normalisation does not change it; it is kept so that
`normalised_scores` matches the paper's ŷ.)

A row labelled `UNSCORED` (−1) enters the max activation and the normalisation but not the AUROC:
AxBench's `AUCROCEvaluator` maps categories to labels with {positive: 1, negative: 0} and drops the
rows its map has no label for, which are the hard negatives (`AxBenchDataModule(hard_negatives=...)`).
"""

from __future__ import annotations

import torch
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_auroc
from torchmetrics.utilities import dim_zero_cat


def detection_mask(batch: dict, detect_on: str = "content") -> torch.Tensor:
    """The tokens detection max-pools over, (batch, seq): `content`, every real token after the
    chat prefix (AxBench's code), or `response`, the response text alone. The end-of-turn token
    the data appends after a response (`response_mask` beyond `output_mask`) is left out of both,
    as AxBench's eval inputs stop at the response text."""
    text = batch.get("output_mask", batch["response_mask"]).bool()
    if detect_on == "response" or "content_mask" not in batch:
        return text
    end_of_turn = batch["response_mask"].bool() & ~text
    return batch["content_mask"].bool() & batch["attention_mask"].bool() & ~end_of_turn


UNSCORED = -1  # the label of a row left out of the AUROC (kept in the max activation)


def sequence_scores(token_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max over the tokens where `mask` is set, (batch,); −inf for a row with no such token."""
    return token_scores.float().masked_fill(~mask.bool(), float("-inf")).amax(-1)


def min_max_normalise(scores: torch.Tensor, concept_id: torch.Tensor, num_concepts: int) -> torch.Tensor:
    """(s − min_c)/(max_c − min_c) within each concept c; 0 where a concept's scores are all equal."""
    low = torch.full((num_concepts,), float("inf"), dtype=scores.dtype, device=scores.device)
    high = torch.full((num_concepts,), float("-inf"), dtype=scores.dtype, device=scores.device)
    low = low.scatter_reduce(0, concept_id, scores, "amin")
    high = high.scatter_reduce(0, concept_id, scores, "amax")
    span = (high - low)[concept_id]
    return torch.where(span > 0, (scores - low[concept_id]) / span.clamp(min=1e-30), torch.zeros_like(scores))


def per_concept_shapes(result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`ConceptAUROC`'s result with its per-concept values as (C,) tensors: torchmetrics squeezes a
    one-element result to a scalar, so one concept's `auroc_per_concept` and `max_score` come back
    0-d from `compute()`."""
    return {**result, **{key: result[key].reshape(-1) for key in ("auroc_per_concept", "max_score")}}


class ConceptAUROC(Metric):
    """Mean over concepts of the AUROC of max-pooled detection scores.

    update(token_scores (B, T), mask (B, T), concept_id (B,), label (B,)): token_scores are Ψ(h_i)
    of each row's own concept (the concept it is evaluated for); mask selects the scored tokens
    (the response, or every token after the chat prefix); label is 1 for a positive, 0 for a
    negative, `UNSCORED` (−1) for a row that counts toward `max_score` but not the AUROC (a hard
    negative, as AxBench). Rows with no scored token (a response truncated away) are left out and
    counted in `skipped`.

    compute() -> {"auroc": mean over the concepts that have both labels (NaN if none),
    "auroc_per_concept": (C,) with NaN where a concept lacks positives or negatives,
    "max_score": (C,) the largest raw sequence score per concept over all its rows, unscored ones
    included (its max activation on the eval set; NaN where a concept has no rows)}. States are concatenated across processes (DDP).
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_concepts: int, **kwargs):
        super().__init__(**kwargs)
        if num_concepts < 1:
            raise ValueError(f"num_concepts must be >= 1; got {num_concepts}")
        self.num_concepts = num_concepts
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("concept_id", default=[], dist_reduce_fx="cat")
        self.add_state("label", default=[], dist_reduce_fx="cat")
        self.add_state("skipped", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(
        self, token_scores: torch.Tensor, mask: torch.Tensor, concept_id: torch.Tensor, label: torch.Tensor
    ) -> None:
        if token_scores.shape != mask.shape or token_scores.dim() != 2:
            raise ValueError(
                f"token_scores and mask must both be (batch, seq); got {tuple(token_scores.shape)} "
                f"and {tuple(mask.shape)}"
            )
        concept_id, label = concept_id.long(), label.long()
        if concept_id.numel() and (concept_id.min() < 0 or concept_id.max() >= self.num_concepts):
            raise ValueError(
                f"concept_id must be in 0..{self.num_concepts - 1} (the concept each row is evaluated "
                f"for); got values {sorted(set(concept_id.tolist()))[:10]}"
            )
        if not set(label.unique().tolist()) <= {UNSCORED, 0, 1}:
            raise ValueError(
                f"label must be 0 (negative), 1 (positive) or {UNSCORED} (left out of the AUROC); "
                f"got {sorted(set(label.tolist()))}"
            )
        scores = sequence_scores(token_scores, mask)
        keep = torch.isfinite(scores)
        self.skipped += (~keep).sum()
        self.scores.append(scores[keep])
        self.concept_id.append(concept_id[keep])
        self.label.append(label[keep])

    def _states(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(self.scores, list) and not self.scores:
            empty = torch.zeros(0, device=self.device)
            return empty, empty.long(), empty.long()
        return dim_zero_cat(self.scores), dim_zero_cat(self.concept_id), dim_zero_cat(self.label)

    def normalised_scores(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ŷ min-max normalised per concept, concept_id, label) for every row seen."""
        scores, concept_id, label = self._states()
        return min_max_normalise(scores, concept_id, self.num_concepts), concept_id, label

    def compute(self) -> dict[str, torch.Tensor]:
        normalised, concept_id, label = self.normalised_scores()
        raw = self._states()[0]
        per_concept = torch.full((self.num_concepts,), float("nan"), device=raw.device)
        max_score = torch.full((self.num_concepts,), float("-inf"), device=raw.device)
        max_score = max_score.scatter_reduce(0, concept_id, raw, "amax")
        max_score[torch.isinf(max_score)] = float("nan")
        for c in concept_id.unique().tolist():
            rows = (concept_id == c) & (label != UNSCORED)
            if 0 < label[rows].sum() < rows.sum():
                per_concept[c] = binary_auroc(normalised[rows], label[rows])
        valid = ~torch.isnan(per_concept)
        mean = per_concept[valid].mean() if valid.any() else torch.tensor(float("nan"), device=raw.device)
        return {"auroc": mean, "auroc_per_concept": per_concept, "max_score": max_score}
