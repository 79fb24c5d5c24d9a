"""The objective of AxBench's trained concept methods (automatic optimization, AdamW + linear schedule).

`SteeringModule` runs the frozen LM with the method's Φ written at the layer on the rows the
method trains (`trained_rows`, `intervention`) and takes −log p(response) of those rows; a
`L1Penalised` method (ReFT-r1) adds λ·its L1 term. The formulas are the methods' own
(`lit_interventions.interventions.concept_methods`):

- ReFT-r1: Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c, loss −log p(response) +
  λ·Σ_{non-top-k}|latent| (AxBench eqs. 9–10), λ ramped up from 0 (`l1_ramp`); by default
  (`train_on_negative`) each concept also trains on the genre-matched negatives, which needs
  the data module's `genre_negatives: true`.
- SSV: Φ(h_i) = h_i + w_c on a positive; loss −log p(response) (AxBench eqs. 6–7).

Here: where a trained method intervenes, runs the TopK and sums the L1 term (`intervention_mask`):
every token after the chat prefix (`content_mask`: BOS, the template's system turn and user
header get no intervention and never enter the TopK; AxBench's `exclude_bos`), or every real
token with `exclude_prefix: false`.
"""

from __future__ import annotations

import torch


def intervention_mask(batch: dict, exclude_prefix: bool) -> torch.Tensor:
    """Where the trained methods intervene, run the TopK and sum the L1 term, (batch, seq): every
    token after the chat prefix (AxBench's `exclude_bos`, `intervention_positions: all`), or
    every real token with `exclude_prefix: false`."""
    if exclude_prefix:
        if "content_mask" not in batch:
            raise ValueError(
                "exclude_prefix=True needs the batch's content_mask (AxBenchDataModule); "
                "pass exclude_prefix=False to intervene on every token"
            )
        return batch["content_mask"].bool() & batch["attention_mask"].bool()
    return batch["attention_mask"].bool()
