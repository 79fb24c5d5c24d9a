"""AxBench concept-dictionary methods, the detection metric and a short fit on synthetic concepts.

Synthetic data (the AxBench batch format) on the tiny llama: each concept is planted as a token
(" dog" for concept 0, " give" for concept 1) inside the response of its positives; negatives and
the prompts are made of other tokens.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.callbacks.dictionary import ExportDictionary
from lit_interventions.interventions.additive import (
    ConceptDictionary,
    ReFTR1Dictionary,
    SSVDictionary,
    add_vector,
    non_topk_l1,
    reft_r1_intervention,
    topk_mean,
)
from lit_interventions.interventions.directions import DiffMeanDirection, LATDirection, PCADirection, ProbeDirection
from lit_interventions.metrics.detection import ConceptAUROC, min_max_normalise, sequence_scores
from lit_interventions.modules.steering import SteeringModule
from lit_interventions.modules.steering_closed_form import fit_concept_direction

CONCEPTS = ["dogs", "giving"]


# --- synthetic AxBench batches -------------------------------------------------------------------


def _ids(tokenizer, words):
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(w))[0] for w in words]


def make_rows(tokenizer, n_per_concept=12, n_negative=12, seed=0, train=True):
    """Rows as dicts of lists: prompt of filler tokens, response of filler tokens; a positive's
    response holds its concept token at two random places."""
    rng = np.random.default_rng(seed)
    filler = _ids(tokenizer, [" the", " is", " here", " The", " that", " a", " of", " to"])
    concept_tokens = _ids(tokenizer, [" dog", " give"])
    rows = []

    def row(concept, label):
        prompt = list(rng.choice(filler, 4))
        response = list(rng.choice(filler, 8))
        if label == 1:
            for pos in rng.choice(8, 2, replace=False):
                response[pos] = concept_tokens[concept]
        return {"prompt": prompt, "response": response, "concept_id": concept, "label": label}

    for c in range(len(CONCEPTS)):
        rows += [row(c, 1) for _ in range(n_per_concept)]
    for i in range(n_negative):
        rows.append(row(i % len(CONCEPTS) if not train else -1, 0))
    return rows


def collate(rows, pad_id=0, prefix=1):
    """The AxBench batch format, right padded; the first `prefix` tokens play the chat prefix."""
    T = max(len(r["prompt"]) + len(r["response"]) for r in rows)
    B = len(rows)
    batch = {
        k: torch.zeros(B, T, dtype=torch.long) for k in ("input_ids", "attention_mask", "response_mask", "content_mask")
    }
    batch["input_ids"].fill_(pad_id)
    batch["token_labels"] = torch.full((B, T), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = r["prompt"] + r["response"]
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["response_mask"][i, len(r["prompt"]) : len(ids)] = 1
        batch["content_mask"][i, prefix : len(ids)] = 1
        if r["label"] == 1:
            batch["token_labels"][i, len(r["prompt"]) : len(ids)] = r["concept_id"]
    batch["output_mask"] = batch["response_mask"].clone()  # the synthetic responses have no end-of-turn token
    batch["concept_id"] = torch.tensor([r["concept_id"] for r in rows])
    batch["label"] = torch.tensor([r["label"] for r in rows])
    batch["category"] = batch["label"].clone()
    return batch


class SyntheticConcepts(L.LightningDataModule):
    def __init__(self, tokenizer, batch_size=8):
        super().__init__()
        self.concepts = list(CONCEPTS)
        self.train_rows = make_rows(tokenizer, seed=0, train=True)
        self.val_rows = make_rows(tokenizer, n_per_concept=8, n_negative=16, seed=1, train=False)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(
            self.train_rows,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(0),
        )

    def val_dataloader(self):
        return DataLoader(self.val_rows, batch_size=self.batch_size, collate_fn=collate)


def detection_by_hand(module, loader, limit_batches=None):
    """The module's detection result recomputed outside the metric: each row's score is the max of
    the module's own token scores over the tokens it detects on (`detect_on`: every real token after
    the chat prefix, or the response); AUROC per concept is sklearn's on those scores. Returns
    ({concept index: AUROC}, their mean, {concept index: largest score})."""
    from sklearn.metrics import roc_auc_score

    scores, concept_id, label = [], [], []
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if limit_batches is not None and i >= limit_batches:
                break
            tokens = module.token_scores(module.states(batch), batch["concept_id"]).float()
            text = batch["output_mask"].bool()  # the response text, without an end-of-turn token
            if module.hparams.detect_on == "content" and "content_mask" in batch:
                end_of_turn = batch["response_mask"].bool() & ~text
                pooled = batch["content_mask"].bool() & batch["attention_mask"].bool() & ~end_of_turn
            else:
                pooled = text
            for row in range(len(tokens)):
                scored = tokens[row][pooled[row]]
                if len(scored):
                    scores.append(scored.max().item())
                    concept_id.append(int(batch["concept_id"][row]))
                    label.append(int(batch["label"][row]))
    scores, concept_id, label = np.array(scores), np.array(concept_id), np.array(label)
    per_concept = {
        c: roc_auc_score(label[concept_id == c], scores[concept_id == c])
        for c in sorted(set(concept_id.tolist()))
        if 0 < label[concept_id == c].sum() < (concept_id == c).sum()
    }
    largest = {c: scores[concept_id == c].max() for c in sorted(set(concept_id.tolist()))}
    return per_concept, float(np.mean(list(per_concept.values()))), largest


def assert_detection_by_hand(trainer, module, loader, limit_batches=None):
    """val/auroc, val/auroc/<concept> and the max activations equal their recomputation by hand."""
    per_concept, mean, largest = detection_by_hand(module, loader, limit_batches)
    metrics = trainer.callback_metrics
    assert per_concept, "no concept had both positives and negatives"
    assert metrics["val/auroc"].item() == pytest.approx(mean, abs=1e-5)
    for c, name in enumerate(module.concepts):
        logged = metrics[f"val/auroc/{name}"].item()
        if c in per_concept:
            assert logged == pytest.approx(per_concept[c], abs=1e-5), name
        else:  # a concept without both labels has no AUROC
            assert np.isnan(logged), name
        if c in largest:
            assert module.max_activations[c].item() == pytest.approx(largest[c], abs=1e-4), name
    return per_concept, mean


def _trainer(tmp_path, **kwargs):
    options = dict(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=True,
    )
    options.update(kwargs)
    return L.Trainer(**options)


# --- the interventions, by hand ------------------------------------------------------------------


def test_topk_mean_and_reft_r1_intervention_by_hand():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # (batch, d): each row's concept
    hidden = torch.tensor(
        [[[1.0, 9.0], [5.0, 0.0], [3.0, 1.0], [-2.0, 0.0]], [[0.0, 2.0], [0.0, -1.0], [7.0, 100.0], [0.0, 0.0]]]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # row 1: the 100 is padding
    steered, latents, chosen = reft_r1_intervention(hidden, w, mask, k=2)
    # latents ReLU(h·w): row 0 [1, 5, 3, 0] -> top 2 {5, 3}, mean 4; row 1 [2, 0] -> mean 1
    torch.testing.assert_close(latents, torch.tensor([[1.0, 5.0, 3.0, 0.0], [2.0, 0.0, 100.0, 0.0]]))
    assert chosen.tolist() == [[False, True, True, False], [True, True, False, False]]
    torch.testing.assert_close(steered, hidden + torch.tensor([[4.0, 0.0], [0.0, 1.0]])[:, None, :])
    mean, _ = topk_mean(latents, mask, k=8)  # fewer than k tokens: the mean of all of them
    torch.testing.assert_close(mean, torch.tensor([9.0 / 4, 1.0]))
    with pytest.raises(ValueError, match="topk"):
        topk_mean(latents, mask, k=0)


def test_l1_counts_only_the_non_top_k_latents():
    latents = torch.tensor([[1.0, 5.0, 3.0, 2.0]], requires_grad=True)
    mask = torch.ones(1, 4)
    _, chosen = topk_mean(latents, mask, k=2)
    l1 = non_topk_l1(latents, chosen, mask)
    assert l1.item() == pytest.approx((1.0 + 2.0) / 4)
    l1.sum().backward()
    torch.testing.assert_close(latents.grad, torch.tensor([[0.25, 0.0, 0.0, 0.25]]))


def test_dictionary_keeps_rows_unit_norm_and_drops_the_parallel_gradient():
    d = ConceptDictionary(3, 5, unit_norm=True, seed=1)
    torch.testing.assert_close(d.weight.norm(dim=-1), torch.ones(3))
    w = d.weight.detach().clone()
    grad = torch.randn(3, 5)
    d.weight.grad = grad.clone()
    d.remove_parallel_grad()
    torch.testing.assert_close((d.weight.grad * w).sum(-1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(d.weight.grad, grad - (grad * w).sum(-1, keepdim=True) * w)
    d.weight.data *= 3.0
    d.renormalise()
    torch.testing.assert_close(d.weight.norm(dim=-1), torch.ones(3))
    free = ConceptDictionary(2, 4, unit_norm=False)
    free.weight.data += 2.0
    free.renormalise()
    assert free.weight.norm(dim=-1).tolist() == pytest.approx([4.0, 4.0])
    with pytest.raises(ValueError, match="concept_id 7"):
        d.rows(torch.tensor([0, 7]))


def test_add_vector_adds_alpha_w_at_every_token():
    hidden = torch.randn(2, 3, 4)
    v = torch.tensor([1.0, 0.0, -1.0, 2.0])
    torch.testing.assert_close(add_vector(hidden, v, 0.5), hidden + 0.5 * v)


# --- closed-form fits ------------------------------------------------------------------------------


def _planted(n=200, d=6, shift=3.0, seed=0):
    rng = np.random.default_rng(seed)
    axis = torch.tensor(rng.standard_normal(d), dtype=torch.float32)
    axis /= axis.norm()
    negatives = torch.tensor(rng.standard_normal((n, d)), dtype=torch.float32)
    positives = torch.tensor(rng.standard_normal((n // 2, d)), dtype=torch.float32) + shift * axis
    return positives, negatives, axis


def test_diffmean_is_the_normalised_difference_of_token_means():
    positives = torch.tensor([[1.0, 2.0], [3.0, 2.0]])
    negatives = torch.tensor([[0.0, 0.0], [0.0, 2.0], [0.0, 1.0]])
    # mean(H+) - mean(H-) = (2, 2) - (0, 1) = (2, 1)
    w = fit_concept_direction(DiffMeanDirection(), positives, negatives)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0]) / 5**0.5)


@pytest.mark.parametrize("method", ["diffmean", "probe", "lat"])
def test_supervised_directions_find_the_planted_axis(method):
    """(LAT with pairs across positives and negatives; AxBench's positives-only pairs cannot see a
    mean shift between the classes: see test_lat_pairs_are_drawn_from_the_positives_as_axbench.)"""
    positives, negatives, axis = _planted()
    estimator = {"diffmean": DiffMeanDirection(), "probe": ProbeDirection(l2=1e-3), "lat": LATDirection()}[method]
    w = fit_concept_direction(estimator, positives, negatives, unsupervised_on="all")
    assert w.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.dot(w, axis).item() > 0.9


def test_probe_separates_planted_tokens():
    positives, negatives, _ = _planted(shift=4.0)
    w = fit_concept_direction(ProbeDirection(l2=1e-3, bias=False), positives, negatives)
    from sklearn.metrics import roc_auc_score

    scores = torch.cat([positives, negatives]) @ w
    labels = np.r_[np.ones(len(positives)), np.zeros(len(negatives))]
    assert roc_auc_score(labels, scores.numpy()) > 0.97


def test_pca_is_the_top_pc_of_the_positives_oriented_by_the_negatives():
    rng = np.random.default_rng(3)
    positives = torch.tensor(rng.standard_normal((300, 3)) * [5.0, 0.5, 0.5], dtype=torch.float32)
    negatives = positives.mean(0) - torch.tensor([[1.0, 0.0, 0.0]]) + torch.zeros(10, 3)
    w = fit_concept_direction(PCADirection(), positives, negatives)
    assert abs(w[0].item()) > 0.99 and w[0].item() > 0  # variance axis, positives projecting higher
    flipped = fit_concept_direction(PCADirection(), positives, positives.mean(0) + torch.tensor([[1.0, 0.0, 0.0]]))
    torch.testing.assert_close(flipped, -w)  # the pool above the positives on that axis: −w
    with pytest.raises(ValueError, match="unsupervised_on='some'; valid: positives, all"):
        fit_concept_direction(PCADirection(), positives, negatives, unsupervised_on="some")


# --- the detection metric ------------------------------------------------------------------------


def test_concept_auroc_by_hand():
    # Concept 0: positives score 0.9, 0.4; negatives 0.5, 0.1 -> 3 of 4 pairs ordered: 0.75.
    # Concept 1: positive 0.2; negatives 0.3, 0.3 -> 0.0. Mean 0.375.
    # Each row's sequence score is its max over the masked tokens; the 50.0 is outside the mask.
    token_scores = torch.tensor(
        [
            [0.9, 0.1, 50.0],
            [0.2, 0.4, 0.0],
            [0.5, -1.0, 0.0],
            [0.1, 0.0, 0.0],
            [0.2, 0.0, 0.0],
            [0.3, 0.0, 0.0],
            [0.1, 0.3, 0.0],
        ]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    concept_id = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    label = torch.tensor([1, 1, 0, 0, 1, 0, 0])
    metric = ConceptAUROC(num_concepts=3)
    metric.update(token_scores, mask, concept_id, label)
    out = metric.compute()
    assert out["auroc_per_concept"][:2].tolist() == pytest.approx([0.75, 0.0])
    assert torch.isnan(out["auroc_per_concept"][2])  # concept 2 was never scored
    assert out["auroc"].item() == pytest.approx(0.375)
    assert out["max_score"][:2].tolist() == pytest.approx([0.9, 0.3])
    normalised, _, _ = metric.normalised_scores()  # min-max per concept: (s - min) / (max - min)
    assert normalised.tolist() == pytest.approx([1.0, 0.375, 0.5, 0.0, 0.0, 1.0, 1.0])


def test_min_max_normalisation_and_empty_rows():
    scores = torch.tensor([2.0, 4.0, 3.0, 3.0])
    assert min_max_normalise(scores, torch.tensor([0, 0, 1, 1]), 2).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sequence_scores(torch.ones(1, 2), torch.zeros(1, 2)).item() == float("-inf")
    metric = ConceptAUROC(1)
    metric.update(torch.ones(2, 2), torch.tensor([[1, 1], [0, 0]]), torch.tensor([0, 0]), torch.tensor([1, 0]))
    assert metric.skipped.item() == 1 and torch.isnan(metric.compute()["auroc"])
    with pytest.raises(ValueError, match="concept_id must be in 0..0"):
        metric.update(torch.ones(1, 2), torch.ones(1, 2), torch.tensor([-1]), torch.tensor([0]))


def test_concept_auroc_states_merge_like_ddp():
    gen = torch.Generator().manual_seed(0)
    scores, mask = torch.randn(40, 6, generator=gen), torch.randint(0, 2, (40, 6), generator=gen)
    mask[:, 0] = 1
    concept_id, label = torch.arange(40) % 4, (torch.arange(40) // 4) % 2
    whole = ConceptAUROC(4)
    whole.update(scores, mask, concept_id, label)
    first, second = ConceptAUROC(4), ConceptAUROC(4)
    first.update(scores[:17], mask[:17], concept_id[:17], label[:17])
    second.update(scores[17:], mask[17:], concept_id[17:], label[17:])
    first.merge_state(second)  # what the DDP sync does: cat states across processes
    expected, merged = whole.compute(), first.compute()
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key])
    from sklearn.metrics import roc_auc_score

    seq = sequence_scores(scores, mask)
    by_hand = [roc_auc_score(label[concept_id == c], seq[concept_id == c]) for c in range(4)]
    assert expected["auroc_per_concept"].tolist() == pytest.approx(by_hand)


# --- the module on the tiny llama ----------------------------------------------------------------


def test_reft_r1_dictionary_is_the_formula_on_its_rows_with_its_penalty_and_ramp():
    """ReFTR1Dictionary as an intervention: forward with no factor is Φ(h_i) = h_i +
    mean(TopK(ReLU(h·w_c)))·w_c on the trained rows at the `where` tokens (a row outside them keeps
    its states, even with concept_id −1); penalty() is the mean over the batch of each trained row's
    non-top-k latents, averaged over its `where` tokens; anneal sets λ_t = λ·step/total."""
    d = ReFTR1Dictionary(topk=2, l1=0.5).allocate(2, 6, seed=3)
    base = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(4))
    concept_id, rows = torch.tensor([0, -1, 1]), torch.tensor([True, False, True])
    where = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    out = d(base, concept_id=concept_id, where=where, rows=rows)
    penalties = []
    for i in (0, 2):
        w = d.weight[concept_id[i]].detach()
        latents = torch.relu(base[i] @ w)
        top = latents.masked_fill(~where[i], -1.0).topk(2).indices
        shift = latents[top].mean() * w
        torch.testing.assert_close(out[i][where[i]], (base[i] + shift)[where[i]])
        assert torch.equal(out[i][~where[i]], base[i][~where[i]])
        rest = torch.ones(5, dtype=torch.bool)
        rest[top] = False
        penalties.append((latents * (rest & where[i])).sum() / where[i].sum())
    assert torch.equal(out[1], base[1])
    torch.testing.assert_close(d.penalty(), (penalties[0] + penalties[1]) / 3)
    with pytest.raises(ValueError, match="call forward with factor=None first"):
        d.penalty()  # the latents belong to the last forward only
    d.anneal(0, 10)
    assert d.penalty_weight == 0.0
    d.anneal(5, 10)
    assert d.penalty_weight == 0.25
    constant = ReFTR1Dictionary(l1=0.5, l1_ramp=False)
    constant.anneal(0, 10)
    assert constant.penalty_weight == 0.5
    with pytest.raises(ValueError, match=r"training form \(factor=None\) takes \(batch, seq, d\) states"):
        d(base[:, 0], concept_id=concept_id)
    steered = d(base, concept_id=torch.tensor([0, 1, 1]), factor=2.0)  # with a factor it steers: h + α·w_c
    torch.testing.assert_close(steered, base + 2.0 * d.weight.detach()[[0, 1, 1]][:, None, :])


def test_reft_r1_step_updates_only_the_concepts_in_the_batch(tiny_lm_dir, tokenizer):
    module = SteeringModule(
        lm=tiny_lm_dir("llama"), layer=1, method=ReFTR1Dictionary(topk=2, negative_l1=False), concept_names=CONCEPTS
    )
    rows = [r for r in make_rows(tokenizer) if r["concept_id"] == 0][:4]
    lm_loss, l1 = module._steered_loss(collate(rows))
    (lm_loss + 0.1 * l1).backward()
    grad = module.dictionary.weight.grad
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() == 0
    # With negative_l1, a negative pushes every concept's latents: both rows get a gradient.
    module.dictionary.weight.grad = None
    module.method.negative_l1 = True
    negatives = [r for r in make_rows(tokenizer) if r["label"] == 0][:3]
    lm_loss, l1 = module._steered_loss(collate(negatives))
    assert lm_loss.item() == 0.0 and l1.item() > 0
    l1.backward()
    assert (module.dictionary.weight.grad.abs().sum(-1) > 0).all()


def test_ssv_adds_w_at_every_token_of_positives_only(tiny_lm_dir, tokenizer):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="ssv", concept_names=CONCEPTS)
    assert (module.dictionary.weight == 0.01).all()  # SSV starts every coordinate at 0.01, as AxBench
    module.dictionary.weight.data[0] = 5.0
    rows = make_rows(tokenizer)
    batch = collate([rows[0], rows[-1]])  # a positive of concept 0, a pool negative
    seen = {}
    from lit_interventions.core.hooks import residual_hook

    with residual_hook(module.lm, 1, lambda h: seen.setdefault("h", h)):
        module._steered_loss(batch)  # the hook at layer 1 runs first: it sees the clean states
    clean = module.states(batch)
    with residual_hook(module.lm, 2, lambda h: seen.setdefault("after", h)):
        module._steered_loss(batch)
    plain = {}
    with residual_hook(module.lm, 2, lambda h: plain.setdefault("after", h)):
        module.lm.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(seen["h"], clean)
    assert not torch.allclose(seen["after"][0], plain["after"][0])  # the positive is steered
    torch.testing.assert_close(seen["after"][1], plain["after"][1])  # the negative is not


def test_ssv_init_sets_every_starting_coordinate(tiny_lm_dir, tokenizer):
    # init 0.0 starts at zero (Φ the identity); the default, AxBench's 0.01, starts elsewhere.
    zero = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=SSVDictionary(init=0.0), concept_names=CONCEPTS)
    assert zero.dictionary.weight.abs().sum() == 0 and zero.method.config() == {"init": 0.0}
    start = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=SSVDictionary(init=-0.5), concept_names=CONCEPTS)
    assert (start.dictionary.weight == -0.5).all()
    batch = collate([r for r in make_rows(tokenizer) if r["label"] == 1][:2])
    assert zero._steered_loss(batch)[0] != start._steered_loss(batch)[0]
    for bad in (float("nan"), float("inf"), "0.01", True):
        with pytest.raises(ValueError, match=r"init=.* must be a finite number"):
            SSVDictionary(init=bad)


@pytest.mark.parametrize("method", ["reft_r1", "ssv"])
def test_trained_methods_fit_and_keep_their_norm(tmp_path, tiny_lm_dir, tokenizer, method):
    options = {"reft_r1": ReFTR1Dictionary(topk=2, l1=5e-3)}
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=options.get(method, method), lr=1e-2)
    data = SyntheticConcepts(tokenizer)
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(module, datamodule=data)
    norms = module.dictionary.weight.norm(dim=-1)
    if method == "reft_r1":
        torch.testing.assert_close(norms, torch.ones(2), atol=1e-5, rtol=0)
    else:
        assert (norms > 0).all() and not torch.allclose(norms, torch.ones(2))
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert module.concepts == CONCEPTS and torch.isfinite(module.max_activations).all()
    # Two epochs on the tiny model is too little to learn the concepts: the logged detection must
    # equal its recomputation from the module's own token scores (max over the response, sklearn).
    assert set(assert_detection_by_hand(trainer, module, data.val_dataloader())[0]) == {0, 1}


@pytest.mark.parametrize("l1_ramp", [True, False], ids=["ramp", "constant"])
def test_reft_r1_l1_coefficient_ramps_from_zero_as_axbench(tmp_path, tiny_lm_dir, tokenizer, l1_ramp):
    # AxBench: loss = lm_loss + (curr_step / num_training_steps)·λ·l1, curr_step = 0 at the first step.
    module = SteeringModule(
        lm=tiny_lm_dir("llama"),
        layer=1,
        method=ReFTR1Dictionary(topk=2, l1=0.5, l1_ramp=l1_ramp, train_on_negative=False),
    )
    parts, losses, steered = [], [], module._steered_loss

    def recorded(batch):
        lm_loss, l1 = steered(batch)
        parts.append((lm_loss.item(), l1.item()))
        return lm_loss, l1

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    module._steered_loss = recorded
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[Losses()], limit_val_batches=0)
    trainer.fit(module, datamodule=SyntheticConcepts(tokenizer))
    total = trainer.estimated_stepping_batches
    assert total == len(losses) >= 4 and all(l1 > 0 for _, l1 in parts)
    share = [step / total if l1_ramp else 1.0 for step in range(total)]
    assert losses == pytest.approx([lm + 0.5 * f * l1 for (lm, l1), f in zip(parts, share)], rel=1e-6)
    assert (losses[0] == pytest.approx(parts[0][0])) is l1_ramp  # no L1 at the first step


def test_diffmean_fit_detects_planted_concepts_and_exports_a_dictionary(tmp_path, tiny_lm_dir, tokenizer):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean")
    data = SyntheticConcepts(tokenizer)
    trainer = _trainer(tmp_path, callbacks=[ExportDictionary()])
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert metrics["val/auroc"].item() > 0.9
    assert metrics["val/auroc/dogs"].item() > 0.9 and metrics["val/auroc/giving"].item() > 0.9
    # The rows are DiffMean of the collected response tokens, recomputed here by hand.
    hidden, token_labels, keep = [], [], []
    for batch in DataLoader(data.train_rows, batch_size=50, collate_fn=collate):
        hidden.append(module.states(batch)), token_labels.append(batch["token_labels"])
        keep.append(batch["response_mask"].bool())
    hidden, token_labels, keep = torch.cat(hidden), torch.cat(token_labels), torch.cat(keep)
    negatives = hidden[keep & (token_labels == -1)]
    for c in range(2):
        w = hidden[token_labels == c].mean(0) - negatives.mean(0)
        torch.testing.assert_close(module.dictionary.weight[c], w / w.norm(), atol=1e-5, rtol=0)
    exported = Dictionary.load(tmp_path / "lightning_logs" / "version_0" / "dictionary.safetensors")
    assert exported.concepts == CONCEPTS and exported.method == "diffmean" and exported.layer == 1
    torch.testing.assert_close(exported.vectors, module.dictionary.weight.detach())
    assert exported.auroc["mean"] == pytest.approx(metrics["val/auroc"].item())
    assert torch.isfinite(exported.max_activations).all() and exported.card["model_type"] == "llama"


@pytest.mark.parametrize("method", ["pca", "lat", "probe"])
def test_other_closed_form_methods_fit_in_one_pass(tmp_path, tiny_lm_dir, tokenizer, method):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=method)
    trainer = _trainer(tmp_path)
    data = SyntheticConcepts(tokenizer)
    trainer.fit(module, datamodule=data)
    torch.testing.assert_close(module.dictionary.weight.norm(dim=-1), torch.ones(2), atol=1e-5, rtol=0)
    per_concept, _ = assert_detection_by_hand(trainer, module, data.val_dataloader())
    assert set(per_concept) == {0, 1}
    if method in ("pca", "probe"):  # both find the planted tokens; LAT's random pairs need not
        assert min(per_concept.values()) > 0.9, per_concept


def test_bad_arguments_fail_before_loading(tiny_lm_dir):
    with pytest.raises(ValueError, match="unknown method 'saee'; valid methods: probe, diffmean, lda, pca"):
        SteeringModule(lm=tiny_lm_dir("llama"), method="saee")
    with pytest.raises(ValueError, match="layer=5 is out of range"):
        SteeringModule(lm=tiny_lm_dir("llama"), layer=5)
    with pytest.raises(ValueError, match="topk"):
        SteeringModule(lm=tiny_lm_dir("llama"), method=ReFTR1Dictionary(topk=0))


def test_wired_to_the_axbench_data_module(tmp_path, tiny_lm_dir):
    from lit_interventions.datamodules.axbench import AxBenchDataModule

    lm_dir = tiny_lm_dir("llama")
    data = AxBenchDataModule(lm=lm_dir, concepts=[0, 1], max_length=48, batch_size=16, eval_batch_size=32)
    module = SteeringModule(lm=lm_dir, layer=1, method="diffmean")
    trainer = _trainer(tmp_path, limit_train_batches=6, limit_val_batches=2, callbacks=[ExportDictionary()])
    with pytest.warns(UserWarning, match="truncated"):
        trainer.fit(module, datamodule=data)
    assert module.concepts == data.concepts[:2]
    assert_detection_by_hand(trainer, module, data.val_dataloader(), limit_batches=2)  # the same two batches
    exported = Dictionary.load(tmp_path / "lightning_logs" / "version_0" / "dictionary.safetensors")
    assert exported.concepts == data.concepts and exported.training_data == "builtin"


# --- fidelity to AxBench's code: negatives, the chat prefix, pooling, LAT pairs, probe ----------


def _hand_reft_r1_loss(module, batch, trained, k):
    """−log p(response) of the `trained` rows with Φ = h + mean(TopK over content)·w on content tokens only."""
    from lit_interventions.core.forward import final_logits, run_body
    from lit_interventions.core.hooks import residual_hook

    hidden = module.states(batch).detach()
    content = batch["content_mask"].bool()
    steered = hidden.clone()
    chosen_all = torch.zeros_like(content)
    for i in range(len(hidden)):
        w = module.dictionary.weight[batch["concept_id"][i].clamp(min=0)]
        latents = torch.relu(hidden[i] @ w)
        index = torch.nonzero(content[i]).flatten()
        top = index[latents[index].topk(min(k, len(index))).indices]
        chosen_all[i, top] = True
        if trained[i]:
            steered[i, index] = hidden[i, index] + latents[top].mean() * w
    targets = batch["response_mask"][:, 1:].bool() & trained[:, None]
    with residual_hook(module.lm, module.hparams.layer, lambda h: steered):
        final = run_body(module.lm, batch["input_ids"], batch["attention_mask"]).last_hidden_state
    logits = final_logits(module.lm, final[:, :-1][targets])
    return torch.nn.functional.cross_entropy(logits.float(), batch["input_ids"][:, 1:][targets]), chosen_all


def test_reft_r1_trains_on_genre_negatives_by_hand(tiny_lm_dir, tokenizer):
    """train_on_negative (AxBench's sweeps): a concept's negatives get the same TopK intervention
    and the LM loss; without it only positives count."""
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=ReFTR1Dictionary(topk=2), concept_names=CONCEPTS)
    rows = make_rows(tokenizer, train=False)
    batch = collate([rows[0], rows[13], rows[-2], rows[-1]], prefix=2)  # positives of 0 and 1, negatives of 0 and 1
    assert batch["label"].tolist() == [1, 1, 0, 0] and batch["concept_id"].tolist() == [0, 1, 0, 1]
    with torch.no_grad():
        lm_loss, _ = module._steered_loss(batch)
        expected, _ = _hand_reft_r1_loss(module, batch, torch.tensor([True] * 4), k=2)
        positives_only, _ = _hand_reft_r1_loss(module, batch, torch.tensor([True, True, False, False]), k=2)
    torch.testing.assert_close(lm_loss, expected)
    assert not torch.allclose(expected, positives_only)
    module.method.train_on_negative = False
    with torch.no_grad():
        torch.testing.assert_close(module._steered_loss(batch)[0], positives_only)
    # the negatives' gradient reaches their concept's row
    module.method.train_on_negative = True
    negatives = collate([rows[-2], rows[-4]], prefix=2)  # two negatives of concept 0
    lm_loss, l1 = module._steered_loss(negatives)
    (lm_loss + l1).backward()
    assert module.dictionary.weight.grad[0].abs().sum() > 0 and module.dictionary.weight.grad[1].abs().sum() == 0


def test_reft_r1_prefix_gets_no_intervention_and_is_never_in_the_topk(tiny_lm_dir, tokenizer):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=ReFTR1Dictionary(topk=3), concept_names=CONCEPTS)
    rows = make_rows(tokenizer, train=False)
    batch = collate([rows[0], rows[-2]], prefix=3)
    hidden = module.states(batch).detach()
    # w along the first token's state: the prefix would have the largest latents
    with torch.no_grad():
        module.dictionary.weight[0] = hidden[0, 0] / hidden[0, 0].norm()
    latents = torch.relu(hidden[0] @ module.dictionary.weight[0])
    assert latents.argmax() == 0
    seen = {}
    from lit_interventions.core.hooks import residual_hook

    with torch.no_grad(), residual_hook(module.lm, 2, lambda h: seen.setdefault("after", h)):
        lm_loss, l1 = module._steered_loss(batch)
    mask = module.intervention_mask(batch)
    assert not mask[:, :3].any() and mask[:, 3:].equal(batch["attention_mask"][:, 3:].bool())
    from lit_interventions.interventions.additive import reft_r1_intervention

    steered, lat, chosen = reft_r1_intervention(hidden, module.dictionary.weight[batch["concept_id"]], mask, 3)
    assert not chosen[:, :3].any() and chosen.sum(-1).tolist() == [3, 3]
    expected, hand_chosen = _hand_reft_r1_loss(module, batch, torch.tensor([True, True]), k=3)
    assert torch.equal(chosen, hand_chosen)
    torch.testing.assert_close(lm_loss, expected)
    # the prefix states after the next block are untouched (causal: nothing before them changed)
    plain = {}
    with torch.no_grad(), residual_hook(module.lm, 2, lambda h: plain.setdefault("after", h)):
        module.lm.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(seen["after"][:, :3], plain["after"][:, :3])
    assert not torch.allclose(seen["after"][:, 3:], plain["after"][:, 3:])
    # the L1 term averages the non-top-k latents over the content tokens only
    by_hand = torch.stack([(lat[i] * (~chosen[i] & mask[i])).sum() / mask[i].sum() for i in range(2)]).mean()
    torch.testing.assert_close(l1, by_hand)
    # exclude_prefix=False: today's behaviour, every real token
    module.hparams.exclude_prefix = False
    assert module.intervention_mask(batch).equal(batch["attention_mask"].bool())


def test_detection_pools_over_the_content_by_default(tiny_lm_dir, tokenizer):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean", concept_names=CONCEPTS)
    rows = make_rows(tokenizer, train=False)
    batch = collate([rows[0], rows[-1]], prefix=2)
    raw = module.token_scores(module.states(batch), batch["concept_id"])
    out = module._evaluate(batch)["token_scores"]
    content = batch["content_mask"].bool()
    pooled = sequence_scores(out, batch["response_mask"])  # what the AUROC callback computes
    torch.testing.assert_close(pooled, raw.masked_fill(~content, float("-inf")).amax(-1))
    module.hparams.detect_on = "response"
    torch.testing.assert_close(
        sequence_scores(module._evaluate(batch)["token_scores"], batch["response_mask"]),
        sequence_scores(raw, batch["response_mask"]),
    )


def test_detection_never_pools_the_end_of_turn_token(tiny_lm_dir, tokenizer):
    """AxBench's eval inputs stop at the response text (`[1:-suffix_length]`), so the end-of-turn
    token the data appends after a response is pooled by neither window: planted as each row's
    largest latent, it must not be the row's score."""
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean", concept_names=CONCEPTS)
    batch = collate(make_rows(tokenizer, train=False)[:2], prefix=2)
    ends = batch["attention_mask"].sum(1) - 1  # each row's last real token: make it the end-of-turn token
    batch["output_mask"][torch.arange(2), ends] = 0
    raw = module.token_scores(module.states(batch), batch["concept_id"])
    planted = raw.clone()
    planted[torch.arange(2), ends] = raw.abs().amax() + 100.0
    module.token_scores = lambda states, concept_id: planted
    for detect_on, window in (("content", batch["content_mask"]), ("response", batch["response_mask"])):
        module.hparams.detect_on = detect_on
        result = module._evaluate(batch)  # what the AUROC callback pools: token_scores over pool_mask
        pooled = sequence_scores(result["token_scores"], result["pool_mask"])
        keep = window.bool() & batch["attention_mask"].bool()
        keep[torch.arange(2), ends] = False
        torch.testing.assert_close(pooled, raw.masked_fill(~keep, float("-inf")).amax(-1))
        assert (pooled < 100).all()


def test_lat_pairs_are_drawn_from_the_positives_as_axbench():
    """AxBench's LAT: PCA over normalised differences of random pairs of the concept's positive tokens;
    the negatives only orient the direction."""
    from lit_interventions.interventions.directions import LATDirection

    rng = np.random.default_rng(0)
    positives = torch.tensor(rng.normal(size=(60, 5)) * np.array([5.0, 1, 1, 1, 1]), dtype=torch.float32)
    negatives = torch.tensor(
        rng.normal(size=(80, 5)) * np.array([1, 1, 1, 1, 9.0]) - np.array([0, 0, 0, 0, 0.5]), dtype=torch.float32
    )
    w = fit_concept_direction(LATDirection(random_state=3), positives, negatives)
    by_hand = LATDirection(random_state=3).fit(positives).direction_
    torch.testing.assert_close(w.abs(), by_hand.abs())
    assert w @ (positives.mean(0) - negatives.mean(0)) >= 0 and abs(w[0]) > 0.9
    pooled = fit_concept_direction(LATDirection(random_state=3), positives, negatives, unsupervised_on="all")
    assert abs(pooled[4]) > 0.9  # drawing pairs from the negatives too finds their spread instead


def test_probe_l2_is_on_the_mean_log_loss():
    rng = np.random.default_rng(0)
    positives = torch.tensor(rng.normal(size=(40, 4)) + np.array([2.0, 0, 0, 0]), dtype=torch.float32)
    negatives = torch.tensor(rng.normal(size=(60, 4)), dtype=torch.float32)
    from sklearn.linear_model import LogisticRegression

    w = fit_concept_direction(ProbeDirection(l2=1e-3), positives, negatives)
    X = torch.cat([positives, negatives]).numpy()
    y = np.r_[np.ones(40), np.zeros(60)]
    ref = LogisticRegression(C=1.0 / (1e-3 * 100), solver="lbfgs", max_iter=5000).fit(X, y).coef_[0]
    torch.testing.assert_close(w, torch.tensor(ref / np.linalg.norm(ref), dtype=torch.float32), atol=2e-3, rtol=0)


def test_probe_has_no_bias_and_a_unit_norm_w_as_axbench():
    """AxBench's LinearProbe scores σ(h·w) with no bias and keeps ‖w‖ = 1. The default probe is the
    L2 logistic regression without intercept, normalised; with a bias it is another direction. The
    planted data: 160 negatives around the origin, 40 positives 3 units along the first axis, and
    every token shifted by 2 along the second, so that without a bias w leans on the shared offset."""
    rng = np.random.default_rng(1)
    offset = np.array([0.0, 2.0, 0.0, 0.0])
    positives = torch.tensor(rng.normal(size=(40, 4)) + offset + [3.0, 0, 0, 0], dtype=torch.float32)
    negatives = torch.tensor(rng.normal(size=(160, 4)) + offset, dtype=torch.float32)
    from sklearn.linear_model import LogisticRegression

    w = fit_concept_direction(ProbeDirection(l2=1e-3, bias=False), positives, negatives)
    X = torch.cat([positives, negatives]).double().numpy()
    y = np.r_[np.ones(40), np.zeros(160)]
    ref = LogisticRegression(C=1.0 / (1e-3 * 200), fit_intercept=False, max_iter=5000, tol=1e-10).fit(X, y).coef_[0]
    torch.testing.assert_close(w, torch.tensor(ref / np.linalg.norm(ref), dtype=torch.float32), atol=1e-4, rtol=0)
    assert w.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert w[1].item() < -0.6  # the offset, pushing every token's logit down: the bias's work
    biased = fit_concept_direction(ProbeDirection(l2=1e-3), positives, negatives)
    assert abs(biased[1].item()) < 0.1 and biased[0].item() > 0.9  # with a bias, the offset is left to b
    with pytest.raises(ValueError, match="bias='yes' must be true or false"):
        ProbeDirection(bias="yes")
    with pytest.raises(ValueError, match="l2=-1.0 must be a finite number > 0 or None"):
        ProbeDirection(l2=-1.0)
    with pytest.raises(ValueError, match=r"strength=10.0 and l2=0.001: give one λ"):
        ProbeDirection(strength=10.0, l2=1e-3)
