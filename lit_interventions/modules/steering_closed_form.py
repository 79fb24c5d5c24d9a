"""AxBench's closed-form concept directions (no optimizer): `diffmean`, `pca`, `lat`, `probe`.

`SteeringModule`'s `trainer.fit` runs one pass over the training data; each step reads the
residual stream at the layer (the LM is frozen) and keeps the response tokens (`response_tokens`):
a positive's tokens for its concept (token_labels), the negatives' tokens as the shared pool H⁻.
Each concept's row is then fitted with scikit-learn (`lit_interventions.interventions.directions`,
`fit_concept_direction`): DiffMean mean(H⁺_c) − mean(H⁻); PCA top PC of H⁺_c; LAT top PC of
normalised differences of random pairs of H⁺_c (AxBench's code; `lat_pairs: all` draws them from
H⁺_c ∪ H⁻); probe a logistic regression of token labels on H⁺_c ∪ H⁻ (sklearn SAGA, L2
`probe_l2` on the mean log-loss, the weight decay of AxBench's trained probe). All unit norm,
oriented so that H⁺_c projects higher than H⁻. Under DDP the kept tokens of all ranks are
gathered before the fit (`gathered_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from lit_interventions.interventions.directions import METHODS as DIRECTIONS
from lit_interventions.interventions.directions import LATDirection, PCADirection

CLOSED_FORM = ("diffmean", "pca", "lat", "probe")


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a (n, ...) tensor of every process along dim 0 (sizes may differ)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(tensor))


def fit_concept_direction(
    method: str, positives: torch.Tensor, negatives: torch.Tensor, seed: int = 0, **kwargs
) -> torch.Tensor:
    """One concept's unit direction from its positive tokens H⁺_c (n⁺, d) and the negative pool
    H⁻ (n⁻, d), oriented so that mean(H⁺_c)·w ≥ mean(H⁻)·w. float32 (d,)."""
    if method not in CLOSED_FORM:
        raise ValueError(f"unknown closed-form method {method!r}; valid: {', '.join(CLOSED_FORM)}")
    lat_pairs = kwargs.pop("lat_pairs", "positives")
    if method == "pca" or (method == "lat" and lat_pairs == "positives"):
        # PCA: the top PC of the positives alone; LAT: of normalised differences of random pairs of
        # the positives (AxBench's code); oriented by the negatives
        estimator = PCADirection(random_state=seed) if method == "pca" else LATDirection(random_state=seed)
        w = estimator.fit(positives.float()).direction_
        return w if w @ (positives.float().mean(0) - negatives.float().mean(0)) >= 0 else -w
    if method == "probe" and kwargs.get("l2") is not None:  # λ on the mean log-loss -> sklearn's sum scale
        kwargs["strength"] = kwargs.pop("l2") * (len(positives) + len(negatives))
    kwargs.pop("l2", None)
    X = torch.cat([positives, negatives]).float()
    y = np.r_[np.ones(len(positives)), np.zeros(len(negatives))]
    seeded = {"random_state": seed} if "random_state" in DIRECTIONS[method]().get_params() else {}
    return DIRECTIONS[method](**seeded, **kwargs).fit(X, y).direction_


def response_tokens(hidden: torch.Tensor, batch: dict, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens of a batch to keep, (n, d) float32 on CPU, and their labels (n,): a
    positive's tokens with its concept, the negatives' tokens as −1. `hidden`: the residual stream
    at the layer, (batch, seq, d); negatives carrying concept ids are refused for `method`."""
    response = batch["response_mask"].bool()
    positive = response & (batch["token_labels"] >= 0)
    negative = response & (batch["label"] == 0)[:, None]
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


def concept_directions(
    method: str, hidden: torch.Tensor, labels: torch.Tensor, concepts: list[str], seed: int, **options
) -> Iterator[tuple[int, torch.Tensor]]:
    """(c, w_c) for each concept in turn: its unit direction from its positive tokens (label c)
    against the negative pool (label −1) (`fit_concept_direction`). A concept with fewer than 2
    positive tokens, or no negatives at all, is a ValueError."""
    negatives = hidden[labels == -1]
    if len(negatives) == 0:
        raise ValueError("the training data has no negative tokens: the closed-form methods need negatives")
    for c, name in enumerate(concepts):
        positives = hidden[labels == c]
        if len(positives) < 2:
            raise ValueError(
                f"concept {name!r} has {len(positives)} positive response token(s) in the "
                "training data; at least 2 are needed"
            )
        yield c, fit_concept_direction(method, positives, negatives, seed=seed, **options)
