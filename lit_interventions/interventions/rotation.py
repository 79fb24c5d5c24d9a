"""Distributed interchange interventions on a linear subspace (DAS; Geiger et al. 2023).

CausalGym §3.3: with a unit vector a, f*(b, s) = f(b) + (a·f(s) − a·f(b)) a. With k orthonormal
rows W (k × d) this is f*(b, s) = f(b) + Wᵀ(W f(s) − W f(b)), the same map as pyvene's
`LowRankRotatedSpaceIntervention` (whose weight is our Wᵀ).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

from lit_interventions.interventions.base import Intervention, register_intervention


def subspace_interchange(base: torch.Tensor, source: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """f* = f(b) + Wᵀ(W f(s) − W f(b)).  base, source: (batch, d); basis W: (k, d)."""
    basis = basis.to(base.dtype)
    return base + (source - base) @ basis.T @ basis


def pyvene_low_rank(basis: torch.Tensor) -> dict:
    """W (k, d) as pyvene's `LowRankRotatedSpaceIntervention` (`lit-interventions export --to
    pyvene`): its rotate_layer weight (d, k) is Wᵀ, and it computes f(b) + (f(s)Wᵀ − f(b)Wᵀ) W."""
    basis = basis.detach().float()
    return {
        "intervention_type": "LowRankRotatedSpaceIntervention",
        "low_rank_dimension": basis.shape[0],
        "weights": {"rotate_layer.weight": basis.T.contiguous()},
    }


@register_intervention
class RotatedSpaceIntervention(Intervention):
    """DAS: a learned rank-k subspace with orthonormal rows (torch's orthogonal parametrization).
    Once trained it acts as `FixedSubspaceIntervention` on its exported basis (`frozen_class`)."""

    trains = True

    def __init__(self, hidden_size: int, k: int = 1):
        super().__init__()
        if not isinstance(k, int) or not 1 <= k <= hidden_size:
            raise ValueError(f"k={k!r} must be an integer in 1..{hidden_size} (the hidden size)")
        self.hidden_size, self.k = hidden_size, k
        # torch's default (dynamic trivialization), as pyvene: it optimises clearly better than the
        # plain Householder map (smollm2, layer 3: eval odds 2.48 vs 1.28), at the price of a
        # (d, d) base in the Lightning checkpoint. The exported basis is (k, d) alone.
        self.rotate = orthogonal(nn.Linear(hidden_size, k, bias=False))  # weight: (k, d)

    @property
    def basis(self) -> torch.Tensor:
        """W, (k, d), with orthonormal rows."""
        return self.rotate.weight

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        return subspace_interchange(base, self._require_source(source), self.basis)

    def export(self) -> dict[str, torch.Tensor]:
        return {"basis": self.basis.detach()}  # (k, d)

    def to_pyvene(self) -> dict:
        """The trained subspace as pyvene's intervention of the same map (`pyvene_low_rank`)."""
        return pyvene_low_rank(self.basis)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> RotatedSpaceIntervention:
        """The intervention whose basis is tensors["basis"] (k, d), orthonormal rows."""
        k, hidden_size = tensors["basis"].shape
        module = cls(hidden_size, k)
        with torch.no_grad():
            module.rotate.weight = tensors["basis"].float()  # orthogonal's right_inverse
        return module


@register_intervention
class FixedSubspaceIntervention(Intervention):
    """Interchange on a given subspace (closed-form directions, or a = 0 as a no-op control)."""

    def __init__(self, basis: torch.Tensor):
        super().__init__()
        basis = torch.as_tensor(basis, dtype=torch.float32)
        # (k, d), a fresh copy: a tensor read from a file may be unaligned, and a matrix product's
        # bits can depend on alignment (a resumed sweep scores saved DAS subspaces exactly)
        self.register_buffer("basis", basis.reshape(-1, basis.shape[-1]).clone())

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        return subspace_interchange(base, self._require_source(source), self.basis)

    def export(self) -> dict[str, torch.Tensor]:
        return {"basis": self.basis}

    def to_pyvene(self) -> dict:
        """The subspace as pyvene's intervention of the same map (`pyvene_low_rank`)."""
        return pyvene_low_rank(self.basis)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> FixedSubspaceIntervention:
        return cls(tensors["basis"])


@register_intervention
class FullSubspaceSwap(FixedSubspaceIntervention):
    """The vanilla interchange (CausalGym's full swap): the subspace is all of R^d, W = I_d, so
    f* = f(b) + (f(s) − f(b)) I I = f(s), computed as every subspace interchange is."""

    def __init__(self, hidden_size: int):
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive integer")
        super().__init__(torch.eye(hidden_size))

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> FixedSubspaceIntervention:
        return FixedSubspaceIntervention(tensors["basis"])


RotatedSpaceIntervention.frozen_class = FixedSubspaceIntervention  # a trained W, scored as fixed
