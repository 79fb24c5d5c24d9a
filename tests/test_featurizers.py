"""PCA / SAE featurizers, L1 feature selection and the feature interchange (RAVEL baselines)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning import Trainer
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression

from datamodules.activations import ActivationsDataModule, RavelActivationsDataModule
from datamodules.ravel import encode_prompt
from lit_interventions.interventions.featurizers import (
    FeatureInterchange,
    FullVectorSwap,
    PCAFeaturizer,
    SAEFeaturizer,
    fit_feature_interchange,
    select_features,
)
from lit_interventions.modules.sae import CARD, WEIGHTS, ExportSAE, SAEModule, SparseAutoencoder

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sae.yaml"


def _trainer(epochs: int, **kwargs) -> Trainer:
    return Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip


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
    pca = PCAFeaturizer.fit(X)
    base, source = torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0, -7.0]])
    torch.testing.assert_close(FeatureInterchange(pca, [0])(base, source), torch.tensor([[5.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(pca, [1])(base, source), torch.tensor([[1.0, -7.0]]))


def test_sae_interchange_keeps_base_reconstruction_error():
    sae = _manual_sae()  # f = ReLU(x), x̂ = f: negative coordinates are reconstruction error
    base, source = torch.tensor([[-1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    # z(b) = (0, 2), z(s) = (3, 4); swap 0: z_mix = (3, 2), dec(z_mix) − dec(z(b)) = (3, 0)
    torch.testing.assert_close(FeatureInterchange(sae, [0])(base, source), torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [1])(base, source), torch.tensor([[-1.0, 4.0]]))
    # without the error term: f* = dec(z_mix) = (3, 2); an empty selection reconstructs the base
    torch.testing.assert_close(FeatureInterchange(sae, [0], keep_error=False)(base, source), torch.tensor([[3.0, 2.0]]))
    torch.testing.assert_close(FeatureInterchange(sae, [], keep_error=False)(base, source), torch.tensor([[0.0, 2.0]]))


@pytest.mark.parametrize("kind", ["pca", "sae"])
def test_empty_selection_is_exactly_the_identity(kind):
    torch.manual_seed(0)
    base, source = torch.randn(5, 6) * 10, torch.randn(5, 6) * 10
    featurizer = (PCAFeaturizer.fit(torch.randn(40, 6)) if kind == "pca"
                  else SAEFeaturizer(torch.randn(24, 6), torch.randn(24), torch.randn(6, 24), torch.randn(6)))  # fmt: skip
    assert torch.equal(FeatureInterchange(featurizer, [])(base, source), base)


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
    from lit_interventions.interventions.featurizers import _holdout

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
    intervention = fit_feature_interchange(X, labels, featurizer="pca")
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
    torch.testing.assert_close(loaded.decode(loaded.encode(x)), module.sae.decode(module.sae.encode(x)), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(direct.W1, loaded.W1)
    card = json.loads((tmp_path / CARD).read_text())
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
    data = RavelActivationsDataModule(lm=lm, layer=1, max_prompts=24, read_batch_size=8, val_fraction=0.25,
                                      batch_size=8)  # fmt: skip
    assert data.hidden_size == 32
    data.setup()
    acts = torch.cat([data.train_set.tensors[0], data.val_set.tensors[0]])
    assert acts.shape[1] == 32 and 12 <= len(acts) <= 24
    template, entity = next((t, e) for t, e in data.prompts() if "%s" in t)
    ids, pos = encode_prompt(tokenizer, "<bos>", template, entity)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[: pos + 1]).endswith(entity)
    assert not tokenizer.decode(ids[: pos]).endswith(entity)
    every = RavelActivationsDataModule(lm=lm, layer=1, max_prompts=24, positions="all", val_fraction=0.25)
    every.setup()
    assert len(every.train_set) + len(every.val_set) > 3 * len(acts)  # every token of the prompts


def test_sae_cli_writes_weights(tiny_lm_dir, tmp_path):
    from lit_interventions.modules.sae import main

    lm = tiny_lm_dir("gpt2")
    main(["--config", str(CONFIG), "--data.lm", lm, "--data.layer", "1", "--data.max_prompts", "32", "--data.batch_size", "8",
          "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false"])  # fmt: skip
    (weights,) = tmp_path.rglob(WEIGHTS)
    featurizer = SAEFeaturizer.load(weights)
    assert featurizer.W1.shape == (128, 32)
    card = json.loads((weights.parent / CARD).read_text())
    assert card["model"] == lm and card["layer"] == 1


# ---------------------------------------------------------------------------------- with RavelDataModule


def test_pca_interchange_from_ravel_batches(monkeypatch, tiny_lm_dir):
    """Fit a PCA FeatureInterchange on the base representations of RavelDataModule train batches
    (labels: the target attribute of the base entity) and run it in the tiny model."""
    from datamodules.ravel import RavelDataModule
    from lit_interventions.lm import load_lm
    from lit_interventions.sites import logits_at, read_site

    def oracle(self, model, queries):  # the tiny random model answers nothing: pretend it knows all
        return [self.value_token(q.template, self.data.entities[q.entity][q.attribute]) for q in queries]

    monkeypatch.setattr(RavelDataModule, "predict_next", oracle)
    lm_dir, layer = tiny_lm_dir("gemma3"), 1
    dm = RavelDataModule(lm=lm_dir, train_size=80, eval_size=16, max_candidates=80, batch_size=16)
    dm.setup()
    model = load_lm(lm_dir)
    values = dm.values(dm.target_attribute)
    reps, labels = [], []
    for batch in dm.train_dataloader():
        reps.append(read_site(model, layer, batch["base_input_ids"], batch["base_attention_mask"], batch["base_pos"]))
        labels += [values[i] for i in batch["base_entity"].tolist()]
    reps = torch.cat(reps)  # (80, 32)
    assert len(set(labels)) >= 2
    intervention = fit_feature_interchange(reps, labels, featurizer="pca")
    assert intervention.featurizer.n_features == 32

    batch = next(iter(dm.val_dataloader()))
    source = read_site(model, layer, batch["source_input_ids"], batch["source_attention_mask"], batch["source_pos"])

    def run(module):
        return logits_at(model, batch["base_input_ids"], batch["base_attention_mask"], batch["base_last"], layer=layer,
                         site_positions=batch["base_pos"], intervention=lambda base: module(base, source))  # fmt: skip

    clean = logits_at(model, batch["base_input_ids"], batch["base_attention_mask"], batch["base_last"])
    torch.testing.assert_close(run(FeatureInterchange(intervention.featurizer, [])), clean)
    swapped = run(FullVectorSwap())
    torch.testing.assert_close(run(FeatureInterchange(intervention.featurizer, range(32))), swapped, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(swapped, clean, atol=1e-3)  # the swap really changes the output
