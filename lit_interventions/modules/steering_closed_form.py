"""The tokens AxBench's closed-form concept methods are fitted on (no optimizer): `diffmean`, `pca`,
`lat`, `probe`, or any `ClosedFormConceptMethod`.

`SteeringModule`'s `trainer.fit` runs one pass over the training data; each step reads the
residual stream at the layer (the LM is frozen) and keeps the response tokens (`response_tokens`):
a positive's tokens for its concept (token_labels), the negatives' tokens as the shared pool H⁻.
Under DDP the kept tokens of all ranks are gathered (`gathered_tokens`) before the method's `fit`
gives every concept's row from them (`lit_interventions.interventions.concept_methods`, which
gives the formulas: DiffMean mean(H⁺_c) − mean(H⁻); PCA the top PC of H⁺_c; LAT the top PC of
normalised differences of random token pairs; probe a token-level logistic regression). All unit
norm, oriented so that H⁺_c projects higher than H⁻.
"""

from __future__ import annotations

import torch

from lit_interventions.interventions.concept_methods import ClosedFormConceptMethod
from lit_interventions.interventions.concept_registry import closed_form_methods, concept_method


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a (n, ...) tensor of every process along dim 0 (sizes may differ)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(tensor))


def fit_concept_direction(
    method: str | ClosedFormConceptMethod, positives: torch.Tensor, negatives: torch.Tensor, seed: int = 0, **options
) -> torch.Tensor:
    """One concept's unit direction from its positive tokens H⁺_c (n⁺, d) and the negative pool
    H⁻ (n⁻, d), oriented so that mean(H⁺_c)·w ≥ mean(H⁻)·w. float32 (d,). `method`: a closed-form
    concept method, or the short name of one built with `options` (e.g. "lat", pairs="all")."""
    if isinstance(method, str) and method not in closed_form_methods():
        raise ValueError(f"unknown closed-form method {method!r}; valid: {', '.join(closed_form_methods())}")
    built = concept_method(method, **options)
    if not isinstance(built, ClosedFormConceptMethod):
        raise ValueError(f"{built!r} is not a closed-form concept method")
    return built.direction(positives, negatives, seed=seed)


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
