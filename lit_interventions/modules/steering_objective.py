"""The objective of AxBench's trained concept methods (automatic optimization, AdamW + linear schedule).

`SteeringModule` runs the frozen LM with the trained dictionary's Φ (its `forward` with no
factor) written at the layer on the rows it trains (`trained_rows`) and takes −log p(response) of
those rows; a `Penalised` one (ReFT-r1) adds λ_t·`penalty()`, its L1 term. The formulas are the
dictionaries' own (`lit_interventions.interventions.additive`):

- ReFT-r1: Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c, loss −log p(response) +
  λ·Σ_{non-top-k}|latent| (AxBench eqs. 9–10), λ ramped up from 0 (`l1_ramp`); by default
  (`train_on_negative`) each concept also trains on the genre-matched negatives, which needs
  the data module's `genre_negatives: true`.
- SSV: Φ(h_i) = h_i + w_c on a positive; loss −log p(response) (AxBench eqs. 6–7).

The finetuned baselines (LoReFT, LoRA; `steering_finetuned`) take −log p(response) of the
positive rows alone (`lm_loss`).

Here: where a trained method intervenes, runs the TopK and sums the L1 term (`intervention_mask`):
every token after the chat prefix (`content_mask`: BOS, the template's system turn and user
header get no intervention and never enter the TopK; AxBench's `exclude_bos`), or every real
token with `exclude_prefix: false`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_interventions.core.forward import final_logits, run_body


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


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean −log p(token) over response tokens (response_mask) of the positive rows (label 1).

    Logits are computed only where the loss needs them (the next token of a response token)."""
    keep = batch["label"] == 1
    ids, mask, targets = batch["input_ids"][keep], batch["attention_mask"][keep], batch["response_mask"][keep]
    if not keep.any() or not targets[:, 1:].any():
        raise ValueError("the batch holds no positive response tokens (label 1 with response_mask 1)")
    hidden = run_body(model, ids, mask).last_hidden_state  # (b, T, d), on the device of ids
    predict = targets[:, 1:].bool()  # position t predicts token t + 1
    logits = final_logits(model, hidden[:, :-1][predict])  # (n, vocab)
    return F.cross_entropy(logits.float(), ids[:, 1:][predict])
