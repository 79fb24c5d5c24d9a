"""Interventions fitted in closed form from a site's states, as one family: the interchange
module calls `fit(states, labels)` when `fit` starts (on the train split's base and source states),
then they act like any other interchange intervention. They take no gradient step.

- `FeatureInterchangeFit`: RAVEL's PCA / SAE featurizers with L1-selected features
  (`featurizers.fit_feature_interchange`): f* = f(b) + dec(z_mix) − dec(z(b)).
- `DirectionInterchange`: CausalGym's closed-form directions (DiffMean, probe, PCA, LDA, k-means,
  LAT, random; `directions.py`), on any benchmark: f* = f(b) + Wᵀ(W f(s) − W f(b)), W the
  orthonormalised directions. With two classes this is the paper's 1-D direction; with more
  (a RAVEL attribute's values) W holds the one-vs-rest directions of the `k` most frequent classes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lit_interventions.interventions.base import Intervention
from lit_interventions.interventions.directions import METHODS as DIRECTION_METHODS
from lit_interventions.interventions.directions import fit_direction
from lit_interventions.interventions.featurizers import FeatureInterchange, SAEFeaturizer, fit_feature_interchange
from lit_interventions.interventions.rotation import subspace_interchange


class _Fitted(Intervention):
    """Not trained by gradient; `needs_fit` until `fit` has run. Export gives what was fitted."""

    needs_fit = True

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        if self.needs_fit:
            raise ValueError(f"{type(self).__name__} is fitted from the training data: call fit (run `fit`) first")
        return self._forward(base, self._require_source(source))

    def export(self) -> dict[str, torch.Tensor]:
        return {} if self.needs_fit else self._export()


class FeatureInterchangeFit(_Fitted):
    """PCA (fitted on the states) or a trained SAE (`sae`: a `sae.safetensors` path), and the
    features an L1 logistic regression uses to predict the label; at most `max_features`."""

    def __init__(self, hidden_size: int, featurizer: str = "pca", sae: str | None = None, max_features: int | None = None):
        super().__init__()
        if featurizer not in ("pca", "sae"):
            raise ValueError(f"featurizer={featurizer!r} is not one of pca, sae")
        if featurizer == "sae" and not sae:
            raise ValueError("featurizer='sae' needs sae=PATH (a trained sae.safetensors)")
        if sae and not Path(sae).is_file():
            raise FileNotFoundError(f"sae={sae!r}: no such file (train one: python -m lit_interventions.modules.sae)")
        self.hidden_size, self.featurizer_name, self.sae, self.max_features = hidden_size, featurizer, sae, max_features
        self.fitted: nn.Module | None = None

    def fit(self, states: torch.Tensor, labels: list) -> "FeatureInterchangeFit":
        featurizer = "pca" if self.featurizer_name == "pca" else SAEFeaturizer.load(self.sae)
        # C is chosen on a random 20% of the states. Holding out whole entities instead (groups=)
        # asks the classifier for the country of cities it never saw: near chance for every C on
        # gemma-3-270m's built-in cities, so the smallest C (no feature at all) was chosen.
        self.fitted = fit_feature_interchange(states, labels, featurizer=featurizer, max_features=self.max_features)
        self.needs_fit = False
        return self

    def summary(self) -> str:
        return (f"{self.featurizer_name}: {len(self.fitted.selected)} of {self.fitted.featurizer.n_features} features "
                f"selected (C={self.fitted.selection.C})")  # fmt: skip

    def _forward(self, base, source):
        return self.fitted(base, source)

    def _export(self):
        return self.fitted.export()

    def config(self) -> dict:
        return self.fitted.config() if self.fitted is not None else {}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], **config) -> FeatureInterchange:
        """The fitted feature interchange itself (PCA or SAE featurizer, selected features)."""
        return FeatureInterchange.from_tensors(tensors, **config)


class DirectionInterchange(_Fitted):
    """A closed-form direction (`method`: diffmean, probe, pca, lda, kmeans, lat, random) as an
    interchange on its span; `k` one-vs-rest directions when the labels have more than 2 classes."""

    def __init__(self, hidden_size: int, method: str = "diffmean", k: int = 1, seed: int = 0):
        super().__init__()
        if method not in DIRECTION_METHODS:
            raise ValueError(f"method={method!r} is not one of {', '.join(DIRECTION_METHODS)}")
        if not isinstance(k, int) or not 1 <= k <= hidden_size:
            raise ValueError(f"k={k!r} must be an integer in 1..{hidden_size}")
        self.hidden_size, self.method, self.k, self.seed = hidden_size, method, k, seed
        self.register_buffer("basis", torch.zeros(0, hidden_size))  # W, (k, d)

    def _options(self) -> dict:
        return {"random_state": self.seed} if self.method in ("probe", "pca", "kmeans", "random", "lat") else {}

    def fit(self, states: torch.Tensor, labels: list) -> "DirectionInterchange":
        X = states.double().numpy()
        classes = [c for c, _ in Counter(labels).most_common()]
        if len(classes) < 2:
            raise ValueError(f"{self.method} needs at least 2 classes among the labels; got {classes}")
        y = np.asarray(labels, dtype=object)
        targets = classes[:1] if len(classes) == 2 else classes[: self.k]
        directions = [fit_direction(self.method, X, (y == c).astype(int), **self._options()) for c in targets]
        basis = torch.linalg.qr(torch.stack(directions).double().T).Q.T.float()  # orthonormal rows, (k, d)
        self.basis = basis.to(self.basis.device)
        self.needs_fit = False
        return self

    def summary(self) -> str:
        return f"{self.method}: a {self.basis.shape[0]}-dimensional subspace"

    def _forward(self, base, source):
        return subspace_interchange(base, source, self.basis)

    def _export(self):
        return {"basis": self.basis}

    def config(self) -> dict:
        return {"method": self.method, "seed": self.seed}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], method: str = "diffmean", seed: int = 0) -> "DirectionInterchange":
        basis = tensors["basis"]
        fitted = cls(basis.shape[1], method=method, k=basis.shape[0], seed=seed)
        fitted.basis, fitted.needs_fit = basis.float().clone(), False
        return fitted
