"""PCA / SAE featurizers, L1 feature selection and the feature interchange (RAVEL baselines)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning import Trainer
from lit_interventions.datamodules.activations import ActivationsDataModule, RavelActivationsDataModule
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.ravel_files import encode_prompt
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression

from lit_interventions.interventions.feature_selection import select_features
from lit_interventions.interventions.featurizers import (
    FeatureInterchange,
    FullVectorSwap,
    PCAFeaturizer,
    SAEFeaturizer,
    featurize,
    fit_feature_interchange,
    keep_error_of,
)
from lit_interventions.interventions.fitted import FeatureInterchangeFit
from lit_interventions.modules.sae import CARD, WEIGHTS, ExportSAE, SAEModule, SparseAutoencoder

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sae.yaml"


def _trainer(epochs: int, **kwargs) -> Trainer:
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _planted(n=600, m=20, seed=0):
    """Features (n, m) and a 3-class label whose class means differ in features 3 and 7 only."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    Z = rng.normal(size=(n, m))
    Z[:, 3] += 2 * np.array([-1, 1, 0])[labels]
    Z[:, 7] += 2 * np.array([0, -1, 1])[labels]
    return Z, labels


def _manual_sae() -> SAEFeaturizer:
    eye = torch.eye(2)
    return SAEFeaturizer(eye, torch.zeros(2), eye, torch.zeros(2))


# ---------------------------------------------------------------------------------- featurizers


def test_pca_round_trip_full_rank_and_truncated():
    X = torch.randn(50, 8) * torch.arange(1, 9) + 3.0
    full = PCAFeaturizer.fit(X)
    assert full.n_features == 8
    torch.testing.assert_close(full.decode(full.encode(X)), X, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full.components @ full.components.T, torch.eye(8), atol=1e-5, rtol=0)
    top2 = PCAFeaturizer.fit(X, n_components=2)
    z = top2.encode(X)
    assert z.shape == (50, 2)
    assert z[:, 0].var() > z[:, 1].var()  # ordered by explained variance
    assert not torch.allclose(top2.decode(z), X, atol=1e-2)  # rank 2 loses the rest


def test_standardised_pca_hand_checked():
    """RAVEL standardises each dimension before PCA and undoes it after. X = [[0, 0], [2, 20]]:
    μ = (1, 10), σ = (1, 10), standardised rows ∓(1, 1), so the axis is (1, 1)/√2 (raw PCA would
    take ≈ (0.1, 0.995), the high-variance coordinate)."""
    X = torch.tensor([[0.0, 0.0], [2.0, 20.0]])
    pca = PCAFeaturizer.fit(X, n_components=1)
    torch.testing.assert_close(pca.mean, torch.tensor([1.0, 10.0]))
    torch.testing.assert_close(pca.scale, torch.tensor([1.0, 10.0]))
    torch.testing.assert_close(pca.components.abs(), torch.full((1, 2), 0.5**0.5))
    torch.testing.assert_close(pca.encode(X).abs(), torch.full((2, 1), 2**0.5))
    torch.testing.assert_close(pca.decode(pca.encode(X)), X)  # the train states round-trip
    torch.testing.assert_close(pca.encode(torch.tensor([2.0, 0.0])), torch.zeros(1))  # standardised (1, −1) ⟂ axis
    # f* = f(b) + σ ⊙ Vᵀ(z(s) − z(b)), in the original space
    swap = FeatureInterchange(pca, [0])
    torch.testing.assert_close(swap(X[:1], X[1:]), X[1:])
    torch.testing.assert_close(swap(torch.tensor([[2.0, 0.0]]), X[:1]), torch.tensor([[1.0, -10.0]]))
    raw = PCAFeaturizer.fit(X, n_components=1, standardize=False)
    torch.testing.assert_close(raw.components.abs(), torch.tensor([[2.0, 20.0]]) / 404**0.5)
    torch.testing.assert_close(raw.scale, torch.ones(2))


def test_standardised_pca_round_trips_the_train_states():
    """Fewer states than dimensions (N = 5 < d = 8): the N components span the centred train
    states, so encode → decode is the identity on them."""
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 9) * 10 + 3.0
    pca = PCAFeaturizer.fit(X)
    assert pca.n_features == 5
    torch.testing.assert_close(pca.decode(pca.encode(X)), X, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(pca.scale.double(), X.double().std(0, unbiased=False), atol=1e-4, rtol=1e-5)
    constant = torch.cat([X, torch.full((5, 1), 7.0)], dim=1)  # a constant dimension keeps σ = 1
    assert PCAFeaturizer.fit(constant).scale[-1] == 1.0
    torch.testing.assert_close(
        PCAFeaturizer.fit(constant).decode(PCAFeaturizer.fit(constant).encode(constant)), constant, atol=1e-4, rtol=1e-5
    )


def test_sae_featurizer_formula():
    W1, b1, W2, b2 = torch.randn(6, 3), torch.randn(6), torch.randn(3, 6), torch.randn(3)
    sae = SAEFeaturizer(W1, b1, W2, b2)
    x = torch.randn(4, 3)
    f = torch.relu((x - b2) @ W1.T + b1)
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae.decode(f), f @ W2.T + b2)


# ---------------------------------------------------------------------------------- interchange


def test_pca_interchange_hand_checked():
    X = torch.tensor([[3.0, 1.0], [-3.0, 1.0], [3.0, -1.0], [-3.0, -1.0]])  # axes e1 (var 12), e2 (var 1.33)
    pca = PCAFeaturizer.fit(X, standardize=False)
    base, source = torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0, -7.0]])
    torch.testing.assert_close(FeatureInterchange(pca, [0])(base, source), torch.tensor([[5.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(pca, [1])(base, source), torch.tensor([[1.0, -7.0]]))


def test_sae_interchange_drops_or_keeps_the_reconstruction_error():
    sae = _manual_sae()  # f = ReLU(x), x̂ = f: negative coordinates are reconstruction error
    base, source = torch.tensor([[-1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    # z(b) = (0, 2), z(s) = (3, 4). Official (the default for an SAE): f* = dec(z_mix); swap 0:
    # z_mix = (3, 2); an empty selection reconstructs the base, (0, 2), not f(b)
    assert FeatureInterchange(sae, [0]).keep_error is False
    torch.testing.assert_close(FeatureInterchange(sae, [0])(base, source), torch.tensor([[3.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [1])(base, source), torch.tensor([[0.0, 4.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [])(base, source), torch.tensor([[0.0, 2.0]]))
    # keep: f* = f(b) + dec(z_mix) − dec(z(b)); swap 0: (−1, 2) + (3, 0)
    keep = {"keep_error": keep_error_of("keep")}
    torch.testing.assert_close(FeatureInterchange(sae, [0], **keep)(base, source), torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [1], **keep)(base, source), torch.tensor([[-1.0, 4.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [], **keep)(base, source), base)
    assert keep_error_of("drop") is False and keep_error_of(None) is None
    with pytest.raises(ValueError, match="reconstruction_error='both'; choose one of drop, keep or null"):
        keep_error_of("both")
    with pytest.raises(ValueError, match="reconstruction_error='both'"):
        FeatureInterchangeFit(8, reconstruction_error="both")
    assert FeatureInterchangeFit(8, reconstruction_error="keep").keep_error is True
    pca = PCAFeaturizer.fit(torch.randn(10, 2))
    assert FeatureInterchange(pca, [0]).keep_error is True  # PCA keeps it by default


@pytest.mark.parametrize("kind", ["pca", "sae"])
def test_empty_selection_is_exactly_the_identity(kind):
    torch.manual_seed(0)
    base, source = torch.randn(5, 6) * 10, torch.randn(5, 6) * 10
    featurizer = (
        PCAFeaturizer.fit(torch.randn(40, 6))
        if kind == "pca"
        else SAEFeaturizer(torch.randn(24, 6), torch.randn(24), torch.randn(6, 24), torch.randn(6))
    )
    assert torch.equal(FeatureInterchange(featurizer, [], keep_error=True)(base, source), base)


def test_full_selection_of_full_rank_pca_is_the_full_vector_swap():
    torch.manual_seed(0)
    pca = PCAFeaturizer.fit(torch.randn(40, 6) * 4 + 2)
    base, source = torch.randn(5, 6) * 10, torch.randn(5, 6) * 10
    out = FeatureInterchange(pca, range(6))(base, source)
    torch.testing.assert_close(out, source, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out, FullVectorSwap()(base, source), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(FeatureInterchange(pca, range(5))(base, source), source, atol=1e-2)


def test_interchange_keeps_dtype():
    pca = PCAFeaturizer.fit(torch.randn(20, 4))
    base, source = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.bfloat16)
    assert FeatureInterchange(pca, [0, 1])(base, source).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- selection


def test_selection_recovers_planted_features():
    Z, labels = _planted()
    selection = select_features(Z, labels)
    assert set(selection.selected.tolist()) == {3, 7}, selection.sweep
    assert selection.dev_accuracy > 0.85
    greedy = select_features(Z, labels, tolerance=0.0)  # the best accuracy alone admits noise features
    assert greedy.dev_accuracy >= selection.dev_accuracy and len(greedy.selected) > 2
    assert [r["C"] for r in selection.sweep] == sorted(r["C"] for r in selection.sweep)
    sizes = [r["n_features"] for r in selection.sweep]
    assert sizes[0] < sizes[-1]  # smaller C, fewer features


def test_selection_max_features_and_single_C():
    Z, labels = _planted()
    one = select_features(Z, labels, max_features=1)
    assert len(one.selected) <= 1 and set(one.selected.tolist()) <= {3, 7}
    fixed = select_features(Z, labels, C=1.0)
    assert fixed.C == 1.0 and len(fixed.sweep) == 1


def test_selection_with_given_dev_split():
    Z, labels = _planted(seed=0)
    Z_dev, labels_dev = _planted(n=200, seed=1)
    selection = select_features(Z, labels, dev_features=Z_dev, dev_labels=labels_dev)
    assert {3, 7} <= set(selection.selected.tolist())


def test_grouped_holdout_keeps_groups_apart():
    Z, labels = _planted()
    groups = np.arange(600) // 6  # e.g. the entity of each row: 100 entities, 6 prompts each
    grouped = select_features(Z, labels, groups=groups)
    assert set(grouped.selected.tolist()) == {3, 7}
    from lit_interventions.interventions.feature_selection import _holdout

    fit_rows, dev_rows = _holdout(600, 0.2, 0, groups)
    assert not set(groups[fit_rows]) & set(groups[dev_rows]) and len(dev_rows) == 120
    with pytest.raises(ValueError, match="groups must have shape"):
        select_features(Z, labels, groups=groups[:10])


def test_other_attributes_drop_shared_features():
    Z, labels = _planted()
    other = (Z[:, 7] > Z[:, 7].mean()).astype(int)  # another attribute read from feature 7
    X = torch.as_tensor(Z, dtype=torch.float32)
    identity = PCAFeaturizer(torch.zeros(20), torch.eye(20))  # features = coordinates
    plain = fit_feature_interchange(X, labels, featurizer=identity)
    strict = fit_feature_interchange(X, labels, featurizer=identity, other_labels={"other": other})
    assert {3, 7} <= set(plain.selected.tolist())
    assert 3 in strict.selected.tolist() and 7 not in strict.selected.tolist()


def test_fitted_pca_interchange_moves_the_label():
    """Planted: the label is the sign of one latent axis hidden under a rotation; the fitted
    interchange must carry the source's label into the base, and nothing else much."""
    rng = np.random.default_rng(0)
    n, d = 800, 12
    scales = 4.0 * 0.75 ** np.arange(d)  # well-separated variances: PCA finds the latent axes
    latents = rng.normal(size=(n, d)) * scales
    labels = (latents[:, 4] > 0).astype(int)
    rotation, _ = np.linalg.qr(rng.normal(size=(d, d)))
    X = torch.as_tensor(latents @ rotation.T + 1.0, dtype=torch.float32)
    # raw PCA: standardising each coordinate of a rotated space would mix the latent axes again
    intervention = fit_feature_interchange(X, labels, featurizer="pca", standardize_pca=False)
    assert 4 in intervention.selected.tolist() and len(intervention.selected) <= 3, intervention.selection.sweep
    probe = LogisticRegression().fit(X.numpy(), labels)
    base, source = X[:400], X[400:]
    moved = probe.predict(intervention(base, source).numpy())
    assert (moved == labels[400:]).mean() > 0.9
    assert (probe.predict(base.numpy()) == labels[:400]).mean() > 0.9  # the base had its own label
    assert (labels[:400] != labels[400:]).mean() > 0.3  # many pairs differ, so the test can fail


# ---------------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    Z, labels = _planted(n=50)
    with pytest.raises(ValueError, match="empty"):
        select_features(np.zeros((0, 5)), np.zeros(0))
    with pytest.raises(ValueError, match="empty"):
        fit_feature_interchange(torch.zeros(0, 4), [])
    with pytest.raises(ValueError, match="C must be finite and > 0"):
        select_features(Z, labels, C=0.0)
    with pytest.raises(ValueError, match="C must be finite and > 0"):
        select_features(Z, labels, C=[1.0, -0.1])
    with pytest.raises(ValueError, match="empty grid"):
        select_features(Z, labels, C=[])
    with pytest.raises(ValueError, match="1 distinct value"):
        select_features(Z, np.full(50, "France"))
    with pytest.raises(ValueError, match="one label per example"):
        select_features(Z, labels[:10])
    with pytest.raises(ValueError, match="featurizer='sae'"):
        fit_feature_interchange(torch.as_tensor(Z), labels, featurizer="sae")
    with pytest.raises(ValueError, match=r"in 0\.\.1"):
        FeatureInterchange(_manual_sae(), [2])
    with pytest.raises(ValueError, match="n_components"):
        PCAFeaturizer.fit(torch.randn(5, 8), n_components=6)
    with pytest.raises(ValueError, match="tolerance"):
        select_features(Z, labels, tolerance=-0.1)
    with pytest.raises(ValueError, match="max_features"):
        select_features(Z, labels, C=[1.0], max_features=0)


# ---------------------------------------------------------------------------------- SAE training


def _sparse_data(n=512, m=16, d=8, seed=0):
    """x = codes @ D + 5 + noise, two active codes of 16 per example."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(m, d, generator=g)
    D /= D.norm(dim=1, keepdim=True)
    codes = torch.zeros(n, m)
    for row in range(n):
        codes[row, torch.randperm(m, generator=g)[:2]] = torch.rand(2, generator=g) * 3 + 1
    return codes @ D + 5.0 + 0.01 * torch.randn(n, d, generator=g)


def _train_sae(X, l1, epochs=40):
    data = ActivationsDataModule(X, val_fraction=0.2, batch_size=64)
    torch.manual_seed(0)
    module = SAEModule(hidden_size=X.shape[1], l1_coefficient=l1, lr=3e-3)
    data.setup()
    val = data.val_set.tensors[0]
    module.sae.initialize(data.mean, data.scale)
    before = module.losses(val)
    _trainer(epochs).fit(module, datamodule=data)
    return module, before, module.losses(val), val


def test_sae_training_lowers_mse_and_l1_makes_latents_sparse():
    X = _sparse_data()
    sparse, before, after, val = _train_sae(X, l1=0.3)
    assert sparse.sae.W1.shape == (32, 8)  # latent 4d
    assert after["mse"] < 0.5 * before["mse"], (before, after)
    dense, _, dense_after, _ = _train_sae(X, l1=0.0)
    assert after["l0"] < 0.5 * dense_after["l0"], (after, dense_after)  # the penalty really sparsifies
    assert after["l0"] < 32 / 4
    norms = sparse.sae.W2.norm(dim=0)
    torch.testing.assert_close(norms, torch.ones_like(norms))  # decoder columns normalised


def test_exported_sae_acts_on_raw_activations(tmp_path):
    X = _sparse_data(n=128)
    data = ActivationsDataModule(X, val_fraction=0.25, batch_size=32)
    module = SAEModule(hidden_size=8, l1_coefficient=0.1, lr=3e-3)
    trainer = _trainer(3, default_root_dir=tmp_path, callbacks=[ExportSAE()])
    trainer.fit(module, datamodule=data)
    assert module.sae.scale.item() == pytest.approx(data.scale) and data.scale != 1.0
    loaded = SAEFeaturizer.load(tmp_path / WEIGHTS)
    direct = SAEFeaturizer.from_sae(module)
    x = X[:10]
    torch.testing.assert_close(loaded.encode(x), module.sae.encode(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        loaded.decode(loaded.encode(x)), module.sae.decode(module.sae.encode(x)), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(direct.W1, loaded.W1)
    card = json.loads((tmp_path / "config.json").read_text())  # the run's one card
    assert card["latent_size"] == 32 and card["method"] == "sae"
    assert "val/fvu" in card["metrics"]
    assert set(load_file(tmp_path / WEIGHTS)) == {"W1", "b1", "W2", "b2"}  # the SAE only, no LM weights


def test_sae_bad_input():
    with pytest.raises(ValueError, match="l1_coefficient"):
        SAEModule(hidden_size=8, l1_coefficient=-1.0)
    with pytest.raises(ValueError, match="latent_size"):
        SparseAutoencoder(8, 0)
    with pytest.raises(ValueError, match="positions"):
        RavelActivationsDataModule(lm="gemma-3-270m", layer=0, positions="middle")


# ---------------------------------------------------------------------------------- RAVEL activations


def test_ravel_activations_at_the_entity_token(tiny_lm_dir, tokenizer):
    lm = tiny_lm_dir("gpt2")
    data = RavelActivationsDataModule(
        lm=lm, layer=1, max_prompts=24, read_batch_size=8, val_fraction=0.25, batch_size=8
    )
    assert data.hidden_size == 32
    data.setup()
    acts = torch.cat([data.train_set.tensors[0], data.val_set.tensors[0]])
    assert acts.shape[1] == 32 and 12 <= len(acts) <= 24
    template, entity = next((t, e) for t, e in data.prompts() if "%s" in t)
    ids, pos = encode_prompt(tokenizer, "<bos>", template, entity)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[: pos + 1]).endswith(entity)
    assert not tokenizer.decode(ids[:pos]).endswith(entity)
    every = RavelActivationsDataModule(lm=lm, layer=1, max_prompts=24, positions="all", val_fraction=0.25)
    every.setup()
    assert len(every.train_set) + len(every.val_set) > 3 * len(acts)  # every token of the prompts


def test_sae_cli_writes_weights(tiny_lm_dir, tmp_path):
    from lit_interventions.cli.commands import main

    lm = tiny_lm_dir("gpt2")
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--data.lm",
            lm,
            "--data.layer",
            "1",
            "--data.max_prompts",
            "32",
            "--data.batch_size",
            "8",
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    (weights,) = tmp_path.rglob(WEIGHTS)
    featurizer = SAEFeaturizer.load(weights)
    assert featurizer.W1.shape == (128, 32)
    assert not (weights.parent / CARD).exists()
    config = json.loads((weights.parent / "config.json").read_text())  # the run's one card
    assert config["model"] == lm and config["layer"] == 1
    assert config["kind"] == "sae" and config["weights"] == WEIGHTS and config["site"] == {"layer": 1}
    assert config["class_path"] == "lit_interventions.modules.sae.SparseAutoencoder"
    assert (weights.parent / "README.md").read_text().count("sparse autoencoder") >= 1


# ---------------------------------------------------------------------------------- with RavelDataModule


def test_pca_interchange_from_ravel_batches(monkeypatch, tiny_lm_dir):
    """Fit a PCA FeatureInterchange on the base representations of RavelDataModule train batches
    (labels: the target attribute of the base entity) and run it in the tiny model."""
    from lit_interventions.datamodules.ravel import RavelDataModule

    from lit_interventions.core.forward import logits_at, read_site
    from lit_interventions.core.lm import load_lm

    def oracle(self, model, queries):  # the tiny random model answers nothing: pretend it knows all
        return [list(self.value_tokens(q.template, self.data.entities[q.entity][q.attribute])) for q in queries]

    monkeypatch.setattr(RavelDataModule, "predict_next", oracle)
    lm_dir, layer = tiny_lm_dir("gemma3"), 1
    dm = RavelDataModule(lm=lm_dir, train_size=80, eval_size=16, max_candidates=80, batch_size=16)
    dm.setup()
    model = load_lm(lm_dir)
    values = dm.values(dm.target_attribute)
    reps, labels = [], []
    for batch in dm.train_dataloader():
        reps.append(read_site(model, layer, batch.base.input_ids, batch.base.attention_mask, batch.base.pos))
        labels += [values[i] for i in batch.base.entity.tolist()]
    reps = torch.cat(reps)  # (80, 32)
    assert len(set(labels)) >= 2
    intervention = fit_feature_interchange(reps, labels, featurizer="pca")
    assert intervention.featurizer.n_features == 32

    batch = next(iter(dm.val_dataloader()))
    base = batch.base
    source = read_site(model, layer, batch.source.input_ids, batch.source.attention_mask, batch.source.pos)

    def run(module):
        return logits_at(
            model,
            base.input_ids,
            base.attention_mask,
            base.last,
            layer=layer,
            site_positions=base.pos,
            intervention=lambda states: module(states, source),
        )

    clean = logits_at(model, base.input_ids, base.attention_mask, base.last)
    torch.testing.assert_close(run(FeatureInterchange(intervention.featurizer, [])), clean)
    swapped = run(FullVectorSwap())
    torch.testing.assert_close(
        run(FeatureInterchange(intervention.featurizer, range(32))), swapped, atol=1e-3, rtol=1e-3
    )
    assert not torch.allclose(swapped, clean, atol=1e-3)  # the swap really changes the output


# ---------------------------------------------------------------------------------- C by dev Disentangle


def _planted_ravel(n_entities=200, seed=0):
    """Entities with a target attribute a and another b (both ±1). Site state (3 dims):
    x0 = 3a + noise (var 4.5); x1 = 2b + 0.6a (var 4.4); x2 noise. The "LM" answers a query for a
    with sign(x0) and a query for b with sign(x1 − 0.6 sign(x0)): a classifier of a gains
    accuracy from x1, but swapping x1 changes the answer for b (Iso)."""
    rng = np.random.default_rng(seed)
    a, b = rng.choice([-1, 1], n_entities), rng.choice([-1, 1], n_entities)
    x = np.stack([3 * a + 1.5 * rng.normal(size=n_entities), 2 * b + 0.6 * a, 0.5 * rng.normal(size=n_entities)], 1)
    return torch.tensor(x, dtype=torch.float32), a, b


def _planted_batch(base, source, **fields) -> SimpleNamespace:
    """What fitting and the dev metric read of a `PairBatch`, over planted states: each side's
    entity, state `x` and label, the target, kind and attribute (one-token answers: no `answers`)."""
    sides = {"base": base, "source": source}
    return SimpleNamespace(base=base, source=source, side=sides.get, answers=None, group=None, **fields)


class _PlantedRavel(BenchmarkDataModule):
    """A stand-in RAVEL data module over planted states: Cause (query a, label a(E')) and Iso
    (query b, label b(E)) examples; answers are tokens a: {0, 1}, b: {2, 3}."""

    attributes = ["A", "B"]

    def __init__(self, x, a, b, seed=0):
        super().__init__()
        self.hparams.update(eval_batch_size=64)
        self.x, self.a, self.b = x, a, b
        rng, n = np.random.default_rng(seed), len(a)
        entities = {"train": np.arange(0, n // 2), "val": np.arange(n // 2, n)}
        self.batches = {}
        for split, ids in entities.items():
            base, source = rng.choice(ids, 200), rng.choice(ids, 200)
            kind = np.r_[np.zeros(100, int), np.ones(100, int)]  # 100 Cause, then 100 Iso
            keep = (kind == 1) | (a[base] != a[source])  # a Cause example changes the answer
            base, source, kind = base[keep], source[keep], kind[keep]
            label = np.where(kind == 0, (a[source] > 0), 2 + (b[base] > 0))
            base_label = np.where(kind == 0, (a[base] > 0), 2 + (b[base] > 0))
            self.batches[split] = [
                _planted_batch(
                    SimpleNamespace(entity=torch.tensor(base), x=x[base], label=torch.tensor(base_label)),
                    SimpleNamespace(entity=torch.tensor(source), x=x[source], label=None),
                    target=torch.tensor(label, dtype=torch.long),
                    kind=torch.tensor(kind),
                    attribute=torch.tensor(kind),
                )
            ]

    def loader(self, split, batch_size, shard=True):
        return self.batches[split]

    def site_labels(self, batch, side):
        return self.a[batch.side(side).entity.numpy()].tolist()

    def dev_metric(self):
        from lit_interventions.metrics.disentangle import DevDisentangle

        return DevDisentangle(len(self.attributes))


def _planted_module(intervention):
    """The interchange module's fitting and dev choice, over planted states and the planted "LM"."""
    import lightning as L

    from lit_interventions.modules.generation import greedy_answers
    from lit_interventions.modules.interchange import InterchangeModule

    class Planted(L.LightningModule):
        fit_intervention, dev_scores = InterchangeModule.fit_intervention, InterchangeModule.dev_scores

        def __init__(self):
            super().__init__()
            self.intervention, self.printed = intervention, []

        def print(self, *args):
            self.printed.append(" ".join(map(str, args)))

        def site_representation(self, batch, side):
            return batch.side(side).x

        def intervened_logits(self, batch):
            x = self.intervention(batch.base.x, batch.source.x)
            answer_a = (x[:, 0] > 0).long()
            answer_b = 2 + (x[:, 1] - 0.6 * torch.sign(x[:, 0]) > 0).long()
            answer = torch.where(batch.attribute == 0, answer_a, answer_b)
            return torch.nn.functional.one_hot(answer, 4).float()

        def intervened_answers(self, batch):
            first = self.intervened_logits(batch)
            return first, greedy_answers(self, batch, first)

    return Planted()


def test_C_is_chosen_by_dev_disentangle_where_accuracy_disagrees():
    from lit_interventions.interventions.fitted import FeatureInterchangeFit

    x, a, b = _planted_ravel()
    data = _PlantedRavel(x, a, b)
    grid = [0.001, 1.0]
    module = _planted_module(FeatureInterchangeFit(3, select_by="disentangle", C=grid, standardize=False))
    module.fit_intervention(data)
    fitted = module.intervention
    # PCA of the raw states: axis 0 ≈ x0, axis 1 ≈ x1; the small C keeps axis 0, the large all three
    assert [row["selected"].tolist() for row in fitted.sweep] == [[0], [0, 1, 2]], fitted.sweep
    dev = {row["C"]: row["dev"] for row in fitted.sweep}
    # swapping axis 0 moves a and keeps b; swapping all is the full swap: the answer for b is b(E'),
    # right where b(E') = b(E)
    val = data.batches["val"][0]
    iso = val.kind == 1
    same_b = (b[val.base.entity[iso].numpy()] == b[val.source.entity[iso].numpy()]).mean()
    assert dev[0.001]["iso"] == 1.0 and dev[1.0]["cause"] == 1.0, dev
    assert dev[1.0]["iso"] == pytest.approx(same_b) and same_b < 0.6
    assert dev[0.001]["disentangle"] > dev[1.0]["disentangle"]
    assert fitted.C == 0.001 and fitted.fitted.selected.tolist() == [0]
    assert "C=0.001" in module.printed[0] and "1 of 3 features" in module.printed[0]
    # while a classifier's accuracy prefers the larger C (x1 carries 0.6a): the rule it replaced
    Z = featurize(fitted.featurizer, x).numpy()
    val = np.arange(len(a) // 2, len(a))
    from sklearn.svm import LinearSVC

    accuracy = {
        c: LinearSVC(C=c, penalty="l1", dual=False, max_iter=5000, tol=0.01)
        .fit(Z[: len(a) // 2], a[: len(a) // 2])
        .score(Z[val], a[val])
        for c in grid
    }
    assert accuracy[1.0] > accuracy[0.001], accuracy
    by_accuracy = _planted_module(FeatureInterchangeFit(3, select_by="accuracy", C=grid, standardize=False))
    by_accuracy.fit_intervention(data)
    assert len(by_accuracy.intervention.fitted.selected) == 2


def test_dev_choice_ties_go_to_the_smaller_C_and_bad_names_are_refused():
    from lit_interventions.interventions.fitted import FeatureInterchangeFit

    x, a, _ = _planted_ravel()
    fitted = FeatureInterchangeFit(3, C=[0.001, 1.0], standardize=False).fit(x, a.tolist())
    assert fitted.C == 1.0  # before the dev choice: the largest C
    assert list(fitted.dev_candidates()) == ["C=0.001", "C=1"]
    same = {"cause": 0.5, "iso": 0.5, "disentangle": 0.5}
    fitted.choose({"C=0.001": same, "C=1": same})
    assert fitted.C == 0.001
    with pytest.raises(ValueError, match="C=3"):
        fitted.choose({"C=3": same, "C=1": same})
    # a C whose selection repeats a smaller C's is not scored again, and records that one's scores
    repeated = FeatureInterchangeFit(3, C=[1.0, 2.0], standardize=False).fit(x, a.tolist())
    assert list(repeated.dev_candidates()) == ["C=1"]
    repeated.choose({"C=1": same})
    assert repeated.C == 1.0 and [row["dev"] for row in repeated.sweep] == [same, same]
    with pytest.raises(ValueError, match="select_by='best'"):
        FeatureInterchangeFit(3, select_by="best")
    assert FeatureInterchangeFit(3, select_by="accuracy").fit(x, a.tolist()).dev_candidates() == {}
