"""AxBench's closed-form concept methods: a direction estimator fitted once per concept (no optimizer).

The closed forms are the direction estimators of `lit_interventions.interventions.directions`
(`diffmean`, `pca`, `lat`, `probe`, and `lda`, `kmeans`, `random`), or a user's own class with
`fit(X, y)` setting `direction_` (d,). `SteeringModule`'s `trainer.fit` runs one pass over the
training data; each step reads the residual stream at the layer (the LM is frozen) and keeps the
response tokens (`response_tokens`): a positive's tokens for its concept (token_labels), the
negatives' tokens as the shared pool H⁻. Under DDP the kept tokens of all ranks are gathered
(`gathered_tokens`). Then every concept's row w_c is one fit of the estimator (`fit_concept_rows`):

- supervised (DiffMean, probe, LDA): fit(X, y) on X = H⁺_c ∪ H⁻, y = 1 for the concept's positive
  tokens and 0 for the pool, so that e.g. DiffMean gives w_c = (mean(H⁺_c) − mean(H⁻)) / ‖·‖
  (AxBench eq. 4) and the probe min_w mean log-loss(σ(h·w)) + (l2/2)‖w‖² (eq. 5, with
  `ProbeDirection(l2=1e-3, bias=False)`);
- unsupervised (`_supervised = False`: PCA, LAT, k-means, random): fit(H⁺_c) on the concept's
  positives alone, then w_c ← sign(mean(H⁺_c)·w − mean(H⁻)·w)·w, so that the positives project at
  least as high as the pool (AxBench's code); `unsupervised_on="all"` fits them on H⁺_c ∪ H⁻ with
  y, which orients them.

Every row is unit norm (the estimators normalise) and read as the linear latent h·w.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

UNSUPERVISED_ON = ("positives", "all")


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a (n, ...) tensor of every process along dim 0 (sizes may differ)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(tensor))


def _labelled(positives: torch.Tensor, negatives: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """X = H⁺_c ∪ H⁻ (n, d) float32 and y (n,): 1 for a positive token, 0 for a negative."""
    return torch.cat([positives, negatives]).float(), np.r_[np.ones(len(positives)), np.zeros(len(negatives))]


def _direction(estimator, *data) -> torch.Tensor:
    """`direction_` of a fresh copy of `estimator` fitted on `data`, float32 (d,)."""
    fitted = copy.deepcopy(estimator).fit(*data)
    if not hasattr(fitted, "direction_"):
        raise ValueError(
            f"{type(estimator).__name__}.fit set no direction_: a direction estimator sets direction_ (d,)"
        )
    return torch.as_tensor(fitted.direction_, dtype=torch.float32)


def is_supervised(estimator) -> bool:
    """Whether the estimator's fit uses y (`_supervised`, True unless it says False)."""
    return bool(getattr(estimator, "_supervised", True))


def fit_concept_direction(
    estimator, positives: torch.Tensor, negatives: torch.Tensor, unsupervised_on: str = "positives"
) -> torch.Tensor:
    """One concept's unit direction, float32 (d,), from its positive tokens H⁺_c (n⁺, d) and the
    negative pool H⁻ (n⁻, d): a supervised estimator fitted on H⁺_c ∪ H⁻ (y 1/0); an unsupervised
    one on H⁺_c (or, `unsupervised_on="all"`, on H⁺_c ∪ H⁻ with y), oriented so that
    mean(H⁺_c)·w ≥ mean(H⁻)·w. `estimator` is copied, never fitted itself."""
    if unsupervised_on not in UNSUPERVISED_ON:
        raise ValueError(f"unsupervised_on={unsupervised_on!r}; valid: {', '.join(UNSUPERVISED_ON)}")
    if is_supervised(estimator) or unsupervised_on == "all":
        return _direction(estimator, *_labelled(positives, negatives))
    w = _direction(estimator, positives.float())
    return w if w @ (positives.float().mean(0) - negatives.float().mean(0)) >= 0 else -w


def fit_concept_rows(
    estimator, states: torch.Tensor, labels: torch.Tensor, concepts: list[str], unsupervised_on: str = "positives"
) -> torch.Tensor:
    """Every concept's row, (C, d) float32: `fit_concept_direction` of its positive tokens (label c)
    against the negative pool (label −1). `states` (n, d), `labels` (n,). A concept with fewer than 2
    positive tokens, or no negatives at all, is a ValueError."""
    negatives = states[labels == -1]
    if len(negatives) == 0:
        raise ValueError("the training data has no negative tokens: the closed-form methods need negatives")
    rows = []
    for c, name in enumerate(concepts):
        positives = states[labels == c]
        if len(positives) < 2:
            raise ValueError(
                f"concept {name!r} has {len(positives)} positive response token(s) in the "
                "training data; at least 2 are needed"
            )
        rows.append(fit_concept_direction(estimator, positives, negatives, unsupervised_on))
    return torch.stack(rows)


def response_tokens(hidden: torch.Tensor, batch: dict, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens of a batch to keep, (n, d) float32 on CPU, and their labels (n,): a
    positive's tokens with its concept, the negatives' tokens as −1. Both sides are the response
    text (`output_mask`), without the end-of-turn token that closes every response alike.
    `hidden`: the residual stream at the layer, (batch, seq, d); negatives carrying concept ids are
    refused (`method`: the method's name, for the message)."""
    text = batch["output_mask"].bool()
    positive = text & (batch["token_labels"] >= 0)
    negative = text & (batch["label"] == 0)[:, None]
    if ((batch["label"] == 0) & (batch["concept_id"] >= 0)).any():
        raise ValueError(
            f"{method} is fitted against the shared negative pool (concept_id -1); "
            "these negatives carry concept ids: set the data module's genre_negatives: false"
        )
    keep = positive | negative
    return (
        hidden[keep].float().cpu(),
        batch["token_labels"][keep].where(positive[keep], torch.full_like(batch["token_labels"][keep], -1)).cpu(),
    )


def gathered_tokens(pieces: list, hidden_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens of every process, (n, d) and their labels (n,), on CPU (`pieces`: this
    process's `response_tokens`)."""
    hidden = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, hidden_size)
    labels = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
    return _gather(hidden.to(device)).cpu(), _gather(labels.to(device)).cpu()
