"""LoReFT: low-rank linear subspace representation finetuning (Wu et al. 2024; AxBench §4 methods).

Φ(h) = h + Rᵀ(W h + b − R h), with R (r × d) of orthonormal rows and W (r × d), b (r,) free.
Within the subspace spanned by R the state is replaced by a learned affine function of h; outside
it h is unchanged. The same map as pyvene's `LoreftIntervention` (its rotate_layer weight is our Rᵀ,
its learned_source is our (W, b)).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from lit_interventions.interventions.base import Intervention, register_intervention


def loreft(hidden: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Φ(h) = h + Rᵀ(W h + b − R h).  hidden: (..., d); rotation R, weight W: (r, d); bias b: (r,)."""
    rotation, weight, bias = rotation.to(hidden.dtype), weight.to(hidden.dtype), bias.to(hidden.dtype)
    return hidden + (hidden @ weight.T + bias - hidden @ rotation.T) @ rotation


@register_intervention
class LoReFTIntervention(Intervention):
    """A rank-r LoReFT edit applied to every position it is given.

    R is kept orthonormal by torch's orthogonal parametrization (as `RotatedSpaceIntervention`);
    W and b are a plain `nn.Linear(d, r)` with its default initialisation (as pyvene), so the
    edit is not the identity at initialisation. It edits base alone: `source` must be None.
    """

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    trains = True

    def __init__(self, hidden_size: int, rank: int = 4):
        super().__init__()
        if not isinstance(rank, int) or not 1 <= rank <= hidden_size:
            raise ValueError(f"rank={rank!r} must be an integer in 1..{hidden_size} (the hidden size)")
        self.hidden_size, self.rank = hidden_size, rank
        self.rotate = orthogonal(nn.Linear(hidden_size, rank, bias=False))  # weight R: (r, d)
        self.source = nn.Linear(hidden_size, rank)  # W: (r, d), b: (r,)

    @property
    def rotation(self) -> torch.Tensor:
        """R, (r, d), with orthonormal rows."""
        return self.rotate.weight

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        self._refuse_source(source)
        return loreft(base, self.rotation, self.source.weight, self.source.bias)

    def export(self) -> dict[str, torch.Tensor]:
        """The weights a released checkpoint holds: R, W, b."""
        return {
            "rotation": self.rotation.detach(),
            "weight": self.source.weight.detach(),
            "bias": self.source.bias.detach(),
        }

    def to_pyvene(self) -> dict:
        """Φ as a pyvene intervention of the same map (`lit-interventions export --to pyvene`):
        `lit_interventions.export.pyvene_interventions.LoreftIntervention`, whose rotate_layer
        weight (d, r) is Rᵀ and whose learned_source holds W and b."""
        return {
            "intervention_type": "LoreftIntervention",
            "low_rank_dimension": self.rank,
            "weights": {
                "rotate_layer.weight": self.rotation.detach().float().T.contiguous(),
                "learned_source.weight": self.source.weight.detach().float(),
                "learned_source.bias": self.source.bias.detach().float(),
            },
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> LoReFTIntervention:
        """Rebuild from `export()` output."""
        rank, hidden = tensors["rotation"].shape
        module = cls(hidden, rank)
        with torch.no_grad():
            module.rotate.weight = tensors["rotation"].float()  # orthogonal's right_inverse
            module.source.weight.copy_(tensors["weight"])
            module.source.bias.copy_(tensors["bias"])
        return module
