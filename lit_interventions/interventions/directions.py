"""Closed-form feature directions, one unit vector a per site (CausalGym §4.2; Arora et al. 2024).

Each estimator is scikit-learn style: `fit(X, y)` with X (n, d) representations (numpy or torch)
and y (n,) labels with exactly two distinct values returns self and sets `direction_`, a float32
torch tensor of shape (d,) with unit L2 norm, to use as
`FixedSubspaceIntervention(direction_)`: f* = f(b) + (a·f(s) − a·f(b)) a, which
`to_intervention()` returns (so a fitted direction joins the intervention protocol).

Classes are ordered by `np.unique(y)`: class 0 is the smaller label, class 1 the larger. Sign
convention: every direction is flipped if needed so that the mean projection of class 1 is ≥
that of class 0, i.e. a·(μ1 − μ0) ≥ 0. The unsupervised methods (PCA, LAT, k-means, random) ignore y
for the fit and use it only for this orientation when it is given; without y they keep the sign
scikit-learn (or the seed) gives. The interchange itself is sign-invariant.

All fits run in float64 on CPU with scikit-learn. The representations are never rescaled, so
every direction lives in their original coordinates (the probe's centring and LDA's internal
scaling change neither that nor the optimum).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import LogisticRegression
from sklearn.utils import check_random_state
from threadpoolctl import threadpool_limits

from lit_interventions.interventions.registry import method_spec, registered_methods
from lit_interventions.interventions.rotation import FixedSubspaceIntervention

# (largest hidden size, λ): the paper's best L2 strengths at d = 128, 256, 512 (App. C, Table 2a),
# then the first probe the official code runs for each larger pythia (d = 768 and 1024: 1e4;
# 2048 and 2560: 1e5; 4096 and 5120: 1e6).
PROBE_STRENGTHS = ((128, 1e1), (256, 1e2), (512, 1e3), (1024, 1e4), (2560, 1e5))
PROBE_STRENGTH_LARGE = 1e6


def default_probe_strength(hidden_size: int) -> float:
    """λ = 1e1 at d ≤ 128, 1e2 at d ≤ 256, 1e3 at d ≤ 512, 1e4 at d ≤ 1024, 1e5 at d ≤ 2560, 1e6 above."""
    for bound, strength in PROBE_STRENGTHS:
        if hidden_size <= bound:
            return strength
    return PROBE_STRENGTH_LARGE


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.double() if value.is_floating_point() else value).numpy()
    return np.asarray(value)


def _check_X(X) -> np.ndarray:
    X = _to_numpy(X)
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, hidden_size); got shape {X.shape}")
    if X.shape[0] < 2 or X.shape[1] < 1:
        raise ValueError(f"X must have at least 2 rows and 1 column; got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.number) or np.iscomplexobj(X):
        raise ValueError(f"X must be a real numeric array; got dtype {X.dtype}")
    X = X.astype(np.float64)
    bad = ~np.isfinite(X)
    if bad.any():
        raise ValueError(f"X contains {int(bad.sum())} NaN or infinite value(s); only finite values are allowed")
    return X


def _check_y(y, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (y as 0/1 ints, the two sorted original labels)."""
    y = _to_numpy(y)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"y must be 1-D with one label per row of X ({n} rows); got shape {y.shape}")
    if np.issubdtype(y.dtype, np.floating) and np.isnan(y).any():
        raise ValueError("y contains NaN; labels must be two distinct non-NaN values")
    classes, codes = np.unique(y, return_inverse=True)
    if len(classes) != 2:
        shown = classes[:10].tolist()
        raise ValueError(f"y must contain exactly two distinct labels; got {len(classes)}: {shown}")
    return codes.astype(np.int64), classes


class _Direction(BaseEstimator):
    """Shared fit: validate, compute a raw direction, orient by y, normalise."""

    _supervised = True

    def fit(self, X, y=None):
        X = _check_X(X)
        if y is None and self._supervised:
            raise ValueError(f"{type(self).__name__} is supervised: y (two distinct labels) is required")
        codes, self.classes_ = _check_y(y, X.shape[0]) if y is not None else (None, None)
        self.n_features_in_ = X.shape[1]
        a = np.asarray(self._raw_direction(X, codes), dtype=np.float64)
        norm = np.linalg.norm(a)
        if not np.isfinite(norm) or norm == 0:
            raise ValueError(
                f"{type(self).__name__} found a zero direction (e.g. identical class means); cannot normalise"
            )
        a = a / norm
        if codes is not None and a @ (X[codes == 1].mean(0) - X[codes == 0].mean(0)) < 0:
            a = -a
        self.direction_ = torch.as_tensor(a, dtype=torch.float32)
        return self

    def _raw_direction(self, X: np.ndarray, codes: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def to_intervention(self) -> FixedSubspaceIntervention:
        """The interchange on the fitted direction: f* = f(b) + (a·f(s) − a·f(b)) a."""
        if not hasattr(self, "direction_"):
            raise ValueError(f"{type(self).__name__} is not fitted: call fit(X, y) before to_intervention()")
        return FixedSubspaceIntervention(self.direction_)


class ProbeDirection(_Direction):
    """a = w of a logistic regression of y on X (with bias): min_w,b Σ log-loss + (λ/2)‖w‖².

    λ (`strength`) defaults from the hidden size d, as the paper found best (App. C):

    =========  =====
    d          λ
    =========  =====
    ≤ 128      1e1
    ≤ 256      1e2
    ≤ 512      1e3
    ≤ 1024     1e4   (from d = 768 the official code also runs a second probe at 10 × λ)
    ≤ 2560     1e5
    > 2560     1e6
    =========  =====

    scikit-learn's C is 1/λ, as in the reference code (the penalty does not scale with n).
    The objective is the paper's; the solver is L-BFGS, not the reference code's SAGA: the
    objective is strictly convex, so both aim at the same w, and L-BFGS reaches it (cosine
    ≥ 0.99996 with SAGA run to 1e-8 on gemma-3-270m's states) in ~0.04 s where SAGA stops at
    `max_iter` 1000 after ~1.5 s still off it (cosine 0.983–0.998), docs/differences.md.
    X is centred for the fit, which leaves the optimal w unchanged and conditions the problem;
    `estimator_` (the fitted LogisticRegression, intercept mapped back) classifies raw X.
    After fit, `strength_` is the λ used.

    Args:
        strength: λ on the summed log-loss; None: the table above (or `l2`).
        l2: λ on the *mean* log-loss over the n rows, min_w mean log-loss + (l2/2)‖w‖², i.e.
            strength = l2·n (AxBench's probe: AdamW weight decay 1e-3 on its mean token loss).
            Give `strength` or `l2`, not both.
        bias: False fits σ(X·w) with no intercept, min_w Σ log-loss(σ(X·w)) + (λ/2)‖w‖² (AxBench
            eq. 5, its `LinearProbe`), on X as it is (no centring: its mean is part of the model).
    """

    def __init__(
        self,
        strength: float | None = None,
        max_iter: int = 1000,
        tol: float = 1e-6,
        random_state=0,
        l2: float | None = None,
        bias: bool = True,
    ):
        if l2 is not None and (isinstance(l2, bool) or not isinstance(l2, (int, float)) or not 0 < l2 < float("inf")):
            raise ValueError(f"l2={l2!r} must be a finite number > 0 or None")
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} must be true or false")
        if l2 is not None and strength is not None:
            raise ValueError(
                f"strength={strength!r} and l2={l2!r}: give one λ (strength on the summed loss, l2 on the mean)"
            )
        self.strength, self.max_iter, self.tol, self.random_state = strength, max_iter, tol, random_state
        self.l2, self.bias = l2, bias

    def _strength(self, X: np.ndarray) -> float:
        if self.l2 is not None:
            return self.l2 * X.shape[0]  # λ of the summed loss
        strength = default_probe_strength(X.shape[1]) if self.strength is None else float(self.strength)
        if not np.isfinite(strength) or strength <= 0:
            raise ValueError(f"strength (λ) must be a finite number > 0; got {self.strength!r}")
        return strength

    def _raw_direction(self, X, codes):
        self.strength_ = strength = self._strength(X)
        if not self.bias:  # scikit-learn's default solver, L-BFGS
            probe = LogisticRegression(fit_intercept=False, C=1.0 / strength, max_iter=self.max_iter, tol=self.tol)
            self.estimator_ = probe.fit(X, codes)
            return self.estimator_.coef_[0]
        # Pure L2 is the default penalty in every supported scikit-learn; `penalty="l2"` is
        # deprecated since 1.8 (in favour of l1_ratio=0, which older versions warn about).
        # Fit on centred X: the optimal w is the same (the unpenalised intercept absorbs the
        # shift), and the solver no longer has to move a large intercept.
        mean = X.mean(0)
        self.estimator_ = LogisticRegression(
            solver="lbfgs",
            fit_intercept=True,
            C=1.0 / strength,
            max_iter=self.max_iter,
            tol=self.tol,
            random_state=self.random_state,
        ).fit(X - mean, codes)
        self.estimator_.intercept_ -= self.estimator_.coef_ @ mean  # a classifier of the raw X again
        return self.estimator_.coef_[0]


class DiffMeanDirection(_Direction):
    """a = μ1 − μ0."""

    def _raw_direction(self, X, codes):
        return X[codes == 1].mean(0) - X[codes == 0].mean(0)


class LDADirection(_Direction):
    """a = Σ⁻¹(μ1 − μ0), Σ the pooled within-class covariance (sklearn LDA, lsqr solver).

    `shrinkage` is passed to `LinearDiscriminantAnalysis(solver="lsqr", shrinkage=...)`. The
    default "auto" is Ledoit–Wolf shrinkage of the per-feature-standardised covariance towards
    the identity (so Σ shrinks towards its diagonal), which keeps Σ invertible when d ≥ n
    (hidden sizes often exceed the 400 training examples). A float s in [0, 1] uses
    (1 − s)Σ + s·(tr Σ/d)·I, so 1.0 gives diff-in-means; None uses the plain Σ (solved by least
    squares: the minimum-norm solution if Σ is singular). The paper used sklearn's default SVD
    solver without shrinkage, which None reproduces on well-conditioned data.
    """

    def __init__(self, shrinkage: float | str | None = "auto"):
        self.shrinkage = shrinkage

    def _raw_direction(self, X, codes):
        self.estimator_ = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=self.shrinkage).fit(X, codes)
        return self.estimator_.coef_[0]


class PCADirection(_Direction):
    """a = the first principal component of X (y, if given, only orients it)."""

    _supervised = False

    def __init__(self, random_state=0):
        self.random_state = random_state

    def _raw_direction(self, X, codes):
        self.estimator_ = PCA(n_components=1, random_state=self.random_state).fit(X)
        return self.estimator_.components_[0]


class KMeansDirection(_Direction):
    """a = c1 − c0, the centroids of 2-means on X (y, if given, only orients it)."""

    _supervised = False

    def __init__(self, n_init: int = 10, random_state=0):
        self.n_init, self.random_state = n_init, random_state

    def _raw_direction(self, X, codes):
        # One OpenMP thread: k-means' threads otherwise contend with torch's OpenMP runtime (a
        # second libgomp) on few cores and a 10 ms fit can take a second; the data here are small.
        with threadpool_limits(1, user_api="openmp"):
            self.estimator_ = KMeans(n_clusters=2, n_init=self.n_init, random_state=self.random_state).fit(X)
        centers = self.estimator_.cluster_centers_
        return centers[1] - centers[0]


class RandomDirection(_Direction):
    """a ~ N(0, I_d) from `random_state`, normalised; X gives only d (y, if given, orients it)."""

    _supervised = False

    def __init__(self, random_state=0):
        self.random_state = random_state

    def _raw_direction(self, X, codes):
        return check_random_state(self.random_state).standard_normal(X.shape[1])


class LATDirection(_Direction):
    """a = the first principal component of Δ, the unit-normalised differences
    δ = (h_i − h_j)/‖h_i − h_j‖ of a random pairing of the rows of X (LAT: Zou et al. 2023; as
    AxBench §4 uses it). The rows are shuffled with `random_state` and split into ⌊n/2⌋ disjoint
    pairs (an odd last row is left out); pairs of identical rows carry no direction and are
    dropped. PCA (sklearn, which centres Δ) then gives the top component; y, if given, only
    orients it.
    """

    _supervised = False

    def __init__(self, random_state=0):
        self.random_state = random_state

    def _raw_direction(self, X, codes):
        order = check_random_state(self.random_state).permutation(X.shape[0])
        half = X.shape[0] // 2
        diffs = X[order[:half]] - X[order[half : 2 * half]]  # (n/2, d)
        norms = np.linalg.norm(diffs, axis=1)
        diffs = diffs[norms > 0] / norms[norms > 0, None]
        if diffs.shape[0] < 2:
            raise ValueError(f"LATDirection needs at least 2 pairs of distinct rows; got {diffs.shape[0]}")
        self.estimator_ = PCA(n_components=1, random_state=self.random_state).fit(diffs)
        return self.estimator_.components_[0]


# the registered names (`registry.method_spec`) of the estimators defined here: probe, diffmean, lda,
# pca, kmeans, random, lat
METHODS: tuple[str, ...] = tuple(
    name for name in registered_methods() if method_spec(name).class_path.rsplit(".", 1)[0] == __name__
)


def direction_estimator(method: str, hidden_size: int, seed: int = 0, **kwargs) -> _Direction:
    """The unfitted estimator the registered name `method` (one of `METHODS`) builds, its init
    args updated by `kwargs`, `random_state=seed` where it has one and `kwargs` leave it unset
    (`MethodSpec.build`)."""
    if method not in METHODS:
        raise ValueError(f"unknown direction method {method!r}; valid methods: {', '.join(METHODS)}")
    spec = method_spec(method)
    return dataclasses.replace(spec, init_args={**spec.init_args, **kwargs}).build(hidden_size, seed)


def fit_direction(method: str, X, y=None, **kwargs) -> torch.Tensor:
    """Fit the registered direction estimator `method` (`direction_estimator`, init args
    `kwargs`) on (X, y) and return its unit direction, float32 (d,)."""
    width = np.shape(X)[-1] if np.ndim(X) else 0  # `fit` refuses an X that is not (n, d)
    return direction_estimator(method, width, **kwargs).fit(X, y).direction_


def fit_intervention(method: str, X, y=None, **kwargs) -> FixedSubspaceIntervention:
    """Fit the registered direction estimator `method` on (X, y); the interchange on its direction."""
    return FixedSubspaceIntervention(fit_direction(method, X, y, **kwargs))
