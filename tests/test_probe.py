"""Probes at a site: training keeps the best validation epoch; the site is recorded and checked."""

from __future__ import annotations

import pytest
import torch

from lit_interventions.core.forward import read_site
from lit_interventions.modules.probe import ProbeModule, load_probe, probe_loss, train_probe


def _blobs(n: int, d: int, classes: int, seed: int, shift: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    centers = torch.randn(classes, d, generator=torch.Generator().manual_seed(123)) * shift
    return centers[y] + torch.randn(n, d, generator=g), y


def test_probe_loss_is_bce_for_binary_and_ce_for_multiclass():
    logits = torch.tensor([[2.0], [-1.0]])
    target = torch.tensor([1, 0])
    expected = -(torch.log(torch.sigmoid(torch.tensor(2.0))) + torch.log(1 - torch.sigmoid(torch.tensor(-1.0)))) / 2
    assert probe_loss(logits, target).item() == pytest.approx(expected.item(), rel=1e-6)
    logits3 = torch.tensor([[0.0, 0.0, 0.0]])
    assert probe_loss(logits3, torch.tensor([2])).item() == pytest.approx(torch.log(torch.tensor(3.0)).item())


@pytest.mark.parametrize("kind,classes", [("linear", 2), ("mlp", 2), ("mlp", 4)])
def test_probe_learns_separable_classes_and_keeps_best_epoch(tmp_path, kind, classes):
    train, val = _blobs(200, 8, classes, 0), _blobs(100, 8, classes, 1)
    names = [f"c{i}" for i in range(classes)]
    probe = ProbeModule(names, lm="toy", layer=0, hidden_size=8, kind=kind, hidden=16, lr=1e-2)
    probe = train_probe(probe, train, val, epochs=5, batch_size=32, save_to=tmp_path / "p.ckpt")
    assert not probe.training
    acc = (probe.predict(val[0]) == val[1]).float().mean().item()
    assert acc > 0.9
    assert probe.best_val_acc == pytest.approx(acc, abs=1e-6)  # the weights are those of the best epoch
    assert probe(train[0][:3]).shape == (3, 1 if classes == 2 else classes)
    again = load_probe(tmp_path / "p.ckpt")
    assert torch.equal(again.predict(val[0]), probe.predict(val[0]))
    assert again.classes == names and again.site == probe.site


def test_probe_standardises_raw_scale():
    """Representations with a large scale (like Gemma's residual stream) train as well as unit-scale ones."""
    train, val = _blobs(200, 8, 3, 0), _blobs(100, 8, 3, 1)
    scaled = lambda split: (split[0] * 500 + 1000, split[1])  # noqa: E731
    probe = train_probe(
        ProbeModule(["a", "b", "c"], "toy", 0, 8, kind="linear", lr=1e-2), scaled(train), scaled(val), epochs=5
    )
    assert probe.best_val_acc > 0.9


def test_probe_refuses_another_site_or_model():
    probe = ProbeModule(["a", "b"], lm="gemma-3-270m", layer=6, hidden_size=640)
    probe.check_site("gemma-3-270m", 6, 640)  # its own site: fine
    with pytest.raises(ValueError, match="layer=5"):
        probe.check_site("gemma-3-270m", 5, 640)
    with pytest.raises(ValueError, match="smollm2"):
        probe.check_site("smollm2-135m-instruct", 6, 576)
    with pytest.raises(ValueError, match="size 576"):
        probe(torch.zeros(2, 576))


@pytest.mark.parametrize("bad", [dict(kind="svm"), dict(classes=["a"]), dict(classes=["a", "a"]), dict(dropout=1.0)])
def test_probe_bad_arguments(bad):
    args = dict(classes=["a", "b"], lm="toy", layer=0, hidden_size=4) | bad
    with pytest.raises(ValueError):
        ProbeModule(**args)


def test_probe_on_tiny_lm_site(tiny_lm, tokenizer):
    """A probe of which word a sentence starts with, read at layer 1 of a tiny LM."""
    model = tiny_lm("llama")
    words = [" dog", " give"]
    texts = [f"<bos>{w} is here." for w in words for _ in range(1)]
    ids = [tokenizer(t).input_ids for t in texts]
    assert len({len(i) for i in ids}) == 1
    ids = torch.tensor(ids)
    states = read_site(model, 1, ids, torch.ones_like(ids), torch.full((2,), 1))  # (2, 32)
    noise = torch.randn(60, 32, generator=torch.Generator().manual_seed(0)) * 0.01 * states.std()
    y = torch.arange(60) % 2
    feats = states[y] + noise
    probe = ProbeModule(["dog", "give"], lm="tiny", layer=1, hidden_size=32, kind="linear", lr=1e-2)
    probe = train_probe(probe, (feats[:40], y[:40]), (feats[40:], y[40:]), epochs=3, batch_size=8)
    assert probe.best_val_acc == 1.0
