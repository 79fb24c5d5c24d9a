"""PCA and SAE featurizers with L1 feature selection: RAVEL's baselines (Huang et al. 2024, §3.1-3.2, App. B.1).

A featurizer maps a site representation x (d,) to features z (m,) and back. An interchange on a
set S of selected features swaps those features of the source into the base:

    z_mix = z(b) with z_S replaced by z(s)_S
    f*    = dec(z_mix)                           reconstruction_error="drop"
    f*    = f(b) + dec(z_mix) − dec(z(b))        reconstruction_error="keep"

"drop" is the official SAE interchange (`AutoencoderIntervention` returns the decoded mix), the
SAE's default. With "keep" the base keeps its own reconstruction error (what the featurizer
cannot express is never lost), the PCA's default: an empty S is exactly the identity, and with a
full-rank PCA (m = d) and S = all features f* = f(s), the full-vector swap.

Featurizers:
- `PCAFeaturizer`: z = V ((x − μ) / σ), x = σ ⊙ (Vᵀ z) + μ, V the principal axes (m × d,
  orthonormal rows) of the train states standardised per dimension (RAVEL App. B.1: "normalized to
  zero-mean and unit-variance ... We undo the normalization after projecting back"); σ = 1 when
  fitted with standardize=False (PCA of the raw centred states).
- `SAEFeaturizer`: f = ReLU(W1 (x − b2) + b1), decoder W2 f + b2 (a trained
  `lit_interventions.modules.sae.SparseAutoencoder`, latent size 4d).

Feature selection (L1 classifiers on the features, RAVEL's choice of C) is `feature_selection.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler
from torch import nn

from lit_interventions.core.files import read_weights
from lit_interventions.interventions.base import Intervention, class_path, loadable_class, register_intervention
from lit_interventions.interventions.feature_selection import (
    DEFAULT_C_GRID,
    _check_labels,
    _check_representations,
    _l1_logistic,
    _used_features,
    select_features,
)

# --------------------------------------------------------------------------------------------
# Featurizers


@register_intervention
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


@register_intervention
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
        """From a safetensors file holding W1, b1, W2, b2 (as `modules/sae.py` writes it); a
        missing, damaged or foreign file is one error naming it (`read_weights`)."""
        tensors = read_weights(Path(path))
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


RECONSTRUCTION_ERRORS = {"drop": False, "keep": True}  # option -> keep_error


def keep_error_of(reconstruction_error: str | None) -> bool | None:
    """`reconstruction_error` ("drop", "keep" or None: the featurizer's default) as `keep_error`."""
    if reconstruction_error is not None and reconstruction_error not in RECONSTRUCTION_ERRORS:
        raise ValueError(
            f"reconstruction_error={reconstruction_error!r}; choose one of {', '.join(RECONSTRUCTION_ERRORS)} or null"
        )
    return None if reconstruction_error is None else RECONSTRUCTION_ERRORS[reconstruction_error]


@register_intervention
class FeatureInterchange(Intervention):
    """z_mix = z(b) with the selected features taken from z(s); f* = dec(z_mix) (keep_error=False,
    the official SAE interchange) or f* = f(b) + dec(z_mix) − dec(z(b)) (keep_error=True: the base
    keeps its reconstruction error, an empty selection is f(b)).

    `selected`: feature indices (any iterable of ints in 0..m−1, possibly empty).
    keep_error=None: the featurizer's default, False for an `SAEFeaturizer` (the official
    `AutoencoderIntervention`), True otherwise (PCA).
    Exports the featurizer's buffers (as `featurizer.<name>`, its constructor's arguments) and the
    selected indices; `config()` names the featurizer's class.
    """

    def __init__(self, featurizer: nn.Module, selected, keep_error: bool | None = None):
        super().__init__()
        self.keep_error = not isinstance(featurizer, SAEFeaturizer) if keep_error is None else bool(keep_error)
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
        cls,
        tensors: dict[str, torch.Tensor],
        featurizer: str = class_path(PCAFeaturizer),
        keep_error: bool | None = None,
    ) -> FeatureInterchange:
        """`featurizer`: the class path of a featurizer built from its buffers (PCA or SAE; a
        registered class, `loadable_class`)."""
        buffers = {k.removeprefix("featurizer."): v for k, v in tensors.items() if k.startswith("featurizer.")}
        selected = tensors["selected"].round().long().tolist()
        return cls(loadable_class(featurizer, f"{cls.__name__} featurizer")(**buffers), selected, keep_error)


@register_intervention
class FullVectorSwap(Intervention):
    """The full-vector swap baseline: f* = f(s). `hidden_size` is accepted, as every intervention
    is built with it, and unused."""

    def __init__(self, hidden_size: int | None = None):
        super().__init__()

    def forward(self, base: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        return self._require_source(source).to(base.dtype)


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
