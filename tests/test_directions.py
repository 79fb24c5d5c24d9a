"""Closed-form directions (probe, diff-in-means, LDA, PCA, k-means, random) on synthetic data."""

import numpy as np
import pytest
import torch
from sklearn.base import clone

from lit_interventions.interventions.directions import (
    METHODS,
    DiffMeanDirection,
    LDADirection,
    ProbeDirection,
    RandomDirection,
    default_probe_strength,
    fit_direction,
)
from lit_interventions.interventions.fitted import DirectionInterchange
from lit_interventions.interventions.registry import method_spec
from lit_interventions.interventions.rotation import FixedSubspaceIntervention


def two_classes(n=400, d=16, sep=4.0, seed=0, mix=None, offset=3.0):
    """Class 1 sits sep/2 along a known unit axis, class 0 at −sep/2; noise N(0, I) or z @ mix."""
    rng = np.random.default_rng(seed)
    axis = rng.standard_normal(d)
    axis /= np.linalg.norm(axis)
    y = np.repeat([0, 1], n // 2)
    noise = rng.standard_normal((n, d))
    if mix is not None:
        noise = noise @ mix
    X = noise + np.outer(np.where(y == 1, sep / 2, -sep / 2), axis) + offset
    return X, y, axis


def cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def unit(v):
    return v / np.linalg.norm(v)


def correlated_mix(d=6, seed=3):
    """A fixed, well-conditioned mixing matrix whose noise is anisotropic and correlated."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q @ np.diag(np.linspace(0.3, 3.0, d)) @ q.T


@pytest.mark.parametrize("method", ["probe", "diffmean", "lda", "pca", "kmeans"])
def test_recovers_the_class_axis(method):
    # Isotropic noise and separated means: the class axis is also the top-variance axis and the
    # 2-means split, so every non-random method must find it, oriented from class 0 to class 1.
    X, y, axis = two_classes()
    a = fit_direction(method, X, y)
    assert cos(a, axis) > 0.95


@pytest.mark.parametrize("method", ["pca", "kmeans"])
def test_unsupervised_methods_ignore_labels_except_for_the_sign(method):
    X, y, axis = two_classes()
    unlabelled = fit_direction(method, X)
    assert abs(cos(unlabelled, axis)) > 0.95
    assert torch.allclose(fit_direction(method, X, y).abs(), unlabelled.abs())


@pytest.mark.parametrize("method", list(METHODS))
def test_unit_norm_dtype_and_orientation(method):
    X, y, _ = two_classes(n=60, d=5, sep=1.0, seed=1)
    a = fit_direction(method, X, y)
    assert a.dtype == torch.float32 and a.shape == (5,)
    assert a.norm().item() == pytest.approx(1.0, abs=1e-6)
    proj = X @ a.double().numpy()
    assert proj[y == 1].mean() >= proj[y == 0].mean()
    # Swapping which class is "1" (the larger label) flips the direction and nothing else.
    flipped = fit_direction(method, X, np.where(y == 1, "a", "b"))
    assert torch.allclose(flipped, -a, atol=1e-4)


def test_accepts_torch_inputs_and_any_two_labels():
    X, y, _ = two_classes(n=40, d=4)
    from_numpy = fit_direction("diffmean", X, y)
    from_torch = fit_direction("diffmean", torch.tensor(X, dtype=torch.float32), torch.tensor(y))
    assert torch.allclose(from_numpy, from_torch, atol=1e-5)
    assert torch.allclose(fit_direction("diffmean", X, np.where(y == 1, 7.5, -2.0)), from_numpy)


def test_diffmean_by_hand():
    X = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0], [2.0, 2.0, 2.0], [0.0, 1.0, 1.0]])
    y = ["b", "a", "b", "a"]  # class 1 is "b" (the larger label): rows 0 and 2
    mu_b, mu_a = np.array([1.5, 2.0, 1.0]), np.array([1.5, 0.5, 1.0])
    expected = unit(mu_b - mu_a)  # (0, 1, 0)
    a = DiffMeanDirection().fit(X, y).direction_
    np.testing.assert_allclose(a.numpy(), expected, atol=1e-7)
    assert list(DiffMeanDirection().fit(X, y).classes_) == ["a", "b"]


def test_lda_matches_pooled_covariance_solve_by_hand():
    # Unequal class sizes, correlated noise; plain (unshrunk) LDA must equal Σ⁻¹(μ1 − μ0) with Σ the
    # pooled within-class covariance.
    rng = np.random.default_rng(5)
    mix = correlated_mix(d=4)
    X = np.vstack([rng.standard_normal((30, 4)) @ mix, rng.standard_normal((50, 4)) @ mix + [1.0, -0.5, 0.3, 2.0]])
    y = np.array([0] * 30 + [1] * 50)
    X0, X1 = X[y == 0], X[y == 1]
    mu0, mu1 = X0.mean(0), X1.mean(0)
    pooled = ((X0 - mu0).T @ (X0 - mu0) + (X1 - mu1).T @ (X1 - mu1)) / (len(X) - 2)
    expected = unit(np.linalg.solve(pooled, mu1 - mu0))
    np.testing.assert_allclose(LDADirection(shrinkage=None).fit(X, y).direction_.numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(LDADirection(shrinkage=0.0).fit(X, y).direction_.numpy(), expected, atol=1e-5)
    # Full shrinkage replaces Σ by a scaled identity: LDA becomes diff-in-means.
    np.testing.assert_allclose(LDADirection(shrinkage=1.0).fit(X, y).direction_.numpy(), unit(mu1 - mu0), atol=1e-6)


def test_lda_differs_from_diffmean_under_correlated_noise():
    X, y, _ = two_classes(n=400, d=6, sep=2.0, mix=correlated_mix())
    lda, diffmean = fit_direction("lda", X, y, shrinkage=None), fit_direction("diffmean", X, y)
    assert cos(lda, diffmean) < 0.9

    # LDA whitens the noise: the projection separates the classes better (Fisher criterion).
    def fisher(a):
        p = X @ a.double().numpy()
        return (p[y == 1].mean() - p[y == 0].mean()) ** 2 / (p[y == 1].var() + p[y == 0].var())

    assert fisher(lda) > 1.5 * fisher(diffmean)


def test_lda_stays_finite_when_hidden_size_exceeds_samples():
    X, y, axis = two_classes(n=40, d=100, sep=6.0)
    a = fit_direction("lda", X, y)
    assert torch.isfinite(a).all() and a.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert cos(a, axis) > 0.5


def test_probe_strength_default_table():
    # the official code's first probe per pythia size: d 128, 256, 512, 768, 1024, 2048, 2560, 4096, 5120
    official = {128: 1e1, 256: 1e2, 512: 1e3, 768: 1e4, 1024: 1e4, 2048: 1e5, 2560: 1e5, 4096: 1e6, 5120: 1e6}
    assert {d: default_probe_strength(d) for d in official} == official
    table = {1: 1e1, 129: 1e2, 257: 1e3, 513: 1e4, 640: 1e4, 1025: 1e5, 2561: 1e6}
    assert {d: default_probe_strength(d) for d in table} == table
    X, y, _ = two_classes(n=40, d=200)
    probe = ProbeDirection().fit(X, y)
    assert probe.strength_ == 1e2 and probe.estimator_.C == pytest.approx(1e-2)


def test_probe_strength_override_moves_between_lda_and_diffmean():
    X, y, _ = two_classes(n=400, d=6, sep=2.0, mix=correlated_mix())
    strong = ProbeDirection(strength=1e6).fit(X, y)
    weak = ProbeDirection(strength=0.1).fit(X, y)
    assert strong.strength_ == 1e6 and weak.estimator_.C == pytest.approx(10.0)
    # As λ → ∞, w ∝ the loss gradient at w = 0, i.e. μ1 − μ0; as λ → 0 it approaches LDA.
    assert cos(strong.direction_, fit_direction("diffmean", X, y)) > 0.999
    assert cos(weak.direction_, fit_direction("lda", X, y, shrinkage=None)) > 0.99


def test_probe_is_offset_invariant_and_classifies_raw_inputs():
    X, y, _ = two_classes(n=200, d=16, sep=3.0)
    probe = ProbeDirection().fit(X, y)
    shifted = ProbeDirection().fit(X + 100.0, y)
    assert cos(probe.direction_, shifted.direction_) > 0.9999
    assert shifted.estimator_.score(X + 100.0, y) > 0.9


def test_probe_reaches_the_optimum_of_the_penalised_log_loss():
    # Hidden-state-like inputs: a few dimensions with a large scale, on which SAGA's 1000
    # iterations stop short of the optimum. At the optimum of Σ log-loss + (λ/2)‖w‖² the gradient
    # is 0: X'(σ(Xw + b) − y) + λw = 0 and Σ(σ(Xw + b) − y) = 0.
    rng = np.random.default_rng(1)
    X, y, _ = two_classes(n=400, d=64, sep=1.0)
    X = X * np.where(rng.random(64) < 0.1, 30.0, 1.0)
    probe = ProbeDirection(strength=10.0).fit(X, y)
    w, b = probe.estimator_.coef_[0], probe.estimator_.intercept_[0]
    residual = 1 / (1 + np.exp(-(X @ w + b))) - y
    grad_w, grad_b = X.T @ residual + 10.0 * w, residual.sum()
    assert np.linalg.norm(grad_w) < 1e-3 * np.linalg.norm(10.0 * w) and abs(grad_b) < 1e-3
    assert cos(probe.direction_, w) == pytest.approx(1.0, abs=1e-12)


def test_random_is_seeded():
    X = np.zeros((3, 32))
    a = RandomDirection(random_state=1).fit(X).direction_
    assert torch.equal(a, RandomDirection(random_state=1).fit(np.ones((5, 32))).direction_)
    assert abs(cos(a, RandomDirection(random_state=2).fit(X).direction_)) < 0.9
    assert a.shape == (32,) and a.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(fit_direction("random", X, random_state=1), a)


def test_direction_drives_the_fixed_subspace_intervention():
    X, y, _ = two_classes(n=100, d=8)
    a = fit_direction("probe", X, y)
    base, source = torch.randn(5, 8), torch.randn(5, 8)
    out = FixedSubspaceIntervention(a)(base, source)
    torch.testing.assert_close(out @ a, source @ a, atol=1e-5, rtol=0)  # a-coordinate from the source
    rest = torch.eye(8) - torch.outer(a, a)
    torch.testing.assert_close(out @ rest, base @ rest, atol=1e-5, rtol=0)  # the rest from the base


def test_methods_registry_and_sklearn_params():
    assert set(METHODS) == {"probe", "diffmean", "lda", "pca", "kmeans", "random", "lat"}
    assert clone(ProbeDirection(strength=3.0)).get_params()["strength"] == 3.0


def test_bad_inputs():
    X, y, _ = two_classes(n=20, d=4)
    with pytest.raises(ValueError, match="unknown direction method 'svm'.*probe, diffmean, lda, pca, kmeans, random"):
        fit_direction("svm", X, y)
    with pytest.raises(ValueError, match="exactly two distinct labels; got 1"):
        fit_direction("probe", X, np.zeros(20))
    with pytest.raises(ValueError, match="exactly two distinct labels; got 3"):
        fit_direction("lda", X, np.arange(20) % 3)
    with pytest.raises(ValueError, match=r"one label per row of X \(20 rows\); got shape \(19,\)"):
        fit_direction("diffmean", X, y[:19])
    with pytest.raises(ValueError, match=r"X must be 2-D.*got shape \(4,\)"):
        fit_direction("pca", X[0])
    bad = X.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="1 NaN or infinite"):
        fit_direction("kmeans", bad)
    with pytest.raises(ValueError, match="supervised: y"):
        fit_direction("diffmean", X)
    with pytest.raises(ValueError, match="strength"):
        fit_direction("probe", X, y, strength=0.0)
    with pytest.raises(ValueError, match="zero direction"):
        fit_direction("diffmean", np.ones((4, 3)), [0, 1, 0, 1])


def test_lat_is_the_top_pc_of_normalised_pair_differences():
    # By hand: the same shuffle and pairing, unit-normalised differences, top PC by SVD.
    from lit_interventions.interventions.directions import LATDirection

    X, y, axis = two_classes(n=400, d=8, sep=8.0, seed=2)
    a = LATDirection(random_state=5).fit(X, y).direction_.double().numpy()
    order = np.random.RandomState(5).permutation(len(X))
    diffs = X[order[:200]] - X[order[200:]]
    diffs /= np.linalg.norm(diffs, axis=1, keepdims=True)
    _, _, vt = np.linalg.svd(diffs - diffs.mean(0), full_matrices=False)
    assert abs(cos(a, vt[0])) == pytest.approx(1.0, abs=1e-6)
    # Pairs across the classes differ along the class axis, so LAT finds it (oriented 0 -> 1).
    assert cos(a, axis) > 0.95


def test_lat_needs_two_pairs_of_distinct_rows():
    from lit_interventions.interventions.directions import LATDirection

    X = np.ones((6, 3))
    X[0] = 2.0
    with pytest.raises(ValueError, match="at least 2 pairs of distinct rows"):
        LATDirection().fit(X)


def test_the_names_are_the_registrys_direction_estimators():
    assert METHODS == ("probe", "diffmean", "lda", "pca", "kmeans", "random", "lat")  # in registration order
    assert all(
        method_spec(name).class_path == f"{ProbeDirection.__module__}.{type(method_spec(name).build(4)).__name__}"
        for name in METHODS
    )
    X, y, axis = two_classes(d=8, seed=2)
    assert cos(fit_direction("diffmean", X, y), axis) > 0.95  # the registered spec, fitted
    for name in ("das", "dbm"):  # registered, but not a direction: refused with the directions' names
        with pytest.raises(ValueError, match=f"unknown direction method '{name}'; valid methods: probe, diffmean, lda"):
            fit_direction(name, X, y)
        with pytest.raises(ValueError, match=f"method={name!r} is not one of probe, diffmean, lda"):
            DirectionInterchange(8, method=name)
