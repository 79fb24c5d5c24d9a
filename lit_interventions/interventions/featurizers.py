"""PCA and SAE featurizers with L1 feature selection: RAVEL's baselines (Huang et al. 2024, §3.1-3.2, App. B.1).

A featurizer maps a site representation x (d,) to features z (m,) and back. An interchange on a
set S of selected features swaps those features of the source into the base:

    z_mix = z(b) with z_S replaced by z(s)_S
    f*    = f(b) + dec(z_mix) − dec(z(b))

so the base keeps its own reconstruction error (what the featurizer cannot express is never
lost). Hence an empty S is exactly the identity, and with a full-rank PCA (m = d) and S = all
features f* = f(s), the full-vector swap.

Featurizers:
- `PCAFeaturizer`: z = V ((x − μ) / σ), x = σ ⊙ (Vᵀ z) + μ, V the principal axes (m × d,
  orthonormal rows) of the train states standardised per dimension (RAVEL App. B.1: "normalized to
  zero-mean and unit-variance ... We undo the normalization after projecting back"); σ = 1 when
  fitted with standardize=False (PCA of the raw centred states).
- `SAEFeaturizer`: f = ReLU(W1 (x − b2) + b1), decoder W2 f + b2 (a trained
  `lit_interventions.modules.sae.SparseAutoencoder`, latent size 4d).

Feature selection, for each C of a grid (smaller C, fewer features):
- classifier="svc" (the official RAVEL code, `select_features_with_classifier`): a linear SVM with
  an L1 penalty, `LinearSVC(penalty="l1", dual=False, max_iter=5000, tol=0.01)`, on the features
  as they are, and `SelectFromModel` keeps the features whose coefficients (L1 norm over the
  one-vs-rest classes) reach 1e-5;
- classifier="logistic": an L1 logistic regression (liblinear, one-vs-rest) on features scaled to
  unit variance; the features with a nonzero coefficient for any value.
`feature_sweep` gives each C's features (fitted on all train rows): RAVEL then picks C by the
Disentangle of the interchange on the dev split (`fitted.FeatureInterchangeFit`, select_by=
"disentangle"). `select_features` picks C by a classifier's held-out accuracy instead (the
smallest C within a tolerance of the best).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sklearn
import torch
from sklearn.decomposition import PCA
from sklearn.feature_selection import SelectFromModel
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC
from torch import nn

from lit_interventions.interventions.base import Intervention, class_path, import_class

DEFAULT_C_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # the L1 logistic regression's (scaled features)
RAVEL_C_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0)  # the paper's {0.1, 1, 10, 1000} and the code's {0.1, 10, 100, 1000}
CLASSIFIERS = ("svc", "logistic")


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.double() if value.is_floating_point() else value).numpy()
    return np.asarray(value)


def _check_representations(X, name: str = "representations") -> np.ndarray:
    X = _to_numpy(X)
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n_examples, size); got shape {X.shape}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {X.shape}); at least one row and one column are required")
    if not np.issubdtype(X.dtype, np.number) or np.iscomplexobj(X):
        raise ValueError(f"{name} must be real numbers; got dtype {X.dtype}")
    X = X.astype(np.float64)
    if not np.isfinite(X).all():
        raise ValueError(f"{name} contains {int((~np.isfinite(X)).sum())} NaN or infinite value(s)")
    return X


def _check_labels(y, n: int, name: str = "labels") -> np.ndarray:
    y = _to_numpy(y)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with one label per example ({n}); got shape {y.shape}")
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError(
            f"{name} has {len(classes)} distinct value(s) ({classes.tolist()}); selecting features for an "
            "attribute needs at least 2"
        )
    return y


def _check_C(C) -> tuple[float, ...]:
    grid = tuple(np.atleast_1d(np.asarray(C, dtype=np.float64)).tolist())
    if not grid:
        raise ValueError("C is an empty grid; give a positive number or a non-empty list of them")
    bad = [c for c in grid if not np.isfinite(c) or c <= 0]
    if bad:
        raise ValueError(f"C must be finite and > 0 (inverse L1 strength); got {bad}")
    return grid


# --------------------------------------------------------------------------------------------
# Featurizers


class PCAFeaturizer(nn.Module):
    """z = V ((x − μ) / σ), x̂ = σ ⊙ (Vᵀ z) + μ; V (m × d) the principal axes of the standardised
    site representations (σ = 1: of the centred ones)."""

    def __init__(self, mean: torch.Tensor, components: torch.Tensor, scale: torch.Tensor | None = None):
        super().__init__()
        components = torch.as_tensor(components, dtype=torch.float32)
        mean = torch.as_tensor(mean, dtype=torch.float32)
        if components.ndim != 2 or mean.shape != (components.shape[1],):
            raise ValueError(
                f"components must be (m, d) and mean (d,); got {tuple(components.shape)}, {tuple(mean.shape)}"
            )
        scale = torch.ones_like(mean) if scale is None else torch.as_tensor(scale, dtype=torch.float32)
        if scale.shape != mean.shape or not bool((scale > 0).all()):
            raise ValueError(f"scale must be ({mean.shape[0]},) and positive; got shape {tuple(scale.shape)}")
        self.register_buffer("mean", mean)  # (d,) μ
        self.register_buffer("scale", scale)  # (d,) σ, the per-dimension standard deviation (or 1)
        self.register_buffer("components", components)  # (m, d), orthonormal rows

    @classmethod
    def fit(cls, representations, n_components: int | None = None, standardize: bool = True) -> PCAFeaturizer:
        """sklearn StandardScaler then PCA on (N, d) representations; n_components ≤ min(N, d)
        (default: min(N, d)). standardize=False: centred only (σ = 1). A constant dimension keeps
        σ = 1 (StandardScaler's rule)."""
        X = _check_representations(representations)
        limit = min(X.shape)
        if n_components is None:
            n_components = limit
        if not isinstance(n_components, int) or not 1 <= n_components <= limit:
            raise ValueError(f"n_components={n_components!r} must be an integer in 1..{limit} (min(N, d))")
        scaler = StandardScaler(with_std=standardize).fit(X)
        pca = PCA(n_components=n_components, svd_solver="full").fit(scaler.transform(X))
        scale = torch.from_numpy(scaler.scale_) if standardize else None
        return cls(torch.from_numpy(scaler.mean_), torch.from_numpy(pca.components_), scale)

    @property
    def n_features(self) -> int:
        return self.components.shape[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., m)
        return ((x - self.mean) / self.scale) @ self.components.T

    def decode(self, z: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., d)
        return (z @ self.components) * self.scale + self.mean


class SAEFeaturizer(nn.Module):
    """f = ReLU(W1 (x − b2) + b1), x̂ = W2 f + b2.  W1: (m, d), b1: (m,), W2: (d, m), b2: (d,)."""

    def __init__(self, W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor):
        super().__init__()
        W1, b1, W2, b2 = (torch.as_tensor(t, dtype=torch.float32).detach().clone() for t in (W1, b1, W2, b2))
        m, d = W1.shape
        if b1.shape != (m,) or W2.shape != (d, m) or b2.shape != (d,):
            raise ValueError(
                f"SAE shapes must be W1 (m, d), b1 (m,), W2 (d, m), b2 (d,); got {tuple(W1.shape)}, "
                f"{tuple(b1.shape)}, {tuple(W2.shape)}, {tuple(b2.shape)}"
            )
        for name, t in (("W1", W1), ("b1", b1), ("W2", W2), ("b2", b2)):
            self.register_buffer(name, t)

    @classmethod
    def from_sae(cls, sae: nn.Module) -> SAEFeaturizer:
        """From a `SparseAutoencoder` (or anything with `export_weights()` -> {W1, b1, W2, b2})."""
        return cls(**sae.export_weights())

    @classmethod
    def load(cls, path: str | Path) -> SAEFeaturizer:
        """From a safetensors file holding W1, b1, W2, b2 (as `modules/sae.py` writes it)."""
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        missing = {"W1", "b1", "W2", "b2"} - set(tensors)
        if missing:
            raise ValueError(f"{path} lacks the SAE tensor(s) {sorted(missing)}; it holds {sorted(tensors)}")
        return cls(**{k: tensors[k] for k in ("W1", "b1", "W2", "b2")})

    @property
    def n_features(self) -> int:
        return self.W1.shape[0]

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., m)
        return torch.relu((x - self.b2) @ self.W1.T + self.b1)

    def decode(self, f: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., d)
        return f @ self.W2.T + self.b2


@torch.no_grad()
def featurize(featurizer: nn.Module, representations, batch_size: int = 4096) -> torch.Tensor:
    """z(x) for (N, d) representations, float32 on CPU, in batches."""
    X = torch.as_tensor(_check_representations(representations), dtype=torch.float32)
    device = next(iter(featurizer.buffers()), X).device
    return torch.cat([featurizer.encode(chunk.to(device)).cpu() for chunk in X.split(batch_size)])


# --------------------------------------------------------------------------------------------
# Interventions


class FeatureInterchange(Intervention):
    """f* = f(b) + dec(z_mix) − dec(z(b)), z_mix = z(b) with the selected features taken from z(s).

    `selected`: feature indices (any iterable of ints in 0..m−1, possibly empty).
    keep_error=False gives f* = dec(z_mix) instead: the base's reconstruction error is dropped
    (then an empty selection is dec(z(b)), not f(b)); an option for comparison, not the default.
    Exports the featurizer's buffers (as `featurizer.<name>`, its constructor's arguments) and the
    selected indices; `config()` names the featurizer's class.
    """

    def __init__(self, featurizer: nn.Module, selected, keep_error: bool = True):
        super().__init__()
        self.keep_error = keep_error
        m = featurizer.n_features
        selected = torch.as_tensor(list(selected), dtype=torch.long).reshape(-1)
        if len(selected) and (selected.min() < 0 or selected.max() >= m):
            raise ValueError(f"selected feature indices must be in 0..{m - 1}; got {selected.tolist()}")
        mask = torch.zeros(m, dtype=torch.bool)
        mask[selected] = True
        self.featurizer = featurizer
        self.register_buffer("mask", mask)  # (m,)

    @property
    def selected(self) -> torch.Tensor:
        return self.mask.nonzero().flatten()

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:  # (..., d) -> (..., d)
        dtype = base.dtype
        base32, source32 = base.float(), self._require_source(source).float()
        z_base = self.featurizer.encode(base32)  # (B, m)
        z_mix = torch.where(self.mask, self.featurizer.encode(source32), z_base)
        if not self.keep_error:
            return self.featurizer.decode(z_mix).to(dtype)
        delta = self.featurizer.decode(z_mix) - self.featurizer.decode(z_base)  # exactly 0 where z_mix == z(b)
        return (base32 + delta).to(dtype)

    def export(self) -> dict[str, torch.Tensor]:
        tensors = {f"featurizer.{name}": t for name, t in self.featurizer.named_buffers()}
        return {**tensors, "selected": self.selected.float()}  # indices < 2²⁴: exact in float32

    def config(self) -> dict:
        return {"featurizer": class_path(self.featurizer), "keep_error": self.keep_error}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], featurizer: str = class_path(PCAFeaturizer), keep_error: bool = True
    ) -> FeatureInterchange:
        """`featurizer`: the class path of a featurizer built from its buffers (PCA or SAE)."""
        buffers = {k.removeprefix("featurizer."): v for k, v in tensors.items() if k.startswith("featurizer.")}
        selected = tensors["selected"].round().long().tolist()
        return cls(import_class(featurizer)(**buffers), selected, keep_error)


class FullVectorSwap(Intervention):
    """The full-vector swap baseline: f* = f(s). `hidden_size` is accepted, as every intervention
    is built with it, and unused."""

    def __init__(self, hidden_size: int | None = None):
        super().__init__()

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        return self._require_source(source).to(base.dtype)


# --------------------------------------------------------------------------------------------
# Feature selection


def _l1_logistic(C: float, max_iter: int) -> OneVsRestClassifier:
    """L1 logistic regression, one binary liblinear fit per class (one in all for two classes)."""
    if tuple(int(p) for p in sklearn.__version__.split(".")[:2]) >= (1, 8):
        penalty = {"l1_ratio": 1.0}  # `penalty=` is deprecated from 1.8
    else:
        penalty = {"penalty": "l1"}
    return OneVsRestClassifier(
        LogisticRegression(solver="liblinear", C=C, max_iter=max_iter, random_state=0, **penalty)
    )


def _l1_svc(C: float) -> LinearSVC:
    """The official RAVEL feature classifier: an L1 linear SVM (liblinear, primal, one-vs-rest)."""
    return LinearSVC(C=C, penalty="l1", dual=False, max_iter=5000, tol=0.01)


def _used_features(classifier) -> np.ndarray:
    """Feature indices an L1 classifier uses: a nonzero coefficient for any class (logistic), or
    what `SelectFromModel` keeps (svc: ‖coef_j‖₁ over classes ≥ 1e-5, its threshold for L1 models)."""
    if isinstance(classifier, LinearSVC):
        return np.flatnonzero(SelectFromModel(classifier, prefit=True).get_support())
    coef = np.concatenate([est.coef_ for est in classifier.estimators_])  # (classes or 1, m)
    return np.flatnonzero(np.abs(coef).max(0) > 0)


def _check_classifier(classifier: str) -> None:
    if classifier not in CLASSIFIERS:
        raise ValueError(f"classifier={classifier!r} is not one of {', '.join(CLASSIFIERS)}")


def _fit_classifier(classifier: str, C: float, X: np.ndarray, y: np.ndarray, max_iter: int):
    model = _l1_svc(C) if classifier == "svc" else _l1_logistic(C, max_iter)
    return model.fit(X, y)


def feature_sweep(
    features, labels, C=RAVEL_C_GRID, classifier: str = "svc", standardize: bool = False, max_iter: int = 1000
) -> list[dict]:
    """For each C (ascending) the features an L1 classifier of `labels` on `features` uses, fitted
    on all rows: [{"C", "n_features", "selected"}]. RAVEL chooses among them by dev Disentangle.

    features: (N, m); labels: (N,), ≥ 2 classes. standardize=True scales each feature to unit
    variance for the fit (the official code does not: features as the featurizer gives them).
    """
    X = _check_representations(features, "features")
    y = _check_labels(labels, X.shape[0])
    _check_classifier(classifier)
    if standardize:
        X = StandardScaler().fit_transform(X)
    sweep = []
    for c in sorted(_check_C(C)):
        used = _used_features(_fit_classifier(classifier, c, X, y, max_iter))
        sweep.append({"C": c, "n_features": len(used), "selected": used})
    return sweep


@dataclass
class FeatureSelection:
    """Result of `select_features`: the chosen C, its features, and the whole sweep."""

    selected: np.ndarray  # feature indices (sorted)
    C: float
    dev_accuracy: float
    sweep: list[dict] = field(default_factory=list)  # per C: {"C", "n_features", "dev_accuracy", "selected"}


def _holdout(n: int, fraction: float, seed: int, groups=None) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, dev rows): a random `fraction` of the rows, or of the groups when given."""
    rng = np.random.default_rng(seed)
    if groups is None:
        order = rng.permutation(n)
        n_dev = min(n - 2, max(1, int(round(fraction * n))))
        return order[n_dev:], order[:n_dev]
    names = np.unique(groups)
    if len(names) < 2:
        raise ValueError(f"groups has {len(names)} distinct value(s); a grouped holdout needs at least 2")
    dev_groups = rng.permutation(names)[: min(len(names) - 1, max(1, int(round(fraction * len(names)))))]
    dev = np.isin(groups, dev_groups)
    return np.flatnonzero(~dev), np.flatnonzero(dev)


def select_features(
    features,
    labels,
    C=DEFAULT_C_GRID,
    dev_features=None,
    dev_labels=None,
    max_features: int | None = None,
    tolerance: float = 0.01,
    dev_fraction: float = 0.2,
    groups=None,
    standardize: bool = True,
    max_iter: int = 1000,
    seed: int = 0,
) -> FeatureSelection:
    """Features with a nonzero coefficient in an L1 logistic regression of `labels` on `features`.

    features: (N, m); labels: (N,), the target attribute's values (any hashable labels, ≥ 2 classes).
    C: one value or a grid (sklearn's inverse L1 strength: smaller C, fewer features).

    How C is chosen:
    - each C is fitted on the train rows and scored (accuracy) on the dev rows: `dev_features` /
      `dev_labels` if given, else a random `dev_fraction` of the rows held out (of the `groups`,
      (N,) ids such as the entity of each row, when given: then no entity is on both sides) and
      the selection refitted on all rows at the chosen C;
    - default: the smallest C (fewest features) whose dev accuracy is within `tolerance` of the
      best dev accuracy of the sweep (tolerance=0: the best, ties to the smaller C). Accuracy
      alone creeps up with every noise feature a larger C admits, so some slack is needed;
    - with `max_features`: only Cs whose selection has at most that many features compete.
    With standardize=True each feature is scaled to unit variance for the fit, so the penalty
    does not favour high-variance features (PCA's first axes, frequent SAE latents).
    """
    X = _check_representations(features, "features")
    y = _check_labels(labels, X.shape[0])
    grid = sorted(_check_C(C))
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} must be in [0, 1) (an accuracy difference)")
    if max_features is not None and (not isinstance(max_features, int) or max_features < 1):
        raise ValueError(f"max_features={max_features!r} must be a positive integer or None")
    if dev_features is not None or dev_labels is not None:
        if dev_features is None or dev_labels is None:
            raise ValueError("give both dev_features and dev_labels, or neither")
        X_dev = _check_representations(dev_features, "dev_features")
        if X_dev.shape[1] != X.shape[1]:
            raise ValueError(f"dev_features has {X_dev.shape[1]} columns; features has {X.shape[1]}")
        y_dev = _to_numpy(dev_labels)
        if y_dev.shape != (X_dev.shape[0],):
            raise ValueError(f"dev_labels must have shape ({X_dev.shape[0]},); got {y_dev.shape}")
        X_fit, y_fit, refit = X, y, False
    else:
        if not 0 < dev_fraction < 1:
            raise ValueError(f"dev_fraction={dev_fraction!r} must be in (0, 1)")
        if X.shape[0] < 3:
            raise ValueError(f"need at least 3 examples to hold out a dev part; got {X.shape[0]}")
        if groups is not None:
            groups = _to_numpy(groups)
            if groups.shape != (X.shape[0],):
                raise ValueError(f"groups must have shape ({X.shape[0]},), one id per example; got {groups.shape}")
        fit_rows, dev_rows = _holdout(X.shape[0], dev_fraction, seed, groups)
        X_fit, y_fit, X_dev, y_dev, refit = X[fit_rows], y[fit_rows], X[dev_rows], y[dev_rows], True
        if len(np.unique(y_fit)) < 2:
            raise ValueError("the train part of the holdout has one class only; give dev_features/dev_labels")
    scaler = StandardScaler(with_mean=True, with_std=standardize).fit(X_fit)
    sweep = []
    for c in grid:
        classifier = _l1_logistic(c, max_iter).fit(scaler.transform(X_fit), y_fit)
        used = _used_features(classifier)
        accuracy = float(classifier.score(scaler.transform(X_dev), y_dev))
        sweep.append({"C": c, "n_features": len(used), "dev_accuracy": accuracy, "selected": used})
    candidates = [r for r in sweep if max_features is None or r["n_features"] <= max_features]
    if not candidates:
        raise ValueError(
            f"no C in {grid} selects at most max_features={max_features} features (fewest: "
            f"{min(r['n_features'] for r in sweep)}); add smaller Cs"
        )
    top = max(r["dev_accuracy"] for r in candidates)
    best = min((r for r in candidates if r["dev_accuracy"] >= top - tolerance), key=lambda r: r["C"])
    selected = best["selected"]
    if refit:
        scaler = StandardScaler(with_mean=True, with_std=standardize).fit(X)
        selected = _used_features(_l1_logistic(best["C"], max_iter).fit(scaler.transform(X), y))
    return FeatureSelection(selected=np.sort(selected), C=best["C"], dev_accuracy=best["dev_accuracy"], sweep=sweep)


def fit_feature_interchange(
    representations,
    labels,
    featurizer: str | nn.Module = "pca",
    C=DEFAULT_C_GRID,
    other_labels: dict | None = None,
    n_components: int | None = None,
    standardize_pca: bool = True,
    **selection_kwargs,
) -> FeatureInterchange:
    """Fit a featurizer (or take a given one) and select the target attribute's features.

    representations: (N, d) site representations; labels: (N,) values of the target attribute.
    featurizer: "pca" (fitted here on `representations`, `n_components` axes, each dimension
        standardised first unless standardize_pca=False) or a fitted featurizer module with
        encode / decode / n_features (e.g. `SAEFeaturizer`).
    other_labels: optional {attribute: (N,) values}. As in the paper, selection is for the target
        only by default (None). When given, the features an L1 classifier uses (at the target's
        chosen C) to predict any other attribute are dropped from the target's selection, a
        stricter variant that trades Cause for Iso.
    Other keyword arguments go to `select_features` (dev_features, dev_labels, max_features, ...);
    dev_features are representations (N_dev, d): they are featurized here.
    Returns the FeatureInterchange; its `selection` attribute is the `FeatureSelection`.
    """
    X = _check_representations(representations)
    if isinstance(featurizer, str):
        if featurizer != "pca":
            raise ValueError(
                f"featurizer={featurizer!r}: give 'pca' or a fitted featurizer module (e.g. SAEFeaturizer)"
            )
        featurizer = PCAFeaturizer.fit(X, n_components, standardize=standardize_pca)
    Z = featurize(featurizer, X).double().numpy()
    if selection_kwargs.get("dev_features") is not None:
        selection_kwargs["dev_features"] = featurize(featurizer, selection_kwargs["dev_features"]).double().numpy()
    selection = select_features(Z, labels, C=C, **selection_kwargs)
    selected = selection.selected
    if other_labels:
        scaler = StandardScaler(with_std=selection_kwargs.get("standardize", True)).fit(Z)
        for attribute, values in other_labels.items():
            values = _check_labels(values, Z.shape[0], f"other_labels[{attribute!r}]")
            used = _used_features(
                _l1_logistic(selection.C, selection_kwargs.get("max_iter", 1000)).fit(scaler.transform(Z), values)
            )
            selected = np.setdiff1d(selected, used)
    intervention = FeatureInterchange(featurizer, selected.tolist())
    intervention.selection = selection
    return intervention
