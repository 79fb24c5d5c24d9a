"""Additive rank-1 concept interventions: a dictionary of concept directions w_c (AxBench §4).

One `ConceptDictionary` holds every concept of a dataset as a row of a (concepts × d) matrix, so
all concepts train in one run; an example only touches the row of its own concept. Pure torch,
no Lightning. Formulas (AxBench, Wu et al. 2025, eqs. 4–10):

- detection latent:  Ψ(h_i) = h_i·w (DiffMean, PCA, LAT, probe) or ReLU(h_i·w) (SSV, ReFT-r1);
- SSV training:      Φ(h_i) = h_i + w, at every token (eq. 6; `SSVDictionary`);
- ReFT-r1 training:  Φ(h_i) = h_i + mean(TopK(ReLU(h·w)))·w, at every token (eq. 9),
                     with λ·Σ_{non-top-k}|latent| added to the LM loss (eq. 10; `ReFTR1Dictionary`);
- steering:          Φ(h_i) = h_i + α·w, at every token (every `ConceptDictionary`);
- gated steering:    Φ(h_i) = h_i + α·w_c·1[z_c(h_i) > τ_c], z_c the concept's own latent Ψ
                     (conditional steering: CAST, Lee et al. 2024, arXiv 2409.05907; AxBench's
                     conditional ReFT demo), the edit only where the concept's detector fires
                     (`gate_open`, `ConceptDictionary.forward(threshold=τ)`); τ_c is chosen on
                     the eval split by Youden's J (`youden_threshold`).

The trained ones are interventions like any other, with their training form as `forward` with
no factor, ReFT-r1's L1 term as `penalty()` and its ramp as `anneal(step, total)`; they are
registered as `reft_r1` and `ssv` (`interventions.registry`). AxBench's closed forms (DiffMean,
PCA, LAT, probe) are the direction estimators of `interventions.directions`, fitted once per
concept into a plain `ConceptDictionary` (`modules.steering_closed_form`).

w is kept unit norm for every method except SSV: after each optimizer step the rows are
renormalised, and the gradient component parallel to w is removed before the step (Gao et al.
2024, as AxBench does for ReFT-r1), so Adam only rotates w.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_interventions.interventions.base import Intervention, register_intervention

DEAD_MAX_ACTIVATION = 50.0  # the steering unit of a concept whose max activation is <= 0 (AxBench's value)


def steering_units(max_scores: torch.Tensor) -> torch.Tensor:
    """Each concept's max activation m_c, the unit of the steering factor (α = factor × m_c):
    its largest sequence score on the eval set, or `DEAD_MAX_ACTIVATION` where that is ≤ 0, so a
    dead row still steers (AxBench `Model.pre_compute_mean_activations`:
    `max_act if max_act > 0 else 50`). NaN (never validated) stays NaN."""
    kept = (max_scores > 0) | max_scores.isnan()
    return torch.where(kept, max_scores, torch.full_like(max_scores, DEAD_MAX_ACTIVATION))


@register_intervention
class ConceptDictionary(Intervention):
    """A (concepts × d) matrix of concept directions, `weight[c]` = w_c.

    unit_norm: initialise the rows on the unit sphere (Gaussian directions from `seed`) and keep
    them there with `remove_parallel_grad` + `renormalise`; False (SSV) starts every coordinate
    at `fill` and leaves the norm free. As an intervention it steers: forward(base, *,
    concept_id, factor) = base + α·w_c at every token.

    The shape may wait for the data: built without `num_concepts` and `hidden_size`, it holds no
    rows until `allocate(num_concepts, hidden_size, seed)` (what `SteeringModule` does once the
    concepts are known). `latent` is how a detection latent is read from h·w ("linear", h·w).
    Trained as an AxBench concept method (`SteeringModule`), a dictionary declares the rows that
    train (`trained_rows`), what it needs of the data (`check_data`) and its card's fields
    (`card`): the subclasses `ReFTR1Dictionary` and `SSVDictionary`.
    """

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    trains = True

    latent = "linear"

    def __init__(
        self,
        num_concepts: int | None = None,
        hidden_size: int | None = None,
        unit_norm: bool = True,
        seed: int = 0,
        fill: float = 0.0,
    ):
        super().__init__()
        self.unit_norm, self.fill = unit_norm, float(fill)
        self.weight = nn.Parameter(torch.empty(0, 0))  # (C, d) once allocated
        if num_concepts is not None or hidden_size is not None:
            self.allocate(num_concepts, hidden_size, seed)

    def allocate(self, num_concepts: int, hidden_size: int, seed: int = 0) -> ConceptDictionary:
        """Fresh rows, (num_concepts × hidden_size): unit-norm Gaussian directions from `seed`, or
        every coordinate at `fill` (not unit norm). Returns the dictionary."""
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (num_concepts, hidden_size)):
            raise ValueError(f"num_concepts and hidden_size must be integers >= 1; got {num_concepts}, {hidden_size}")
        if self.unit_norm:
            weight = torch.randn(num_concepts, hidden_size, generator=torch.Generator().manual_seed(seed))
            weight = weight / weight.norm(dim=-1, keepdim=True)
        else:
            weight = torch.full((num_concepts, hidden_size), self.fill)
        self.weight = nn.Parameter(weight)
        return self

    @property
    def num_concepts(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def rows(self, concept_id: torch.Tensor) -> torch.Tensor:
        """w_c for each example, (batch, d). Every id must be a valid row (no −1)."""
        if concept_id.numel() and (concept_id.min() < 0 or concept_id.max() >= self.num_concepts):
            bad = concept_id[(concept_id < 0) | (concept_id >= self.num_concepts)][0].item()
            raise ValueError(f"concept_id {bad} is not a row of this dictionary (0..{self.num_concepts - 1})")
        return self.weight[concept_id]

    def projections(self, hidden: torch.Tensor, concept_id: torch.Tensor) -> torch.Tensor:
        """h_i·w_c at every token of each example, (batch, seq), in float32."""
        return torch.einsum("btd,bd->bt", hidden.float(), self.rows(concept_id).float())

    def forward(
        self,
        base: torch.Tensor,
        source: torch.Tensor | None = None,
        *,
        concept_id: torch.Tensor,
        factor: float | torch.Tensor = 1.0,
        threshold: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Φ(h_i) = h_i + α·w_c.  base (batch, d) or (batch, seq, d); concept_id (batch,) rows;
        factor α: a number or (batch,), one per example.

        threshold τ (a number or (batch,), one per example; None: no gate) gates the edit per
        token on the concept's own latent z_c(h_i) = Ψ(h_i) (h·w_c, or ReLU(h·w_c): `latent`):
        Φ(h_i) = h_i + α·w_c·1[z_c(h_i) > τ] (CAST), h_i itself, bit for bit, where the gate is shut."""
        self._refuse_source(source)
        concept_id = torch.as_tensor(concept_id, device=self.weight.device).reshape(-1)
        if concept_id.shape[0] != base.shape[0]:
            raise ValueError(f"concept_id has {concept_id.shape[0]} ids; base has batch size {base.shape[0]}")
        alpha = torch.as_tensor(factor, dtype=torch.float32, device=base.device).reshape(-1, 1)  # (1 | batch, 1)
        shift = alpha * self.rows(concept_id).float()  # (batch, d)
        if base.dim() == 3:
            shift = shift[:, None, :]
        steered = base + shift.to(base.dtype)
        if threshold is None:
            return steered
        w = self.rows(concept_id)
        return gated(base, steered, gate_open(base, w if base.dim() == 2 else w[:, None, :], self.latent, threshold))

    def export(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.detach()}  # (C, d)

    def steering_vectors(
        self, concept: int | None = None, factor: float = 1.0, layer: int | None = None
    ) -> dict[str, dict[int, torch.Tensor]]:
        """{"concept-c": {layer: α·w_c}} for row `concept` (None: every row): the vector `forward`
        adds at every token, Φ(h_i) = h_i + α·w_c, with α = `factor` (this dictionary holds no max
        activations). `layer`: where it steers, which its artifact's config.json site records."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(
                f"layer={layer!r}: a ConceptDictionary does not record where it steers; pass its site's layer"
            )
        if concept is not None and (isinstance(concept, bool) or not isinstance(concept, int)):
            raise ValueError(
                f"concept={concept!r}: a ConceptDictionary's concepts are its rows 0..{self.num_concepts - 1}"
            )
        rows = range(self.num_concepts) if concept is None else [concept]
        alpha = torch.as_tensor(factor, dtype=torch.float32)
        return {f"concept-{row}": {layer: alpha * self.rows(torch.tensor([row]))[0].detach().float()} for row in rows}

    def config(self) -> dict:
        return {"unit_norm": self.unit_norm}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], **config) -> ConceptDictionary:
        module = cls(**config).allocate(*tensors["weight"].shape)
        with torch.no_grad():
            module.weight.copy_(tensors["weight"])
        return module

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """grad_c ← grad_c − (grad_c·w_c) w_c for every row (w unit norm): no radial update."""
        grad = self.weight.grad
        if grad is not None and self.unit_norm:
            w = self.weight.data
            grad -= (grad * w).sum(-1, keepdim=True) * w

    @torch.no_grad()
    def renormalise(self) -> None:
        """w_c ← w_c / ‖w_c‖ (a no-op for the free-norm SSV dictionary)."""
        if self.unit_norm:
            norm = self.weight.data.norm(dim=-1, keepdim=True)
            self.weight.data /= norm.clamp(min=torch.finfo(norm.dtype).eps)

    # --- as an AxBench concept method (SteeringModule) ------------------------------------------

    def trained_rows(self, batch: dict) -> torch.Tensor:
        """The rows that get the intervention and the LM loss, (batch,): a concept's positives."""
        return (batch["concept_id"] >= 0) & (batch["label"] == 1)

    def check_data(self, genre_negatives: bool | None) -> None:
        """Refuse a data module whose `genre_negatives` (None: not said) does not suit the method."""

    def card(self) -> dict:
        """Further fields of the released dictionary's card."""
        return {}

    def _check_sequence(self, base: torch.Tensor, source: torch.Tensor | None) -> None:
        """The training form Φ edits a sequence's states, (batch, seq, d), and reads no source."""
        self._refuse_source(source)
        if base.dim() != 3:
            raise ValueError(
                f"{type(self).__name__}'s training form (factor=None) takes (batch, seq, d) states; got shape "
                f"{tuple(base.shape)}: pass a factor to steer"
            )

    @staticmethod
    def _tokens(base: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
        """The intervened tokens, (batch, seq) bool: `where`, or every token when None."""
        return torch.ones(base.shape[:2], dtype=torch.bool, device=base.device) if where is None else where.bool()

    def _trained_edit(
        self, base: torch.Tensor, steered: torch.Tensor, where: torch.Tensor | None, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """`steered` on the `rows` (batch,) at the `where` tokens (batch, seq), `base` elsewhere."""
        keep = self._tokens(base, where)
        if rows is not None:
            keep = rows[:, None] & keep
        return torch.where(keep[:, :, None], steered, base)


@register_intervention
class ReFTR1Dictionary(ConceptDictionary):
    """ReFT-r1 (AxBench eqs. 8–10) as a concept dictionary: latent ReLU(h·w_c); trained with

        Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c    at every intervened token,
        loss   = −log p(response) + λ_t·Σ_{non-top-k}|latent|,   w_c unit norm.

    `forward(base, concept_id=, factor=None, where=, rows=)` is Φ on the `rows` (batch,) at the
    `where` tokens (batch, seq), where the TopK runs; with a `factor` it steers as every concept
    dictionary does, h + α·w_c. The L1 term of the last Φ is `penalty()` (`Penalised`) and λ_t its
    weight `penalty_weight`, set by `anneal(step, total)` (`Annealed`).

    Args:
        topk: k of the TopK over the sequence's latents (the paper does not give k).
        l1: λ of the L1 term, a per-sequence mean over the intervened tokens (AxBench's code).
        l1_ramp: λ_t = λ·step/total_steps, from 0 at the first step (AxBench's code); False: λ.
        negative_l1: pool negatives (concept_id −1) also get the L1 term on every concept's latents
            at all their tokens (on smollm2 it killed 5 of 10 rows, hence off).
        train_on_negative: each concept also trains on its genre-matched negatives, the same Φ and
            LM loss (AxBench's sweeps); needs the data module's `genre_negatives: true`.
    """

    latent = "relu"

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
        super().__init__(unit_norm=True)
        self.topk, self.l1, self.l1_ramp = topk, l1, l1_ramp
        self.negative_l1, self.train_on_negative = negative_l1, train_on_negative
        self.penalty_weight = 0.0 if l1_ramp else l1
        self._seen: dict[str, torch.Tensor] = {}

    def forward(self, base, source=None, *, concept_id, factor=None, where=None, rows=None, threshold=None):
        """Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c on `rows` at `where` (`factor` None), or
        h + α·w_c (`factor` α; gated by `threshold` as every concept dictionary). A row outside
        `rows` may carry concept_id −1."""
        if factor is not None:
            return super().forward(base, source, concept_id=concept_id, factor=factor, threshold=threshold)
        self._check_sequence(base, source)
        where = self._tokens(base, where)
        rows = torch.ones(base.shape[0], dtype=torch.bool, device=base.device) if rows is None else rows
        w = self.weight[concept_id.clamp(min=0)]  # (batch, d); unused outside `rows`
        steered, latents, chosen = reft_r1_intervention(base, w, where, self.topk)
        self._seen = {"latents": latents, "chosen": chosen, "hidden": base, "where": where, "rows": rows}
        return self._trained_edit(base, steered, where, rows)

    def penalty(self) -> torch.Tensor:
        """The L1 term of the last Φ, a mean over the batch: a trained row's non-top-k latents of
        its concept (AxBench eq. 10); with `negative_l1`, a row outside `rows` (a pool negative)
        gets its latents of every concept at all its `where` tokens."""
        seen, self._seen = self._seen, {}  # its tensors belong to one step's graph
        if not seen:
            raise ValueError("penalty() reads the latents of the last Φ: call forward with factor=None first")
        rows, where = seen["rows"], seen["where"]
        per_row = torch.where(
            rows, non_topk_l1(seen["latents"], seen["chosen"], where), torch.zeros_like(seen["latents"][:, 0])
        )
        negative = ~rows
        if self.negative_l1 and negative.any():
            every = torch.relu(seen["hidden"][negative].float() @ self.weight.T)  # (neg, seq, C)
            extra = torch.zeros_like(per_row)
            extra[negative] = masked_token_mean(every, where[negative]).sum(-1)
            per_row = per_row + extra
        return per_row.mean()

    def anneal(self, step: int, total: int) -> None:
        """λ_t at training step `step` of `total`: λ·step/total with `l1_ramp` (AxBench: `coeff =
        curr_step / num_training_steps`, 0 at the first step), else λ."""
        self.penalty_weight = self.l1 * step / max(1, int(total)) if self.l1_ramp else self.l1

    def trained_rows(self, batch: dict) -> torch.Tensor:
        """A concept's positives and, with `train_on_negative`, its genre-matched negatives."""
        own = batch["concept_id"] >= 0
        return own if self.train_on_negative else own & (batch["label"] == 1)

    def check_data(self, genre_negatives: bool | None) -> None:
        if self.train_on_negative and genre_negatives is False:
            raise ValueError(
                "train_on_negative=True (AxBench) needs negatives per concept: set the data module's "
                "genre_negatives: true, or set train_on_negative: false"
            )

    def card(self) -> dict:
        return {"topk": self.topk, "l1": self.l1}

    def config(self) -> dict:
        return {
            "topk": self.topk,
            "l1": self.l1,
            "l1_ramp": self.l1_ramp,
            "negative_l1": self.negative_l1,
            "train_on_negative": self.train_on_negative,
        }


@register_intervention
class SSVDictionary(ConceptDictionary):
    """SSV, a supervised steering vector (AxBench eqs. 6–7), as a concept dictionary: trained with
    Φ(h_i) = h_i + w_c at every intervened token of a positive, loss −log p(response); latent
    ReLU(h·w_c); w_c free norm. `forward(base, concept_id=, factor=None, where=, rows=)` is Φ on
    the `rows` at the `where` tokens; with a `factor`, h + α·w_c.

    Args:
        init: every coordinate of w_c starts at this value (AxBench's `SteeringVectorIntervention`
            fills its weight with 0.01); 0.0 starts at zero, where Φ is the identity.
    """

    latent = "relu"

    def __init__(self, init: float = 0.01):
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not abs(init) < float("inf"):
            raise ValueError(f"init={init!r} must be a finite number")
        super().__init__(unit_norm=False, fill=init)
        self.init = float(init)

    def forward(self, base, source=None, *, concept_id, factor=None, where=None, rows=None, threshold=None):
        """Φ(h_i) = h_i + w_c on `rows` at `where` (`factor` None), or h + α·w_c (`factor` α;
        gated by `threshold` as every concept dictionary)."""
        if factor is not None:
            return super().forward(base, source, concept_id=concept_id, factor=factor, threshold=threshold)
        self._check_sequence(base, source)
        w = self.weight[concept_id.clamp(min=0)]  # (batch, d); unused outside `rows`
        return self._trained_edit(base, base + w.to(base.dtype)[:, None, :], where, rows)

    def config(self) -> dict:
        return {"init": self.init}


def topk_mean(latents: torch.Tensor, mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/k)·Σ TopK(latents over the sequence) per example, (batch,), and which tokens were the
    top k, (batch, seq) bool. Only tokens where `mask` is set compete; a sequence with fewer than
    k of them averages over all it has."""
    if k < 1:
        raise ValueError(f"k (topk) must be >= 1; got {k}")
    mask = mask.bool()
    k = min(k, latents.shape[-1])
    values, index = latents.masked_fill(~mask, float("-inf")).topk(k, dim=-1)  # (batch, k)
    chosen = torch.zeros_like(mask).scatter(-1, index, True) & mask  # (batch, seq)
    valid = torch.isfinite(values)
    mean = values.where(valid, torch.zeros_like(values)).sum(-1) / valid.sum(-1).clamp(min=1)
    return mean, chosen


def reft_r1_intervention(
    hidden: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Φ(h_i) = h_i + mean(TopK(ReLU(h·w)))·w at every token (AxBench eq. 9).

    hidden (batch, seq, d); w (batch, d), each example's concept row; mask (batch, seq): the tokens
    whose latents compete for the top k (padding excluded). Returns the new hidden states (in
    hidden's dtype), the latents ReLU(h·w) (batch, seq) and the top-k mask (batch, seq).
    """
    latents = torch.relu(torch.einsum("btd,bd->bt", hidden.float(), w.float()))  # (batch, seq)
    mean, chosen = topk_mean(latents, mask, k)
    steered = hidden + (mean[:, None, None] * w[:, None, :].float()).to(hidden.dtype)
    return steered, latents, chosen


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the tokens where `mask` is set, per example, (batch, ...)."""
    mask = mask.to(values.dtype)
    while mask.dim() < values.dim():
        mask = mask.unsqueeze(-1)
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)


def non_topk_l1(latents: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_{non-top-k}|latent|, as a mean over each sequence's tokens (mask), (batch,) — AxBench's
    normalisation of eq. 10, for which its λ ∈ {1e-3, 5e-3} were tuned. Latents ≥ 0 (ReLU)."""
    return masked_token_mean(latents.abs() * (~chosen.bool()).to(latents.dtype), mask)


def add_vector(hidden: torch.Tensor, vector: torch.Tensor, alpha: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Φ(h_i) = h_i + α·w at every token. hidden (batch, seq, d); vector (d,) or (batch, d)."""
    vector = vector if vector.dim() == 2 else vector[None]
    return hidden + (alpha * vector.float())[:, None, :].to(hidden.dtype)


# --- conditional steering: the gate on a concept's own latent ---------------------------------------


def concept_latents(hidden: torch.Tensor, w: torch.Tensor, latent: str) -> torch.Tensor:
    """z_c(h) = h·w_c ("linear") or ReLU(h·w_c) ("relu") at every token, in float32; hidden (..., d),
    w broadcastable to it. The gate's latent (`gate_open`) and the eval split's (τ) alike."""
    if latent not in ("linear", "relu"):
        raise ValueError(f"latent={latent!r}; valid: linear, relu")
    z = (hidden.float() * w.to(hidden.device).float()).sum(-1)
    return torch.relu(z) if latent == "relu" else z


def gate_open(hidden: torch.Tensor, w: torch.Tensor, latent: str, threshold: float | torch.Tensor) -> torch.Tensor:
    """1[z_c(h) > τ_c] at every token: whether the concept's latent fires there (CAST's condition,
    arXiv 2409.05907, read from the dictionary's own row). z_c(h) = h·w_c (latent "linear") or
    ReLU(h·w_c) ("relu"), in float32, as detection reads it.

    hidden (..., d); w broadcastable to it (a row per example: (n, d) for (n, d) states, (batch, 1,
    d) for (batch, seq, d)); threshold τ a number or one per leading row, (n,) / (batch,).
    Returns a bool tensor shaped like hidden without its last dimension."""
    z = concept_latents(hidden, w, latent)
    tau = torch.as_tensor(threshold, dtype=torch.float32, device=z.device)
    tau = tau.reshape(-1, *([1] * (z.dim() - 1))) if tau.dim() else tau
    return z > tau


def gated(hidden: torch.Tensor, edited: torch.Tensor, open_: torch.Tensor) -> torch.Tensor:
    """h' = Φ(h)·1[open] + h·1[not open] per token: `edited` where the gate is open, `hidden`
    itself (bit for bit) where it is shut. open_ is hidden's shape without the last dimension."""
    return torch.where(open_[..., None], edited.to(hidden.dtype), hidden)


def youden_threshold(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """The gate's threshold τ from latents on labelled tokens: the τ maximising Youden's J,

        J(τ) = TPR(τ) − FPR(τ),   TPR(τ) = #{z ∈ positive : z > τ} / #positive,
                                  FPR(τ) = #{z ∈ negative : z > τ} / #negative,

    over the candidates τ ∈ {every latent seen} (the gate opens strictly above τ), ties to the
    smallest τ (the widest gate of the best J). Both sets must be non-empty and finite."""
    positive, negative = positive.detach().double().reshape(-1), negative.detach().double().reshape(-1)
    if not positive.numel() or not negative.numel():
        raise ValueError(
            f"youden_threshold needs latents of both kinds; got {positive.numel()} positive and "
            f"{negative.numel()} negative tokens"
        )
    if not (torch.isfinite(positive).all() and torch.isfinite(negative).all()):
        raise ValueError("youden_threshold: the latents hold NaN/inf")
    candidates = torch.cat([positive, negative]).unique()  # sorted ascending

    def above(values: torch.Tensor) -> torch.Tensor:  # the fraction of values > each candidate
        ranked = values.sort().values
        return (values.numel() - torch.searchsorted(ranked, candidates, right=True)).double() / values.numel()

    j = above(positive) - above(negative)
    return float(candidates[int(torch.nonzero(j == j.max())[0])])
