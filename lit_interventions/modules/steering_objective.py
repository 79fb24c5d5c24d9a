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

RePS (Wu et al. 2025, arXiv 2505.20809; AxBench's `preference_model.py`), `PreferenceObjective`:
the objective `SteeringModule` trains a dictionary's rows with in place of −log p(response), on
preference batches (`AxBenchDataModule(preference=True)`). Per example (x, y^c, y), the pairs
orig_add (winning y^c, losing y, steered h + α·w) and orig_sub (winning y, losing y^c, at the
null-out edit h − (ReLU(h·w)/‖w‖²)·w, `null_or_add`), scored by `preference_loss`; RePS's own
is scaled_simpo, −log σ( max(r_l − r_w, 1)/|w|·π_w − π_l/|l| ).

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


# --- RePS: reference-free preference steering (Wu et al. 2025, arXiv 2505.20809) -------------

LOSS_TYPES = ("scaled_simpo", "simpo", "dpo", "apo_zero")
PREFERENCE_PAIRS = ("orig_add", "orig_sub")
SUBTRACTIONS = ("null_it_out", "negate")


def response_logps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ_t log p(token t+1 | ≤ t) over each row's `targets` tokens (its response), (batch,), in
    float32: AxBench's `_get_batch_logps` (labels −100 outside the response, summed, not averaged),
    with logits computed only at the positions it reads."""
    predict = targets[:, 1:].bool()  # position t predicts token t + 1
    hidden = run_body(model, ids, mask).last_hidden_state  # (batch, seq, d)
    logits = final_logits(model, hidden[:, :-1][predict]).float()  # (n_targets, vocab)
    token = logits.log_softmax(-1).gather(-1, ids[:, 1:][predict][:, None])[:, 0]  # (n_targets,)
    row = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(predict)[predict]
    return torch.zeros(ids.shape[0], device=token.device).index_add(0, row.to(token.device), token)


def preference_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_lens: torch.Tensor,
    rejected_lens: torch.Tensor,
    loss_type: str = "scaled_simpo",
    beta: float = 1.0,
    gamma: float = 0.0,
    simpo_scaler: float = 1.0,
) -> torch.Tensor:
    """The per-pair preference loss of AxBench's `preference_loss`, (pairs,). π: the steered LM's
    summed log-probability of the chosen (winning) / rejected (losing) response; r: the unsteered
    LM's; |w|, |l|: the pair's sequence lengths (its attention mask: prompt and response).

        scaled_simpo (RePS):  −log σ( max(s·(r_l − r_w), 1)/|w| · π_w − π_l/|l| )
        simpo:                −log σ( β/|w| · π_w − β/|l| · π_l − γ )
        dpo:                  −log σ( β·((π_w − π_l) − (r_w − r_l)) )
        apo_zero:             −log σ( β·(π_w − r_w) ) + log σ( β·(π_l − r_l) )

    with s = `simpo_scaler`. The paper's β⁺ = max(log p(y|x) − log p(y^c|x), 1) of the steering
    pair is max(r_l − r_w, 1) (the reference prefers the original y, the losing response)."""
    chosen_lens, rejected_lens = chosen_lens.to(chosen.dtype), rejected_lens.to(rejected.dtype)
    if loss_type == "scaled_simpo":
        scale = torch.clamp((ref_rejected - ref_chosen) * simpo_scaler, min=1.0)
        return -F.logsigmoid(scale / chosen_lens * chosen - rejected / rejected_lens)
    if loss_type == "simpo":
        return -F.logsigmoid(beta / chosen_lens * chosen - beta / rejected_lens * rejected - gamma)
    if loss_type == "dpo":
        return -F.logsigmoid(beta * ((chosen - rejected) - (ref_chosen - ref_rejected)))
    if loss_type == "apo_zero":
        return -F.logsigmoid(beta * (chosen - ref_chosen)) + F.logsigmoid(beta * (rejected - ref_rejected))
    raise ValueError(f"loss_type={loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


def null_or_add(hidden: torch.Tensor, w: torch.Tensor, factor: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """A rank-1 vector's preference edit (AxBench's `PreferenceVectorIntervention`, bias 0) at the
    `where` tokens (batch, seq): h + α·w for α ≠ 0, and for α = 0 the null-out
    h − (ReLU(h·w)/‖w‖²)·w, which removes the positive part of h along w. hidden (batch, seq, d),
    w (batch, d) each row's vector, factor (batch,)."""
    w, factor = w.float(), factor.float().to(hidden.device)
    latent = torch.relu(torch.einsum("btd,bd->bt", hidden.float(), w))  # (batch, seq)
    null = -latent / (w * w).sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    coeff = torch.where((factor == 0)[:, None], null, factor[:, None].expand_as(latent))
    coeff = coeff * where.to(coeff.dtype)
    return hidden + (coeff[:, :, None] * w[:, None, :]).to(hidden.dtype)


class PreferenceObjective:
    """RePS's bidirectional preference objective, for a parameterisation whose edit takes a
    steering factor α per sequence (AxBench `PreferenceModel.train`).

    A training example is (x, y^c, y): the instruction, the concept response and the LM's
    original response. Its pairs (`pairs`): "orig_add", winning y^c, losing y, both steered at
    α drawn from `steering_factors` (independently for the two sequences); "orig_sub", winning y,
    losing y^c, both at α = 0 (`subtraction: null_it_out`, the null-out edit) or at −α drawn
    likewise (`negate`). The reference is the same LM without the edit. The loss is the mean of
    `preference_loss` over every pair of the batch (AxBench's mean per minibatch divided by the
    number of minibatches, which is the same mean).

    Args:
        loss_type: scaled_simpo (RePS), simpo, dpo or apo_zero (see `preference_loss`).
        beta, gamma: β and γ of simpo, dpo and apo_zero (AxBench's `gemma`).
        simpo_scaler: s of scaled_simpo.
        steering_factors: the factors α is drawn from, in the edit's own units (h + α·w for a vector).
        pairs: the preference pairs, a subset of orig_add, orig_sub.
        subtraction: null_it_out (α = 0 on orig_sub) or negate (−α).
        max_new_tokens: the length of the LM's original responses, generated greedily at fit
            start where the data holds none (`losing_output`).
    """

    def __init__(
        self,
        loss_type: str = "scaled_simpo",
        beta: float = 1.0,
        gamma: float = 0.0,
        simpo_scaler: float = 1.0,
        steering_factors: list[float] | tuple[float, ...] = (2.0,),
        pairs: list[str] | tuple[str, ...] = PREFERENCE_PAIRS,
        subtraction: str = "null_it_out",
        max_new_tokens: int = 128,
    ):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
        if subtraction not in SUBTRACTIONS:
            raise ValueError(f"subtraction={subtraction!r}; valid: {', '.join(SUBTRACTIONS)}")
        pairs = list(pairs)
        if not pairs or len(set(pairs)) < len(pairs) or set(pairs) - set(PREFERENCE_PAIRS):
            raise ValueError(f"pairs={pairs!r}: distinct names among {', '.join(PREFERENCE_PAIRS)}")
        factors = [float(f) for f in steering_factors]
        if not factors or not all(abs(f) < float("inf") for f in factors):
            raise ValueError(f"steering_factors={steering_factors!r} must be a non-empty list of finite numbers")
        if "orig_add" in pairs and 0.0 in factors:
            raise ValueError(f"steering_factors={factors!r}: 0 is the null-out edit, not a steering factor")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        self.loss_type, self.beta, self.gamma, self.simpo_scaler = loss_type, float(beta), float(gamma), simpo_scaler
        self.steering_factors, self.pairs, self.subtraction = factors, pairs, subtraction
        self.max_new_tokens = max_new_tokens

    def config(self) -> dict:
        """{class_path, init_args}: what builds this objective again."""
        args = {
            "loss_type": self.loss_type,
            "beta": self.beta,
            "gamma": self.gamma,
            "simpo_scaler": self.simpo_scaler,
            "steering_factors": list(self.steering_factors),
            "pairs": list(self.pairs),
            "subtraction": self.subtraction,
            "max_new_tokens": self.max_new_tokens,
        }
        return {"class_path": f"{__name__}.PreferenceObjective", "init_args": args}

    def draw(self, n: int, sign: float, generator: torch.Generator) -> torch.Tensor:
        """n factors drawn uniformly from `steering_factors`, times `sign`, (n,)."""
        index = torch.randint(len(self.steering_factors), (n,), generator=generator)
        return sign * torch.tensor(self.steering_factors)[index]

    def plan(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(winning rows, losing rows, their factors) of every pair of a batch of n examples whose
        rows 0..n−1 hold the concept responses and n..2n−1 the original ones: (winning, losing,
        winning factors, losing factors), each (pairs·n,)."""
        concept, original = torch.arange(n), torch.arange(n, 2 * n)
        won, lost, won_at, lost_at = [], [], [], []
        for pair in self.pairs:
            if pair == "orig_add":
                won.append(concept), lost.append(original)
                won_at.append(self.draw(n, 1.0, generator)), lost_at.append(self.draw(n, 1.0, generator))
            elif self.subtraction == "null_it_out":
                won.append(original), lost.append(concept)
                won_at.append(torch.zeros(n)), lost_at.append(torch.zeros(n))
            else:
                won.append(original), lost.append(concept)
                won_at.append(self.draw(n, -1.0, generator)), lost_at.append(self.draw(n, -1.0, generator))
        return torch.cat(won), torch.cat(lost), torch.cat(won_at), torch.cat(lost_at)

    def loss(self, batch: dict, policy, reference, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        """(the mean preference loss of a preference batch, its metrics). `policy(rows, factors)`
        gives the steered LM's response log-probabilities of the batch rows `rows` at `factors`,
        (len(rows),); `reference()` the unsteered LM's of every row, (2n,)."""
        n = int(batch["pairs"])
        won, lost, won_at, lost_at = self.plan(n, generator)
        with torch.no_grad():
            ref = reference()  # (2n,)
        logps = policy(torch.cat([won, lost]), torch.cat([won_at, lost_at]))
        chosen, rejected = logps[: len(won)], logps[len(won) :]
        lens = batch["attention_mask"].sum(-1).to(logps.device)
        won, lost = won.to(logps.device), lost.to(logps.device)
        losses = preference_loss(
            chosen, rejected, ref[won], ref[lost], lens[won], lens[lost],
            self.loss_type, self.beta, self.gamma, self.simpo_scaler,
        )  # fmt: skip
        accuracy = ((chosen - ref[won]) > (rejected - ref[lost])).float().mean()
        return losses.mean(), {"chosen_logps": chosen.detach().mean(), "reward_accuracy": accuracy}
