"""Two methods a user writes in a file of their own, outside the package: a YAML names them by
class path (`tests.user_methods.Line`, `tests.user_methods.Reflection`) and every study runs them.

- `Line`: a trained 1-D interchange on u = v/‖v‖, f* = f(b) + (u·f(s) − u·f(b)) u.
- `Reflection`: a trained source-free edit, the reflection of f(b) in the hyperplane ⊥ u,
  f* = f(b) − 2(u·f(b)) u (`edits_base_alone`: it is given no source).
- `AwayFromBase`: an objective of their own, per row −log(1 − p*(y_b | b, s)): push the answer
  off the base's label rather than onto the source's.
- `ScaledFGSM`: an attack of their own for CALM, taking the attack's context (probe, target, ε):
  h′ = h + s·δ_FGSM (s = 1: FGSM exactly; s = 0: h itself).
- `PositiveMean`: a direction estimator of their own (scikit-learn style, `fit(X)` sets
  `direction_`), the normalised mean of the rows; unsupervised, so AxBench fits it per concept on
  the concept's positive tokens alone: w_c = mean(H⁺_c)/‖mean(H⁺_c)‖.
"""

import torch
from torch import nn

from lit_interventions.interventions.attacks import fgsm
from lit_interventions.interventions.base import Intervention, register_intervention
from lit_interventions.objectives import Objective


class _UnitVector(Intervention):
    """A learned direction u = v/‖v‖ (exported as `v`)."""

    trains = True

    def __init__(self, hidden_size: int, scale: float = 1.0):
        super().__init__()
        self.v = nn.Parameter(scale * torch.randn(hidden_size))

    def unit(self, like: torch.Tensor) -> torch.Tensor:
        return (self.v / self.v.norm()).to(like.dtype)

    def export(self):
        return {"v": self.v.detach()}

    @classmethod
    def from_tensors(cls, tensors):
        made = cls(tensors["v"].shape[0])
        with torch.no_grad():
            made.v.copy_(tensors["v"])
        return made


@register_intervention
class Line(_UnitVector):
    """f* = f(b) + (u·f(s) − u·f(b)) u."""

    def forward(self, base, source=None):
        u = self.unit(base)
        return base + ((self._require_source(source) - base) @ u)[:, None] * u


@register_intervention
class Reflection(_UnitVector):
    """f* = f(b) − 2(u·f(b)) u, with no source."""

    edits_base_alone = True

    def forward(self, base, source=None):
        self._refuse_source(source)
        u = self.unit(base)
        return base - 2 * (base @ u)[..., None] * u


class AwayFromBase(Objective):
    """Per row −log(1 − p*(y_b)), the mean over a batch (`Objective.reduce`)."""

    def row_losses(self, logits, batch):
        log_p = torch.log_softmax(logits.float(), dim=-1).gather(1, batch.base.label[:, None])[:, 0]
        return -torch.log1p(-log_p.exp().clamp(max=1 - 1e-6))


class ScaledFGSM(Intervention):
    """h′ = h + s·δ, δ = −ε·sign(∇_h L(g_Z(h), z′)) (FGSM), with no source."""

    edits_base_alone = True

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale

    def forward(self, base, source=None, *, probe, target, epsilon):
        self._refuse_source(source)
        return base + self.scale * fgsm(probe, base, target, epsilon)


class PositiveMean:
    """a = mean(X)/‖mean(X)‖; unsupervised (`_supervised = False`: y, if given, is not used)."""

    _supervised = False

    def fit(self, X, y=None):
        a = torch.as_tensor(X, dtype=torch.float64).mean(0)
        self.direction_ = (a / a.norm()).float()
        return self
