"""Interventions fitted in closed form from a site's states, as one family: the interchange
module calls `fit(states, labels)` when `fit` starts (on the train split's base and source states),
then they act like any other interchange intervention. They take no gradient step.

- `FeatureInterchangeFit`: RAVEL's PCA / SAE featurizers with L1-selected features
  (`featurizers`): f* = f(b) + dec(z_mix) − dec(z(b)). With select_by="disentangle" (RAVEL) it
  offers one candidate per C (`dev_candidates`); the interchange module scores each on the dev
  split with the data's `dev_metric` and keeps the best (`choose`).
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

from lit_interventions.interventions.base import Intervention, register_intervention
from lit_interventions.interventions.directions import METHODS as DIRECTION_METHODS
from lit_interventions.interventions.directions import direction_estimator
from lit_interventions.interventions.feature_selection import DEFAULT_C_GRID, RAVEL_C_GRID, _check_C, feature_sweep
from lit_interventions.interventions.featurizers import (
    FeatureInterchange,
    PCAFeaturizer,
    SAEFeaturizer,
    featurize,
    fit_feature_interchange,
    keep_error_of,
)
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


@register_intervention
class FeatureInterchangeFit(_Fitted):
    """PCA (fitted on the states) or a trained SAE (`sae`: a `sae.safetensors` path), and the
    features an L1 classifier uses to predict the label; at most `max_features`.

    select_by:
    - "disentangle" (RAVEL, App. B.1 and the official code): for each C of the grid (default
      `RAVEL_C_GRID`) an L1 linear SVM (`LinearSVC`, the features as they are) is fitted on all the
      train states and `SelectFromModel` gives its features; the interchange module keeps the C
      whose interchange has the best Disentangle on the dev split (ties: the smaller C). An empty
      selection (the identity: Cause 0, Iso 1, Disentangle 0.5 with nothing localised) is not a
      candidate. Until then (fitted
      outside a module) the largest C's features are used.
    - "accuracy" (the earlier rule): an L1 logistic regression on features scaled to unit variance,
      C (default `DEFAULT_C_GRID`) the smallest within 0.01 of the best accuracy on a random 20%
      of the states.
    standardize: PCA of the states standardised per dimension, undone after (RAVEL); False: of
    the centred states.
    reconstruction_error: "drop" (f* = dec(z_mix), the official SAE interchange) or "keep"
    (f* = f(b) + dec(z_mix) − dec(z(b))); None: the featurizer's default (SAE drop, PCA keep).
    """

    SELECT_BY = ("disentangle", "accuracy")

    def __init__(
        self,
        hidden_size: int,
        featurizer: str = "pca",
        sae: str | None = None,
        max_features: int | None = None,
        select_by: str = "disentangle",
        C: list[float] | None = None,
        standardize: bool = True,
        reconstruction_error: str | None = None,
    ):
        super().__init__()
        self.keep_error = keep_error_of(reconstruction_error)
        if featurizer not in ("pca", "sae"):
            raise ValueError(f"featurizer={featurizer!r} is not one of pca, sae")
        if featurizer == "sae" and not sae:
            raise ValueError("featurizer='sae' needs sae=PATH (a trained sae.safetensors)")
        if sae and not Path(sae).is_file():
            raise FileNotFoundError(
                f"sae={sae!r}: no such file (train one: lit-interventions fit --config configs/sae.yaml)"
            )
        if sae:
            SAEFeaturizer.load(sae)  # a damaged or foreign file fails here, before the LM loads
        if select_by not in self.SELECT_BY:
            raise ValueError(f"select_by={select_by!r} is not one of {', '.join(self.SELECT_BY)}")
        if max_features is not None and (not isinstance(max_features, int) or max_features < 1):
            raise ValueError(f"max_features={max_features!r} must be a positive integer or null")
        self.grid = _check_C(C if C is not None else RAVEL_C_GRID if select_by == "disentangle" else DEFAULT_C_GRID)
        self.hidden_size, self.featurizer_name, self.sae, self.max_features = hidden_size, featurizer, sae, max_features
        self.select_by, self.standardize = select_by, standardize
        self.featurizer: nn.Module | None = None
        self.fitted: FeatureInterchange | None = None
        self.sweep: list[dict] = []  # per C: {"C", "n_features", "selected"} and, once chosen, the dev scores
        self.C: float | None = None

    def _featurizer(self, states: torch.Tensor) -> nn.Module:
        if self.featurizer_name == "pca":
            return PCAFeaturizer.fit(states, standardize=self.standardize)
        return SAEFeaturizer.load(self.sae)

    def fit(self, states: torch.Tensor, labels: list) -> FeatureInterchangeFit:
        featurizer = self._featurizer(states)
        if self.select_by == "accuracy":
            # C is chosen on a random 20% of the states. Holding out whole entities instead (groups=)
            # asks the classifier for the country of cities it never saw: near chance for every C on
            # gemma-3-270m's built-in cities, so the smallest C (no feature at all) was chosen.
            self.fitted = fit_feature_interchange(
                states, labels, featurizer=featurizer, C=self.grid, max_features=self.max_features
            )
            self.fitted.keep_error = self.fitted.keep_error if self.keep_error is None else self.keep_error
            self.C = self.fitted.selection.C
            self.needs_fit = False
            return self
        sweep = feature_sweep(featurize(featurizer, states).double().numpy(), labels, C=self.grid, classifier="svc")
        self.sweep = [
            r for r in sweep if r["n_features"] and (self.max_features is None or r["n_features"] <= self.max_features)
        ]
        if not self.sweep:
            raise ValueError(
                f"no C in {list(self.grid)} selects between 1 and {self.max_features or 'all'} features "
                f"(counts: {[r['n_features'] for r in sweep]}); change the C grid"
            )
        self.featurizer = featurizer
        self._use(self.sweep[-1])
        self.needs_fit = False
        return self

    def _use(self, row: dict) -> None:
        self.fitted = FeatureInterchange(self.featurizer, row["selected"].tolist(), self.keep_error).to(self._device())
        self.C = row["C"]

    def _device(self) -> torch.device:
        return self.fitted.mask.device if self.fitted is not None else torch.device("cpu")

    def _candidate_names(self) -> dict[float, str]:
        """C -> the name of its candidate, "C=<the smallest C with the same selection>"."""
        first: dict[tuple, str] = {}
        return {row["C"]: first.setdefault(tuple(row["selected"].tolist()), f"C={row['C']:g}") for row in self.sweep}

    def dev_candidates(self) -> dict[str, FeatureInterchange]:
        """One interchange per distinct selection of the sweep (named by the smallest C giving it,
        "C=<C>"): what the module scores on the dev split. Empty unless select_by="disentangle"."""
        if self.select_by != "disentangle" or self.needs_fit:
            return {}
        names = self._candidate_names()
        return {
            names[row["C"]]: FeatureInterchange(self.featurizer, row["selected"].tolist(), self.keep_error).to(
                self._device()
            )
            for row in self.sweep
            if names[row["C"]] == f"C={row['C']:g}"
        }

    def choose(self, scores: dict[str, dict]) -> None:
        """Keep the candidate with the best dev Disentangle (`scores`: name -> {cause, iso,
        disentangle}, as `dev_candidates` names them); ties go to the smaller C. Every C of the
        sweep records the dev scores of its selection."""
        names = self._candidate_names()
        if set(scores) != set(names.values()):
            raise ValueError(f"scores name {sorted(scores)}; the candidates are {sorted(set(names.values()))}")
        for row in self.sweep:
            row["dev"] = dict(scores[names[row["C"]]])
        self._use(max(self.sweep, key=lambda row: (row["dev"]["disentangle"], -row["C"])))

    def summary(self) -> str:
        scored = [r for r in self.sweep if "dev" in r]
        how = (
            "the largest of the grid, not chosen on dev"
            if self.select_by == "disentangle" and not scored
            else f"by {self.select_by}"
        )
        text = (
            f"{self.featurizer_name}: {len(self.fitted.selected)} of {self.fitted.featurizer.n_features} features "
            f"selected (C={self.C:g}, {how})"
        )
        if scored:
            text += "; dev " + ", ".join(
                f"C={r['C']:g}: {r['n_features']} features, Cause {r['dev']['cause']:.3f} Iso {r['dev']['iso']:.3f} "
                f"Disentangle {r['dev']['disentangle']:.3f}"
                for r in scored
            )
        return text

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


@register_intervention
class DirectionInterchange(_Fitted):
    """A closed-form direction (`method`: a registered direction estimator, `directions.METHODS`:
    probe, diffmean, lda, pca, kmeans, random, lat; built by its registry spec with
    `random_state=seed` where it has one) as an interchange on its span; `k` one-vs-rest directions
    when the labels have more than 2 classes."""

    def __init__(self, hidden_size: int, method: str = "diffmean", k: int = 1, seed: int = 0):
        super().__init__()
        if method not in DIRECTION_METHODS:
            raise ValueError(f"method={method!r} is not one of {', '.join(DIRECTION_METHODS)}")
        if not isinstance(k, int) or not 1 <= k <= hidden_size:
            raise ValueError(f"k={k!r} must be an integer in 1..{hidden_size}")
        self.hidden_size, self.method, self.k, self.seed = hidden_size, method, k, seed
        self.register_buffer("basis", torch.zeros(0, hidden_size))  # W, (k, d)

    def fit(self, states: torch.Tensor, labels: list) -> DirectionInterchange:
        X = states.double().numpy()
        classes = [c for c, _ in Counter(labels).most_common()]
        if len(classes) < 2:
            raise ValueError(f"{self.method} needs at least 2 classes among the labels; got {classes}")
        y = np.asarray(labels, dtype=object)
        targets = classes[:1] if len(classes) == 2 else classes[: self.k]
        directions = [
            direction_estimator(self.method, self.hidden_size, self.seed).fit(X, (y == c).astype(int)).direction_
            for c in targets
        ]
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
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], method: str = "diffmean", seed: int = 0
    ) -> DirectionInterchange:
        basis = tensors["basis"]
        fitted = cls(basis.shape[1], method=method, k=basis.shape[0], seed=seed)
        fitted.basis, fitted.needs_fit = basis.float().clone(), False
        return fitted
