"""CALM's competence score (Davies et al., eq. 3 and App. C.2), as a torchmetrics Metric.

C_T(M | G_T) ≈ 1/(n·m) Σ_i Σ_j overlap(M(x_i | do(Z_j)), G_T(x_i | do(Z_j))), with
overlap(A, B) = |A ∩ B| / k over top-k token predictions, averaged over k = 1..10 (§6.1), where the
task's causal graph predicts
- for an environmental property Z_j: the original prediction, G_T = top-k M(x_i), so the score is
  the top-k overlap of the intervened and the original predictions;
- for the causal property Z_c: any token *not* in the original top-k, G_T = V \\ top-k M(x_i), so
  the score is 1 − that overlap.
m is the number of properties intervened on per example (the causal one included; m = 14 in the
paper). A model whose prediction always changes (overlap 0) scores 1/m; one that never changes
(a do-nothing intervention) scores (m − 1)/m.

Optionally the output space is restricted to `candidates` (token ids), as the paper restricts it to
the task's answer vocabulary (App. B.2); k then runs to min(k_max, len(candidates)).
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def topk_overlaps(clean_logits: torch.Tensor, intervened_logits: torch.Tensor, k_max: int = 10) -> torch.Tensor:
    """|top-k(clean) ∩ top-k(intervened)| / k for k = 1..k_max, (batch, k_max). logits (batch, vocab)."""
    k_max = min(k_max, clean_logits.shape[-1])
    clean = clean_logits.float().topk(k_max, dim=-1).indices  # (batch, K)
    new = intervened_logits.float().topk(k_max, dim=-1).indices  # (batch, K)
    same = (clean[:, :, None] == new[:, None, :]).float()  # (batch, K, K): clean rank i == new rank j
    within = same.cumsum(1).cumsum(2)  # [b, i, j] = matches among clean ranks ≤ i and new ranks ≤ j
    k = torch.arange(k_max, device=within.device)
    return within[:, k, k] / (k + 1)  # (batch, K)


def competence_scores(
    clean_logits: torch.Tensor,
    intervened_logits: torch.Tensor,
    causal: torch.Tensor,
    k_max: int = 10,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (example, property) competence averaged over k = 1..k_max, (batch,).

    causal (batch,) bool: whether the intervened property is causal for the task."""
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r} must be an int >= 1")
    if clean_logits.shape != intervened_logits.shape or causal.shape != clean_logits.shape[:1]:
        raise ValueError(
            f"clean {tuple(clean_logits.shape)} and intervened {tuple(intervened_logits.shape)} logits must match "
            f"and causal must be (batch,), got {tuple(causal.shape)}"
        )
    if candidates is not None:
        clean_logits, intervened_logits = clean_logits[:, candidates], intervened_logits[:, candidates]
    overlap = topk_overlaps(clean_logits, intervened_logits, k_max).mean(-1)  # (batch,)
    return torch.where(causal.bool(), 1 - overlap, overlap)


class Competence(Metric):
    """Mean competence over (example, property) interventions; also its causal part (how often the
    prediction changed under do(Z_c)) and environmental part (how stable it stayed under do(Z_e))."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, k_max: int = 10, candidates: torch.Tensor | None = None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max={k_max!r} must be an int >= 1")
        self.k_max = k_max
        self.candidates = None if candidates is None else torch.as_tensor(candidates, dtype=torch.long)
        for part in ("all", "causal", "environmental"):
            self.add_state(f"{part}_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"{part}_count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, clean_logits: torch.Tensor, intervened_logits: torch.Tensor, causal: torch.Tensor) -> None:
        candidates = None if self.candidates is None else self.candidates.to(clean_logits.device)
        scores = competence_scores(clean_logits, intervened_logits, causal, self.k_max, candidates).double()
        causal = causal.bool()
        self.all_sum += scores.sum()
        self.all_count += scores.numel()
        self.causal_sum += scores[causal].sum()
        self.causal_count += int(causal.sum())
        self.environmental_sum += scores[~causal].sum()
        self.environmental_count += int((~causal).sum())

    def compute(self) -> dict[str, torch.Tensor]:
        def mean(part):
            total, count = getattr(self, f"{part}_sum"), getattr(self, f"{part}_count")
            return (total / count).float() if count > 0 else torch.tensor(float("nan"))

        return {"competence": mean("all"), "causal": mean("causal"), "environmental": mean("environmental")}
