"""AxBench's trained concept methods (Wu et al. 2025, §4): how the rows w_c of a concept dictionary
are learned by gradient, registered as `reft_r1` and `ssv` (`interventions.registry`).

A trained concept method is a small object that `SteeringModule` asks by capability (`trains =
True`, `capabilities.Trained`): which rows train (`trained_rows`) and Φ written at the layer
(`intervention`), plus, for a `L1Penalised` one, an L1 term and its weight: `ReFTR1Method`,
`SSVMethod`. It also declares its detection latent Ψ(h_i) (`latent`: "relu", ReLU(h·w), or
"linear", h·w), whether its rows stay unit norm (`unit_norm`) and where a free-norm row starts
(`init`), the name its dictionary card carries (`name`) and further card fields (`card()`), and
what it needs of the data module (`check_data`). Its options are its init args, kept as
attributes of the same names (`config()`).

AxBench's closed forms (DiffMean, PCA, LAT, probe) are the direction estimators of
`interventions.directions`, fitted once per concept by `SteeringModule`
(`modules.steering_closed_form`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from lit_interventions.interventions.additive import masked_token_mean, non_topk_l1, reft_r1_intervention


class ConceptMethod:
    """What every concept method declares: `name` (the card's method; the class name unless set),
    `latent` ("linear" h·w or "relu" ReLU(h·w)), `unit_norm`, `init` (the starting value of every
    coordinate of a trained row that is not unit norm), `trains`, `card()`, `check_data`."""

    latent: str = "linear"
    unit_norm: bool = True
    init: float = 0.0
    trains: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def config(self) -> dict:
        """The init args, each read from the attribute of its name (scikit-learn's convention)."""
        params = inspect.signature(type(self).__init__).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name: getattr(self, p.name) for p in params if p.name != "self" and p.kind in kinds}

    def card(self) -> dict:
        """Further fields of the released dictionary's card."""
        return {}

    def check_data(self, genre_negatives: bool | None) -> None:
        """Refuse a data module whose `genre_negatives` (None: not said) does not suit the method."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.config().items())})"


@runtime_checkable
class L1Penalised(Protocol):
    """A trained concept method whose loss adds λ·(an L1 term on the latents)."""

    def l1_term(self, seen: dict, trained: torch.Tensor, where: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def l1_coefficient(self, step: int, total: int) -> float: ...


class TrainedConceptMethod(ConceptMethod):
    """Trained by gradient on −log p(response) under Φ (AxBench eqs. 6–10): ReLU latents; Φ from
    `steer` on the trained rows at the `where` tokens; a concept's positives train."""

    latent = "relu"
    trains = True

    def trained_rows(self, batch: dict) -> torch.Tensor:
        """The rows that get the intervention and the LM loss, (batch,): a concept's positives."""
        return (batch["concept_id"] >= 0) & (batch["label"] == 1)

    def steer(self, hidden: torch.Tensor, w: torch.Tensor, where: torch.Tensor, seen: dict) -> torch.Tensor:
        """Φ(h) at every token, (batch, seq, d); `w` each row's w_c (batch, d)."""
        raise NotImplementedError

    def intervention(
        self, w: torch.Tensor, where: torch.Tensor, trained: torch.Tensor, seen: dict
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Φ at the layer, (batch, seq, d) -> the same, on the `trained` rows (batch,) at the `where`
        tokens (batch, seq); every other state is left as it is. `steer` may record in `seen`."""

        def intervene(hidden):  # (batch, seq, d) -> the same, at the layer
            steered = self.steer(hidden, w, where, seen)
            return torch.where(trained[:, None, None] & where[:, :, None], steered, hidden)

        return intervene


class ReFTR1Method(TrainedConceptMethod):
    """ReFT-r1 (AxBench eqs. 8–10): latent ReLU(h·w_c); Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c at
    every intervened token; loss −log p(response) + λ·Σ_{non-top-k}|latent|; w_c unit norm.

    Args:
        topk: k of the TopK over the sequence's latents (the paper does not give k).
        l1: λ of the L1 term, a per-sequence mean over the intervened tokens (AxBench's code).
        l1_ramp: λ·step/total_steps, from 0 at the first step (AxBench's code); False: constant λ.
        negative_l1: pool negatives (concept_id −1) also get the L1 term on every concept's latents
            at all their tokens (on smollm2 it killed 5 of 10 rows, hence off).
        train_on_negative: each concept also trains on its genre-matched negatives, the same Φ and
            LM loss (AxBench's sweeps); needs the data module's `genre_negatives: true`.
    """

    name = "reft_r1"

    def __init__(
        self,
        topk: int = 8,
        l1: float = 5e-3,
        l1_ramp: bool = True,
        negative_l1: bool = False,
        train_on_negative: bool = True,
    ):
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk={topk!r} must be an integer >= 1")
        if not (isinstance(l1, (int, float)) and 0 <= l1 < float("inf")):
            raise ValueError(f"l1={l1!r} must be a finite number >= 0")
        self.topk, self.l1, self.l1_ramp = topk, l1, l1_ramp
        self.negative_l1, self.train_on_negative = negative_l1, train_on_negative

    def trained_rows(self, batch: dict) -> torch.Tensor:
        """A concept's positives and, with `train_on_negative`, its genre-matched negatives."""
        own = batch["concept_id"] >= 0
        return own if self.train_on_negative else own & (batch["label"] == 1)

    def steer(self, hidden, w, where, seen):
        """h + mean(TopK(ReLU(h·w_c)))·w_c (`reft_r1_intervention`, the TopK over `where`); records the
        latents, the chosen top k and the states in `seen`."""
        steered, seen["latents"], seen["chosen"] = reft_r1_intervention(hidden, w, where, self.topk)
        seen["hidden"] = hidden
        return steered

    def l1_term(self, seen: dict, trained: torch.Tensor, where: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Mean over the batch of each row's L1 term: a trained row's non-top-k latents of its concept
        (AxBench eq. 10); with `negative_l1`, a pool negative's latents of every concept (rows of
        `weight`) at all its tokens. `seen`: what `steer` recorded."""
        per_row = torch.where(
            trained, non_topk_l1(seen["latents"], seen["chosen"], where), torch.zeros_like(seen["latents"][:, 0])
        )
        negative = ~trained
        if self.negative_l1 and negative.any():
            every = torch.relu(seen["hidden"][negative].float() @ weight.T)  # (neg, seq, C)
            extra = torch.zeros_like(per_row)
            extra[negative] = masked_token_mean(every, where[negative]).sum(-1)
            per_row = per_row + extra
        return per_row.mean()

    def l1_coefficient(self, step: int, total: int) -> float:
        """λ at training step `step` of `total`: λ·step/total with `l1_ramp` (AxBench: `coeff =
        curr_step / num_training_steps`, 0 at the first step), else λ."""
        if not self.l1_ramp:
            return self.l1
        return self.l1 * step / max(1, int(total))

    def card(self) -> dict:
        return {"topk": self.topk, "l1": self.l1}

    def check_data(self, genre_negatives: bool | None) -> None:
        if self.train_on_negative and genre_negatives is False:
            raise ValueError(
                "train_on_negative=True (AxBench) needs negatives per concept: set the data module's "
                "genre_negatives: true, or set train_on_negative: false"
            )


class SSVMethod(TrainedConceptMethod):
    """SSV, a supervised steering vector (AxBench eqs. 6–7): Φ(h_i) = h_i + w_c at every intervened
    token of a positive; loss −log p(response); latent ReLU(h·w_c); w_c free norm.

    Args:
        init: every coordinate of w_c starts at this value (AxBench's `SteeringVectorIntervention`
            fills its weight with 0.01); 0.0 starts at zero, where Φ is the identity.
    """

    name = "ssv"
    unit_norm = False

    def __init__(self, init: float = 0.01):
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not abs(init) < float("inf"):
            raise ValueError(f"init={init!r} must be a finite number")
        self.init = float(init)

    def steer(self, hidden, w, where, seen):
        return hidden + w.to(hidden.dtype)[:, None, :]
