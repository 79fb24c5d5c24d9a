"""Differentiable binary masks (DBM / MDBM; RAVEL §4, after Csordás et al. and pyvene).

f*(b, s) = (1 − σ(m/T)) ∘ f(b) + σ(m/T) ∘ f(s) in training, with the temperature T annealed
towards 0 so the mask becomes binary; the loss adds λ‖σ(m/T)‖₁ to keep the swapped dimensions
few. In evaluation (`.eval()`) the mask is hard, 1[σ(m/T) > ½], as the official RAVEL code's
`DifferentialBinaryMasking` evaluates: the dimensions it swaps are swapped whole.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_interventions.interventions.base import Intervention, register_intervention


@register_intervention
class SigmoidMaskIntervention(Intervention):
    """A learned soft mask over the d dimensions of the residual stream. As pyvene's
    `SigmoidMaskIntervention`: m starts at 0 (σ = ½) and T at 1e-2; the training module sets T.
    Exports the logits m and T (what rebuilds it exactly) and `mask` = σ(m/T) (what it swaps in
    training; in evaluation it swaps the dimensions where that is above ½)."""

    trains = True

    def __init__(self, hidden_size: int, temperature: float = 1e-2, temperature_end: float | None = None):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        if temperature_end is not None and not temperature >= temperature_end > 0:
            raise ValueError(f"temperatures must satisfy start >= end > 0, got {temperature!r}, {temperature_end!r}")
        self.temperature_start, self.temperature_end = float(temperature), temperature_end
        self.mask = nn.Parameter(torch.zeros(hidden_size))  # m, (d,)
        self.register_buffer("temperature", torch.tensor(float(temperature)))

    def anneal(self, step: int, total: int) -> None:
        """T at training `step` of `total`: linear from the start to `temperature_end` (if set)."""
        if self.temperature_end is not None:
            self.temperature.fill_(linear_temperature(step, total, self.temperature_start, self.temperature_end))

    def weights(self) -> torch.Tensor:
        """σ(m/T), (d,): how much of each dimension comes from the source."""
        return torch.sigmoid(self.mask / self.temperature)

    def penalty(self) -> torch.Tensor:
        """‖σ(m/T)‖₁, the sparsity term of the DBM loss."""
        return self.weights().sum()

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        weights = self.weights()
        if not self.training:  # evaluation: the hard mask 1[σ(m/T) > ½]
            weights = (weights > 0.5).to(weights)
        weights = weights.to(base.dtype)
        return (1 - weights) * base + weights * self._require_source(source)

    def export(self) -> dict[str, torch.Tensor]:
        return {
            "logits": self.mask.detach(),
            "temperature": self.temperature.reshape(1),
            "mask": self.weights().detach(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> SigmoidMaskIntervention:
        """From the logits m (d,) and the temperature T (1,); `mask` is derived, not read."""
        module = cls(tensors["logits"].shape[0], float(tensors["temperature"].reshape(())))
        with torch.no_grad():
            module.mask.copy_(tensors["logits"])
        return module


def linear_temperature(step: int, total: int, start: float = 1e-2, end: float = 1e-7) -> float:
    """T at `step` of `total`, linear from `start` to `end` (torch.linspace, as pyvene's tutorials)."""
    if total <= 1:
        return end
    return start + (end - start) * min(step, total - 1) / (total - 1)
