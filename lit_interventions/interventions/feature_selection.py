"""L1 feature selection on featurized site representations: RAVEL's choice of the features that
encode an attribute (Huang et al. 2024, §3.2, App. B.1).

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

Also the checks of the arrays every featurizer and selection takes (`_check_representations`,
`_check_labels`, `_check_C`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sklearn
import torch
from sklearn.feature_selection import SelectFromModel
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC

from lit_interventions.core.progress import stage

DEFAULT_C_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # the L1 logistic regression's (scaled features)
RAVEL_C_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0)  # the paper's {0.1, 1, 10, 1000} and the code's {0.1, 10, 100, 1000}
CLASSIFIERS = ("svc", "logistic")


def _to_numpy(value) -> np.ndarray:
    """A numpy array of `value`; a floating tensor becomes float64."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.double() if value.is_floating_point() else value).numpy()
    return np.asarray(value)


def _check_representations(X, name: str = "representations") -> np.ndarray:
    """`X` as a non-empty, finite, real (n_examples, size) float64 array; else a ValueError naming `name`."""
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
    """`y` as a 1-D array of `n` labels with at least 2 classes; else a ValueError naming `name`."""
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
    """`C` (one value or a grid) as a tuple of finite positive floats."""
    grid = tuple(np.atleast_1d(np.asarray(C, dtype=np.float64)).tolist())
    if not grid:
        raise ValueError("C is an empty grid; give a positive number or a non-empty list of them")
    bad = [c for c in grid if not np.isfinite(c) or c <= 0]
    if bad:
        raise ValueError(f"C must be finite and > 0 (inverse L1 strength); got {bad}")
    return grid


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
    sweep, grid = [], sorted(_check_C(C))
    with stage(len(grid), "feature selection", "C") as shown:  # seconds per C for RAVEL's states
        for c in grid:
            shown.note(f"C={c:g}")
            used = _used_features(_fit_classifier(classifier, c, X, y, max_iter))
            sweep.append({"C": c, "n_features": len(used), "selected": used})
            shown.update()
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


def _fit_and_dev_rows(X, y, dev_features, dev_labels, dev_fraction: float, groups, seed: int) -> tuple:
    """(X_fit, y_fit, X_dev, y_dev, refit) for `select_features`: the given dev rows (refit=False),
    or a random `dev_fraction` of the rows (of the `groups` when given) held out (refit=True)."""
    if dev_features is not None or dev_labels is not None:
        if dev_features is None or dev_labels is None:
            raise ValueError("give both dev_features and dev_labels, or neither")
        X_dev = _check_representations(dev_features, "dev_features")
        if X_dev.shape[1] != X.shape[1]:
            raise ValueError(f"dev_features has {X_dev.shape[1]} columns; features has {X.shape[1]}")
        y_dev = _to_numpy(dev_labels)
        if y_dev.shape != (X_dev.shape[0],):
            raise ValueError(f"dev_labels must have shape ({X_dev.shape[0]},); got {y_dev.shape}")
        return X, y, X_dev, y_dev, False
    if not 0 < dev_fraction < 1:
        raise ValueError(f"dev_fraction={dev_fraction!r} must be in (0, 1)")
    if X.shape[0] < 3:
        raise ValueError(f"need at least 3 examples to hold out a dev part; got {X.shape[0]}")
    if groups is not None:
        groups = _to_numpy(groups)
        if groups.shape != (X.shape[0],):
            raise ValueError(f"groups must have shape ({X.shape[0]},), one id per example; got {groups.shape}")
    fit_rows, dev_rows = _holdout(X.shape[0], dev_fraction, seed, groups)
    X_fit, y_fit, X_dev, y_dev = X[fit_rows], y[fit_rows], X[dev_rows], y[dev_rows]
    if len(np.unique(y_fit)) < 2:
        raise ValueError("the train part of the holdout has one class only; give dev_features/dev_labels")
    return X_fit, y_fit, X_dev, y_dev, True


def _dev_sweep(X_fit, y_fit, X_dev, y_dev, grid: list[float], standardize: bool, max_iter: int) -> list[dict]:
    """For each C of `grid`, the L1 logistic regression fitted on the fit rows: its features and
    its accuracy on the dev rows, [{"C", "n_features", "dev_accuracy", "selected"}]."""
    scaler = StandardScaler(with_mean=True, with_std=standardize).fit(X_fit)
    sweep = []
    for c in grid:
        classifier = _l1_logistic(c, max_iter).fit(scaler.transform(X_fit), y_fit)
        used = _used_features(classifier)
        accuracy = float(classifier.score(scaler.transform(X_dev), y_dev))
        sweep.append({"C": c, "n_features": len(used), "dev_accuracy": accuracy, "selected": used})
    return sweep


def _best_C(sweep: list[dict], grid: list[float], max_features: int | None, tolerance: float) -> dict:
    """The sweep's entry of the smallest C whose dev accuracy is within `tolerance` of the best,
    among the Cs selecting at most `max_features` features."""
    candidates = [r for r in sweep if max_features is None or r["n_features"] <= max_features]
    if not candidates:
        raise ValueError(
            f"no C in {grid} selects at most max_features={max_features} features (fewest: "
            f"{min(r['n_features'] for r in sweep)}); add smaller Cs"
        )
    top = max(r["dev_accuracy"] for r in candidates)
    return min((r for r in candidates if r["dev_accuracy"] >= top - tolerance), key=lambda r: r["C"])


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
    X_fit, y_fit, X_dev, y_dev, refit = _fit_and_dev_rows(X, y, dev_features, dev_labels, dev_fraction, groups, seed)
    sweep = _dev_sweep(X_fit, y_fit, X_dev, y_dev, grid, standardize, max_iter)
    best = _best_C(sweep, grid, max_features, tolerance)
    selected = best["selected"]
    if refit:
        scaler = StandardScaler(with_mean=True, with_std=standardize).fit(X)
        selected = _used_features(_l1_logistic(best["C"], max_iter).fit(scaler.transform(X), y))
    return FeatureSelection(selected=np.sort(selected), C=best["C"], dev_accuracy=best["dev_accuracy"], sweep=sweep)
