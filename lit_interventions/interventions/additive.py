"""Additive rank-1 concept interventions: a dictionary of concept directions w_c (AxBench §4).

One `ConceptDictionary` holds every concept of a dataset as a row of a (concepts × d) matrix, so
all concepts train in one run; an example only touches the row of its own concept. Pure torch,
no Lightning. Formulas (AxBench, Wu et al. 2025, eqs. 4–10):

- detection latent:  Ψ(h_i) = h_i·w (DiffMean, PCA, LAT, probe) or ReLU(h_i·w) (SSV, ReFT-r1);
- SSV training:      Φ(h_i) = h_i + w, at every token (eq. 6);
- ReFT-r1 training:  Φ(h_i) = h_i + mean(TopK(ReLU(h·w)))·w, at every token (eq. 9),
                     with λ·Σ_{non-top-k}|latent| added to the LM loss (eq. 10);
- steering:          Φ(h_i) = h_i + α·w, at every token.

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
    """

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    trains = True

    def __init__(self, num_concepts: int, hidden_size: int, unit_norm: bool = True, seed: int = 0, fill: float = 0.0):
        super().__init__()
        if num_concepts < 1 or hidden_size < 1:
            raise ValueError(f"num_concepts and hidden_size must be >= 1; got {num_concepts}, {hidden_size}")
        self.unit_norm = unit_norm
        if unit_norm:
            weight = torch.randn(num_concepts, hidden_size, generator=torch.Generator().manual_seed(seed))
            weight = weight / weight.norm(dim=-1, keepdim=True)
        else:
            weight = torch.full((num_concepts, hidden_size), float(fill))
        self.weight = nn.Parameter(weight)  # (C, d)

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
    ) -> torch.Tensor:
        """Φ(h_i) = h_i + α·w_c.  base (batch, d) or (batch, seq, d); concept_id (batch,) rows;
        factor α: a number or (batch,), one per example."""
        self._refuse_source(source)
        concept_id = torch.as_tensor(concept_id, device=self.weight.device).reshape(-1)
        if concept_id.shape[0] != base.shape[0]:
            raise ValueError(f"concept_id has {concept_id.shape[0]} ids; base has batch size {base.shape[0]}")
        alpha = torch.as_tensor(factor, dtype=torch.float32, device=base.device).reshape(-1, 1)  # (1 | batch, 1)
        shift = alpha * self.rows(concept_id).float()  # (batch, d)
        if base.dim() == 3:
            shift = shift[:, None, :]
        return base + shift.to(base.dtype)

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
    def from_tensors(cls, tensors: dict[str, torch.Tensor], unit_norm: bool = True) -> ConceptDictionary:
        num_concepts, hidden_size = tensors["weight"].shape
        module = cls(num_concepts, hidden_size, unit_norm)
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
