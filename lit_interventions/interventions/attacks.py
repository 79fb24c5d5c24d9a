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

As interventions (the protocol of `base.py`): `GradientAttack` (PGD, or FGSM with one step of
size ε) and `RandomSignIntervention` return h + δ themselves; neither trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lit_interventions.interventions.base import Intervention, class_path, import_class

Probe = Callable[[torch.Tensor], torch.Tensor]  # h (batch, d) -> logits (batch, 1 | classes)
ATTACKS = ("fgsm", "pgd")


def probe_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """BCE-with-logits for one logit per example (binary), else cross-entropy. logits (batch, c).
    The same loss as `modules.probe.probe_loss`, repeated here so interventions import no Lightning."""
    if logits.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(logits[:, 0].float(), target.float(), reduction=reduction)
    return F.cross_entropy(logits.float(), target, reduction=reduction)


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


def _positions(base: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, d) as is; (batch, seq, d) flattened to (batch·seq, d), each example's target repeated."""
    target = torch.as_tensor(target, device=base.device).reshape(-1)
    if base.dim() == 3:
        return base.reshape(-1, base.shape[-1]), target.repeat_interleave(base.shape[1])
    return base, target


class GradientAttack(Intervention):
    """f* = h + δ, δ from PGD toward `target` in the L∞ ball of radius ε (CALM App. B.4):
    h^{t+1} = Π_ε(h^t − α·sign(∇_h L(g_Z(h^t), z′))). steps=1 with step_size=ε is FGSM exactly.

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
        if not (isinstance(epsilon, (int, float)) and epsilon > 0):
            raise ValueError(f"epsilon={epsilon!r} must be a number > 0 (the L∞ radius of the attack)")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r} must be an int >= 1")
        if step_size is not None and not step_size > 0:
            raise ValueError(f"step_size={step_size!r} must be > 0 or None (ε/10)")
        self.probe, self.epsilon, self.steps, self.step_size, self.targeted = probe, epsilon, steps, step_size, targeted

    @classmethod
    def fgsm(cls, probe: nn.Module, epsilon: float = 0.1, targeted: bool = True) -> GradientAttack:
        """FGSM: δ = −ε·sign(∇_h L(g_Z(h), z′)), one PGD step of size ε."""
        return cls(probe, epsilon, steps=1, step_size=epsilon, targeted=targeted)

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None, *, target: torch.Tensor) -> torch.Tensor:
        self._refuse_source(source)
        h, z = _positions(base, target)
        delta = pgd(self.probe, h, z, self.epsilon, self.step_size, self.steps, self.targeted)
        return base + delta.reshape(base.shape).to(base.dtype)

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
        """`probe`: a class path (built with `probe_hparams`, loaded from `probe.*`) or a probe module."""
        if isinstance(probe, str):
            probe = import_class(probe)(**(probe_hparams or {}))
            state = {k.removeprefix("probe."): v for k, v in tensors.items() if k.startswith("probe.")}
            probe.load_state_dict(state, strict=True)
            probe.eval()
        return cls(probe, **settings)


class RandomSignIntervention(Intervention):
    """The control: f* = h + ε·s, s uniform in {−1, +1}^d per row. With a `seed`, every call draws
    from a generator seeded afresh (the same signs for the same shape); None: torch's global RNG."""

    edits_base_alone = True  # f* = forward(f(b)): a source state is refused

    def __init__(self, epsilon: float = 0.1, seed: int | None = None):
        super().__init__()
        if not (isinstance(epsilon, (int, float)) and epsilon > 0):
            raise ValueError(f"epsilon={epsilon!r} must be a number > 0 (the L∞ radius of the perturbation)")
        self.epsilon, self.seed = epsilon, seed

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        self._refuse_source(source)
        generator = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return base + random_sign(base, self.epsilon, generator).to(base.dtype)

    def config(self) -> dict:
        return {"epsilon": self.epsilon, "seed": self.seed}
