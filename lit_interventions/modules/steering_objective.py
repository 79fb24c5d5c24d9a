"""The objective of AxBench's trained methods (automatic optimization, AdamW + linear schedule):

- `reft_r1`: Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c at every token after the chat prefix
  (`content_mask`: BOS, the template's system turn and user header get no intervention and never
  enter the TopK; AxBench's `exclude_bos`), loss −log p(response) + λ·Σ_{non-top-k}|latent|
  (AxBench eqs. 9–10). The L1 term is a per-sequence mean over the same tokens (AxBench's code;
  λ is on that scale), λ ramped up linearly from 0 over training (`l1_ramp`, AxBench's code).
  By default (`train_on_negative: true`, AxBench's sweeps) each concept also trains on the
  negatives of its genre — the same intervention with its own w_c, the same LM loss — which
  needs the data module's `genre_negatives: true` (the negatives then carry concept ids);
  `train_on_negative: false` is positives only. `exclude_prefix: false` intervenes on every
  token. With `negative_l1: true` pool negatives (concept_id −1) get the L1 term on *every*
  concept's latents at all their tokens, pushing latents towards 0 off-concept; on smollm2 that
  killed 5 of 10 rows (ReLU(h·w) = 0 on every token, so no gradient again), hence off.
- `ssv`: Φ(h_i) = h_i + w_c at every token after the chat prefix of a positive example; loss
  −log p(response); w free norm (AxBench eqs. 6–7; its sweeps: no negatives).

Here: where they intervene (`intervention_mask`), which rows train (`trained_rows`), Φ written at
the layer (`steering_intervention`) and ReFT-r1's L1 term (`l1_term`); `SteeringModule` runs the
forward and takes the LM loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lit_interventions.interventions.additive import masked_token_mean, non_topk_l1, reft_r1_intervention


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


def trained_rows(batch: dict, method: str, train_on_negative: bool) -> torch.Tensor:
    """The rows that get the intervention and the LM loss, (batch,): a concept's positives and,
    with `train_on_negative` (ReFT-r1), its genre-matched negatives."""
    own = batch["concept_id"] >= 0
    if method == "reft_r1" and train_on_negative:
        return own
    return own & (batch["label"] == 1)


def steering_intervention(
    method: str, w: torch.Tensor, where: torch.Tensor, trained: torch.Tensor, topk: int, seen: dict
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Φ at the layer, (batch, seq, d) -> the same: SSV h + w_c, ReFT-r1 h + mean(TopK(ReLU(h·w_c)))·w_c,
    on the trained rows at the `where` tokens; every other state is left as it is. `w`: each row's
    w_c, (batch, d). ReFT-r1 records its latents, the chosen top-k and the states in `seen`."""

    def intervene(hidden):  # (batch, seq, d) -> the same, at the layer
        if method == "ssv":
            steered = hidden + w.to(hidden.dtype)[:, None, :]
        else:
            steered, seen["latents"], seen["chosen"] = reft_r1_intervention(hidden, w, where, topk)
            seen["hidden"] = hidden
        return torch.where(trained[:, None, None] & where[:, :, None], steered, hidden)

    return intervene


def l1_term(
    seen: dict, trained: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, negative_l1: bool
) -> torch.Tensor:
    """Mean over the batch of each row's L1 term: a trained row's non-top-k latents of its
    concept; a pool negative's latents of every concept (rows of `weight`) at all tokens (if
    negative_l1). `seen`: what `steering_intervention` recorded."""
    per_row = torch.where(
        trained, non_topk_l1(seen["latents"], seen["chosen"], mask), torch.zeros_like(seen["latents"][:, 0])
    )
    negative = ~trained
    if negative_l1 and negative.any():
        every = torch.relu(seen["hidden"][negative].float() @ weight.T)  # (neg, seq, C)
        extra = torch.zeros_like(per_row)
        extra[negative] = masked_token_mean(every, mask[negative]).sum(-1)
        per_row = per_row + extra
    return per_row.mean()
