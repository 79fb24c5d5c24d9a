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

The attacks are interventions (the protocol of `base.py`) whose context is the attack's:
`forward(h, probe=g_Z, target=z′, epsilon=ε) -> h′ = h + δ` with |δ_i| ≤ ε in every coordinate,
source-free (`edits_base_alone`) and never trained; a study calls them through
`capabilities.intervene(attack, h, probe=..., target=..., epsilon=...)`. `FGSM`, `PGD` (α, T) and
the control `RandomSign` (±ε per coordinate, from its own seeded generator) are registered as
`fgsm`, `pgd` and `random_sign` (`registry.py`). The functions `fgsm`, `pgd` and `random_sign`
compute their δ.

Bound to one probe and one ε, so that they save and serve: `GradientAttack` (PGD, or FGSM as one
step of size ε; its forward takes `target` alone) and `RandomSignIntervention` (no context).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lit_interventions.interventions.base import (
    Intervention,
    class_path,
    loadable_class,
    register_intervention,
)

Probe = Callable[[torch.Tensor], torch.Tensor]  # h (batch, d) -> logits (batch, 1 | classes)


def probe_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """BCE-with-logits for one logit per example (binary), else cross-entropy. logits (batch, c).
    The same loss as `modules.probe.probe_loss`, repeated here so interventions import no Lightning."""
    if logits.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(logits[:, 0].float(), target.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), target, reduction=reduction)


def _check_epsilon(epsilon: float, what: str = "attack") -> None:
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon={epsilon!r} must be a number > 0 (the L∞ radius of the {what})")


def check_pgd(alpha: float | None, steps: int) -> None:
    """PGD's settings: a step α > 0 (None: ε/10) and T >= 1 steps."""
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"alpha={alpha!r} must be > 0 (the PGD step), or null for ε/10")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")


def _check(h: torch.Tensor, target: torch.Tensor, epsilon: float) -> None:
    _check_epsilon(epsilon)
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


def _positions(base: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, d) as is; (batch, seq, d) flattened to (batch·seq, d), each example's target repeated."""
    target = torch.as_tensor(target, device=base.device).reshape(-1)
    if base.dim() == 3:
        return base.reshape(-1, base.shape[-1]), target.repeat_interleave(base.shape[1])
    return base, target


class _ProbeAttack(Intervention):
    """h′ = h + δ for a probe g_Z (h (batch, d) -> logits), the class ids z′ to aim at (batch,)
    and the L∞ radius ε (absolute); `base` (batch, d), or (batch, seq, d) with one z′ per example.
    A subclass gives δ (`_delta`)."""

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    def forward(
        self,
        base: torch.Tensor,
        source: torch.Tensor | None = None,
        *,
        probe: Probe,
        target: torch.Tensor,
        epsilon: float,
    ) -> torch.Tensor:
        self._refuse_source(source)
        h, z = _positions(base, target)
        return base + self._delta(probe, h, z, epsilon).reshape(base.shape).to(base.dtype)

    def _delta(self, probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float) -> torch.Tensor:
        raise NotImplementedError


class FGSM(_ProbeAttack):
    """The fast gradient sign method, one full step (CALM §3, App. B.4):
    h′ = h − ε·sign(∇_h L(g_Z(h), z′)) toward `target` z′. `targeted=False` gives the paper's
    untargeted form, h′ = h + ε·sign(∇_h L(g_Z(h), z)), with `target` the true class z."""

    def __init__(self, targeted: bool = True):
        super().__init__()
        self.targeted = targeted

    def _delta(self, probe, h, target, epsilon):
        return fgsm(probe, h, target, epsilon, self.targeted)

    def config(self) -> dict:
        return {"targeted": self.targeted}


class PGD(_ProbeAttack):
    """Projected gradient descent (CALM App. B.4): `steps` T sign steps of size `alpha` α (None:
    ε/10), each projected back onto the L∞ ball of radius ε around h,
    h^{t+1} = Π_{‖h′−h‖∞≤ε}(h^t − α·sign(∇_h L(g_Z(h^t), z′))), h⁰ = h, h′ = h^T."""

    def __init__(self, alpha: float | None = None, steps: int = 40, targeted: bool = True):
        super().__init__()
        check_pgd(alpha, steps)
        self.alpha, self.steps, self.targeted = alpha, steps, targeted

    def _delta(self, probe, h, target, epsilon):
        return pgd(probe, h, target, epsilon, self.alpha, self.steps, self.targeted)

    def config(self) -> dict:
        return {"alpha": self.alpha, "steps": self.steps, "targeted": self.targeted}


class RandomSign(Intervention):
    """The control of the same size: h′ = h + ε·s, s uniform in {−1, +1}^d per row, whatever the
    probe and target (the context it ignores). The draws follow each other from one generator
    seeded with `seed` when it is built (None: torch's global RNG)."""

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    def __init__(self, seed: int | None = None):
        super().__init__()
        self.seed = seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def forward(
        self, base: torch.Tensor, source: torch.Tensor | None = None, *, epsilon: float, **context
    ) -> torch.Tensor:
        """h + ε·s, the next draw of this control's generator, shaped like `base`."""
        self._refuse_source(source)
        return base + random_sign(base, epsilon, self.generator).to(base.dtype)

    def config(self) -> dict:
        return {"seed": self.seed}


def fgsm(
    probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, targeted: bool = True
) -> torch.Tensor:
    """FGSM's δ = −ε·sign(∇_h L(g_Z(h), z′)) toward `target` z′ (class ids, (batch,)), (batch, d);
    `targeted=False`: δ = +ε·sign(∇_h L(g_Z(h), z)) away from the true class z."""
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
    """PGD's δ = h^T − h, (batch, d): h^{t+1} = Π_{‖h′−h‖∞≤ε}(h^t − α·sign(∇_h L(g_Z(h^t), z′))),
    h⁰ = h, T steps of size α (None: ε/10) (CALM App. B.4). The projection Π clamps every
    coordinate of δ to [−ε, ε]."""
    check_pgd(alpha, steps)
    _check(h, target, epsilon)
    alpha = epsilon / 10 if alpha is None else alpha
    h = h.detach().float()
    delta = torch.zeros_like(h)
    with _EvalMode(probe):
        for _ in range(steps):
            step = alpha * _signed_gradient(probe, h + delta, target, targeted)
            delta = (delta + step).clamp(-epsilon, epsilon)  # Π onto {‖δ‖∞ ≤ ε}
    return delta


def random_sign(h: torch.Tensor, epsilon: float = 0.1, generator: torch.Generator | None = None) -> torch.Tensor:
    """The control of the same size: δ = ε·s with s uniform in {−1, +1}^d, shaped like h."""
    _check_epsilon(epsilon, "perturbation")
    signs = torch.randint(0, 2, h.shape, generator=generator, device="cpu").to(h.device, torch.float32)
    return epsilon * (2 * signs - 1)


def epsilon_scale(features: torch.Tensor) -> float:
    """A representation's typical coordinate scale: the median over coordinates of the per-coordinate
    standard deviation, for features (n, d). ε_absolute = ε_relative × this."""
    if features.dim() != 2 or len(features) < 2:
        raise ValueError(f"need (n >= 2, d) features to measure their scale, got {tuple(features.shape)}")
    return float(features.float().std(0).median())


@register_intervention
class GradientAttack(Intervention):
    """`PGD` bound to one probe and one ε: f* = h + δ, δ from PGD toward `target` in the L∞ ball
    of radius ε (CALM App. B.4), h^{t+1} = Π_ε(h^t − α·sign(∇_h L(g_Z(h^t), z′))). steps=1 with
    step_size=ε is FGSM exactly.

    The probe is attacked, never trained (trains=False). Export holds the probe's state
    (`probe.<name>`); config its class path and, for a `ProbeModule`, its hyperparameters, so
    `from_tensors` rebuilds it. A probe object may also be passed to `from_tensors` directly.
    """

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    def __init__(
        self,
        probe: nn.Module,
        epsilon: float = 0.1,
        steps: int = 40,
        step_size: float | None = None,
        targeted: bool = True,
    ):
        super().__init__()
        _check_epsilon(epsilon)
        if step_size is not None and not step_size > 0:
            raise ValueError(f"step_size={step_size!r} must be > 0 or None (ε/10)")
        self.attack = PGD(step_size, steps, targeted)  # what computes h′
        self.probe, self.epsilon, self.steps, self.step_size, self.targeted = probe, epsilon, steps, step_size, targeted

    @classmethod
    def fgsm(cls, probe: nn.Module, epsilon: float = 0.1, targeted: bool = True) -> GradientAttack:
        """FGSM: δ = −ε·sign(∇_h L(g_Z(h), z′)), one PGD step of size ε."""
        return cls(probe, epsilon, steps=1, step_size=epsilon, targeted=targeted)

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None, *, target: torch.Tensor) -> torch.Tensor:
        """`PGD` with this probe and ε bound: h′ = h + δ toward `target`, (batch,)."""
        self._refuse_source(source)
        return self.attack(base, probe=self.probe, target=target, epsilon=self.epsilon)

    def export(self) -> dict[str, torch.Tensor]:
        return {f"probe.{k}": v.detach() for k, v in self.probe.state_dict().items()}

    def config(self) -> dict:
        hparams = getattr(self.probe, "hparams", None)
        return {
            "probe": class_path(self.probe),
            "probe_hparams": dict(hparams) if hparams is not None else {},
            "epsilon": self.epsilon,
            "steps": self.steps,
            "step_size": self.step_size,
            "targeted": self.targeted,
        }

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], probe: str | nn.Module, probe_hparams: dict | None = None, **settings
    ) -> GradientAttack:
        """`probe`: a class path (a registered class, `loadable_class`; built with `probe_hparams`,
        loaded from `probe.*`) or a probe module."""
        if isinstance(probe, str):
            probe = loadable_class(probe, f"{cls.__name__} probe")(**(probe_hparams or {}))
            state = {k.removeprefix("probe."): v for k, v in tensors.items() if k.startswith("probe.")}
            probe.load_state_dict(state, strict=True)
            probe.eval()
        return cls(probe, **settings)


@register_intervention
class RandomSignIntervention(Intervention):
    """The control bound to one ε: f* = h + ε·s, s uniform in {−1, +1}^d per row (`random_sign`).
    With a `seed`, every call draws from a generator seeded afresh (the same signs for the same
    shape), where `RandomSign`'s draws follow each other; None: torch's global RNG."""

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    def __init__(self, epsilon: float = 0.1, seed: int | None = None):
        super().__init__()
        _check_epsilon(epsilon, "perturbation")
        self.epsilon, self.seed = epsilon, seed

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        self._refuse_source(source)
        generator = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return base + random_sign(base, self.epsilon, generator).to(base.dtype)

    def config(self) -> dict:
        return {"epsilon": self.epsilon, "seed": self.seed}
