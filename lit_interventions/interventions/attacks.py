"""Gradient-based interventions (GBIs) against a probe, CALM (Davies et al.) §3 and App. B.4.

The probe g_Z is attacked in an L∞ ball of radius ε around the hidden state h, toward a chosen
value z′ of the property (targeted: *minimise* the probe's loss for z′):
- FGSM: h′ = h − ε·sign(∇_h L(g_Z(h), z′))
- PGD:  h^{t+1} = Π_{‖h′−h‖∞≤ε}(h^t − α·sign(∇_h L(g_Z(h^t), z′))), h⁰ = h, T steps, h′ = h^T.
The paper writes the untargeted form h + ε·sign(∇_h L(g_Z(h), z)) for its binary properties; for
two classes that is the same step as ours toward the other class (`targeted=False` gives it).

Defaults are the paper's: ε = 0.1, α = ε/10, T = 40 (chosen there by grid search over
α ∈ {0.001, 0.003, 0.01, 0.03}, T ∈ {20, …, 100}). The paper's ε is **absolute**: an L∞ radius in
BERT's raw final-layer space (no normalisation is mentioned). Residual streams of other models
have other scales (Gemma's reach the hundreds), so `epsilon_scale` gives a scale-relative ε.

Every attack returns the perturbation δ = h′ − h, (batch, d), with |δ_i| ≤ ε in every coordinate;
`add(δ)` is the intervention that writes h + δ back into the LM's forward, for
`sites.logits_at(..., intervention=add(δ))`. `random_sign` is the control: ±ε per coordinate.
"""

from __future__ import annotations

from typing import Callable

import torch

from lit_interventions.modules.probe import probe_loss

Probe = Callable[[torch.Tensor], torch.Tensor]  # h (batch, d) -> logits (batch, 1 | classes)
ATTACKS = ("fgsm", "pgd")


def _check(h: torch.Tensor, target: torch.Tensor, epsilon: float) -> None:
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be a number > 0 (the L∞ radius of the attack)")
    if h.dim() != 2 or target.shape != h.shape[:1]:
        raise ValueError(f"h must be (batch, d) and target (batch,); got {tuple(h.shape)} and {tuple(target.shape)}")


def _signed_gradient(probe: Probe, h: torch.Tensor, target: torch.Tensor, targeted: bool) -> torch.Tensor:
    """sign of the descent direction: −∇L(z′) when targeted, +∇L(z) when not, (batch, d)."""
    with torch.enable_grad():
        h = h.detach().float().requires_grad_(True)
        loss = probe_loss(probe(h), target, reduction="sum")  # sum: each row's gradient is its own
        (grad,) = torch.autograd.grad(loss, h)
    return -grad.sign() if targeted else grad.sign()


class _EvalMode:
    """The probe in eval mode (no dropout) during an attack; its mode is restored afterwards."""

    def __init__(self, probe: Probe):
        self.probe, self.was = probe, getattr(probe, "training", None)

    def __enter__(self):
        if self.was is not None:
            self.probe.eval()

    def __exit__(self, *exc):
        if self.was:
            self.probe.train()


def fgsm(
    probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, targeted: bool = True
) -> torch.Tensor:
    """FGSM toward `target` (class ids, (batch,)): δ = −ε·sign(∇_h L(g_Z(h), z′)), (batch, d)."""
    _check(h, target, epsilon)
    with _EvalMode(probe):
        return epsilon * _signed_gradient(probe, h, target, targeted)


def pgd(
    probe: Probe,
    h: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.1,
    alpha: float | None = None,
    steps: int = 40,
    targeted: bool = True,
) -> torch.Tensor:
    """PGD toward `target`: T steps of size α (default ε/10), each projected onto the ε ball
    (CALM App. B.4). Returns δ = h^T − h, (batch, d)."""
    _check(h, target, epsilon)
    alpha = epsilon / 10 if alpha is None else alpha
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r} must be > 0")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    h = h.detach().float()
    delta = torch.zeros_like(h)
    with _EvalMode(probe):
        for _ in range(steps):
            step = alpha * _signed_gradient(probe, h + delta, target, targeted)
            delta = (delta + step).clamp(-epsilon, epsilon)  # Π onto {‖δ‖∞ ≤ ε}
    return delta


def random_sign(h: torch.Tensor, epsilon: float = 0.1, generator: torch.Generator | None = None) -> torch.Tensor:
    """The control of the same size: δ = ε·s with s uniform in {−1, +1}^d, (batch, d)."""
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be a number > 0 (the L∞ radius of the perturbation)")
    signs = torch.randint(0, 2, h.shape, generator=generator, device="cpu").to(h.device, torch.float32)
    return epsilon * (2 * signs - 1)


def attack(
    name: str,
    probe: Probe,
    h: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.1,
    alpha: float | None = None,
    steps: int = 40,
    targeted: bool = True,
) -> torch.Tensor:
    """δ from the attack `name` ("fgsm" or "pgd"; alpha and steps are PGD's), (batch, d)."""
    if name == "fgsm":
        return fgsm(probe, h, target, epsilon, targeted)
    if name == "pgd":
        return pgd(probe, h, target, epsilon, alpha, steps, targeted)
    raise ValueError(f"Unknown attack {name!r}; choose one of {', '.join(ATTACKS)}")


def epsilon_scale(features: torch.Tensor) -> float:
    """A representation's typical coordinate scale: the median over coordinates of the per-coordinate
    standard deviation, for features (n, d). ε_absolute = ε_relative × this."""
    if features.dim() != 2 or len(features) < 2:
        raise ValueError(f"need (n >= 2, d) features to measure their scale, got {tuple(features.shape)}")
    return float(features.float().std(0).median())


def add(delta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The intervention h ↦ h + δ at the site, for `sites.logits_at(intervention=...)`."""
    return lambda h: h + delta.to(h.device, h.dtype)
