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

An attack is a class with `delta(probe, h, target, epsilon) -> δ`, the perturbation
δ = h′ − h, (batch, d), with |δ_i| ≤ ε in every coordinate: `FGSM`, `PGD` (α, T) and the control
`RandomSign` (±ε per coordinate, from its own seeded generator). A study names one by a short
name (`register_attack`: fgsm, pgd, random) or by {name, class_path, init_args}; `fgsm`, `pgd`
and `random_sign` are the same computations as functions. `add(δ)` is the intervention that writes
h + δ back into the LM's forward, for `forward.logits_at(..., intervention=add(δ))`.

As interventions (the protocol of `base.py`), bound to one probe and one ε so that they save and
serve: `GradientAttack` (PGD, or FGSM with one step of size ε) and `RandomSignIntervention`
return h + δ themselves; neither trains.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lit_interventions.interventions.base import (
    Intervention,
    class_path,
    import_class,
    loadable_class,
    register_intervention,
)
from lit_interventions.interventions.registry import MethodSpec

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


class Attack:
    """A CALM method: `delta(probe, h, target, epsilon)` is the perturbation δ, (batch, d), that the
    study writes back as h + δ, for a probe g_Z (h (batch, d) -> logits), the states h (batch, d),
    the class ids z′ to aim at (batch,) and the L∞ radius ε (absolute). Any class with such a
    `delta` serves; this base only names the interface."""

    def delta(self, probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define delta(probe, h, target, epsilon)")


class FGSM(Attack):
    """The fast gradient sign method, one full step (CALM §3, App. B.4). `targeted=False` gives the
    paper's untargeted form, δ = +ε·sign(∇_h L(g_Z(h), z)), with `target` the true class z."""

    def __init__(self, targeted: bool = True):
        self.targeted = targeted

    def delta(self, probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float) -> torch.Tensor:
        """δ = −ε·sign(∇_h L(g_Z(h), z′)) toward `target` z′ (class ids, (batch,)), (batch, d)."""
        _check(h, target, epsilon)
        with _EvalMode(probe):
            return epsilon * _signed_gradient(probe, h, target, self.targeted)


class PGD(Attack):
    """Projected gradient descent (CALM App. B.4): `steps` T sign steps of size `alpha` α (None: ε/10),
    each projected back onto the L∞ ball of radius ε around h."""

    def __init__(self, alpha: float | None = None, steps: int = 40, targeted: bool = True):
        check_pgd(alpha, steps)
        self.alpha, self.steps, self.targeted = alpha, steps, targeted

    def delta(self, probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float) -> torch.Tensor:
        """h^{t+1} = Π_{‖h′−h‖∞≤ε}(h^t − α·sign(∇_h L(g_Z(h^t), z′))), h⁰ = h; returns δ = h^T − h,
        (batch, d). The projection Π clamps every coordinate of δ to [−ε, ε]."""
        _check(h, target, epsilon)
        alpha = epsilon / 10 if self.alpha is None else self.alpha
        h = h.detach().float()
        delta = torch.zeros_like(h)
        with _EvalMode(probe):
            for _ in range(self.steps):
                step = alpha * _signed_gradient(probe, h + delta, target, self.targeted)
                delta = (delta + step).clamp(-epsilon, epsilon)  # Π onto {‖δ‖∞ ≤ ε}
        return delta


class RandomSign(Attack):
    """The control of the same size: δ = ε·s, s uniform in {−1, +1}^d per row, whatever the probe
    and target. The draws follow each other from one generator seeded with `seed` when the attack
    is built (None: torch's global RNG)."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def delta(self, probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float) -> torch.Tensor:
        """δ = ε·s, (batch, d), the next draw of this attack's generator."""
        return random_sign(h, epsilon, self.generator)


def fgsm(
    probe: Probe, h: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1, targeted: bool = True
) -> torch.Tensor:
    """`FGSM(targeted).delta(probe, h, target, epsilon)`: δ = −ε·sign(∇_h L(g_Z(h), z′)), (batch, d)."""
    return FGSM(targeted).delta(probe, h, target, epsilon)


def pgd(
    probe: Probe,
    h: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.1,
    alpha: float | None = None,
    steps: int = 40,
    targeted: bool = True,
) -> torch.Tensor:
    """`PGD(alpha, steps, targeted).delta(probe, h, target, epsilon)`: T steps of size α (default
    ε/10), each projected onto the ε ball (CALM App. B.4). Returns δ = h^T − h, (batch, d)."""
    return PGD(alpha, steps, targeted).delta(probe, h, target, epsilon)


def random_sign(h: torch.Tensor, epsilon: float = 0.1, generator: torch.Generator | None = None) -> torch.Tensor:
    """The control of the same size: δ = ε·s with s uniform in {−1, +1}^d, (batch, d)."""
    _check_epsilon(epsilon, "perturbation")
    signs = torch.randint(0, 2, h.shape, generator=generator, device="cpu").to(h.device, torch.float32)
    return epsilon * (2 * signs - 1)


def epsilon_scale(features: torch.Tensor) -> float:
    """A representation's typical coordinate scale: the median over coordinates of the per-coordinate
    standard deviation, for features (n, d). ε_absolute = ε_relative × this."""
    if features.dim() != 2 or len(features) < 2:
        raise ValueError(f"need (n >= 2, d) features to measure their scale, got {tuple(features.shape)}")
    return float(features.float().std(0).median())


def add(delta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The intervention h ↦ h + δ at the site, for `forward.logits_at(intervention=...)`."""
    return lambda h: h + delta.to(h.device, h.dtype)


def _positions(base: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, d) as is; (batch, seq, d) flattened to (batch·seq, d), each example's target repeated."""
    target = torch.as_tensor(target, device=base.device).reshape(-1)
    if base.dim() == 3:
        return base.reshape(-1, base.shape[-1]), target.repeat_interleave(base.shape[1])
    return base, target


@register_intervention
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
        _check_epsilon(epsilon)
        if step_size is not None and not step_size > 0:
            raise ValueError(f"step_size={step_size!r} must be > 0 or None (ε/10)")
        self.attack = PGD(step_size, steps, targeted)  # what computes δ
        self.probe, self.epsilon, self.steps, self.step_size, self.targeted = probe, epsilon, steps, step_size, targeted

    @classmethod
    def fgsm(cls, probe: nn.Module, epsilon: float = 0.1, targeted: bool = True) -> GradientAttack:
        """FGSM: δ = −ε·sign(∇_h L(g_Z(h), z′)), one PGD step of size ε."""
        return cls(probe, epsilon, steps=1, step_size=epsilon, targeted=targeted)

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None, *, target: torch.Tensor) -> torch.Tensor:
        self._refuse_source(source)
        h, z = _positions(base, target)
        delta = self.attack.delta(self.probe, h, z, self.epsilon)
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
    """The control: f* = h + ε·s, s uniform in {−1, +1}^d per row. With a `seed`, every call draws
    from a generator seeded afresh (the same signs for the same shape); None: torch's global RNG."""

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


# --- short names -----------------------------------------------------------------------------------
_ATTACKS: dict[str, MethodSpec] = {}
_SPEC_KEYS = ("name", "class_path", "init_args")


def register_attack(name: str, class_path: str, init_args: dict | None = None) -> MethodSpec:
    """Register a short name for an attack: the class at `class_path` (a class with
    `delta(probe, h, target, epsilon)`) built with `init_args`. Refuses a name twice."""
    if name in _ATTACKS:
        raise ValueError(f"attack {name!r} is already registered (as {_ATTACKS[name].class_path})")
    _ATTACKS[name] = spec = MethodSpec(name, class_path, dict(init_args or {}))
    return spec


def registered_attacks() -> list[str]:
    """The registered short names, in registration order."""
    return list(_ATTACKS)


def attack_spec(entry: str | dict | MethodSpec) -> MethodSpec:
    """The spec of a registered short name, of a config {name, class_path[, init_args]}, or the spec given."""
    if isinstance(entry, MethodSpec):
        return entry
    if isinstance(entry, str):
        if entry not in _ATTACKS:
            raise ValueError(f"Unknown attack {entry!r}; registered: {', '.join(_ATTACKS)}")
        return _ATTACKS[entry]
    if not isinstance(entry, dict) or not set(entry) <= set(_SPEC_KEYS):
        got = sorted(entry) if isinstance(entry, dict) else repr(entry)
        raise ValueError(
            f"an attack is a registered name ({', '.join(_ATTACKS)}) or {{name, class_path, init_args}}; got {got}"
        )
    return MethodSpec.from_config(entry)


def with_defaults(spec: MethodSpec, defaults: dict) -> MethodSpec:
    """`spec` with each of `defaults` added to its init_args where its class takes a parameter of
    that name and init_args leave it unset (a study's `alpha`, `steps` and `seed`)."""
    cls = import_class(spec.class_path)
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError) as error:
        raise ValueError(f"attack {spec.name!r}: class_path={spec.class_path!r} is not a class: {error}") from error
    filled = {k: v for k, v in defaults.items() if k in accepted and k not in spec.init_args}
    return MethodSpec(spec.name, spec.class_path, {**filled, **spec.init_args})


def build_attack(spec: MethodSpec) -> Attack:
    """A fresh instance of `spec`'s class, cls(**init_args), checked to have a `delta`."""
    cls = import_class(spec.class_path)
    try:
        built = cls(**spec.init_args)
    except TypeError as error:
        raise ValueError(f"attack {spec.name!r}: {spec.class_path}(**{spec.init_args}) failed: {error}") from error
    if not callable(getattr(built, "delta", None)):
        raise ValueError(f"attack {spec.name!r}: {spec.class_path} has no delta(probe, h, target, epsilon)")
    return built


_HERE = "lit_interventions.interventions.attacks"
register_attack("fgsm", f"{_HERE}.FGSM")
register_attack("pgd", f"{_HERE}.PGD")
register_attack("random", f"{_HERE}.RandomSign")
