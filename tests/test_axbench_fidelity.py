"""Fidelity to AxBench's code: the AUROC without hard negatives (`AUCROCEvaluator`), the steering
unit of a dead row (`pre_compute_mean_activations`), the steering generation's top-k and the
judge's sampling (`LanguageModel` in `evaluate.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, CATEGORIES, load_concepts
from sklearn.metrics import auc, roc_curve

import lit_interventions.studies.steer as steer
from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.interventions.additive import DEAD_MAX_ACTIVATION, steering_units
from lit_interventions.metrics.detection import UNSCORED, ConceptAUROC
from lit_interventions.metrics.judge_openai import OpenAIJudge
from lit_interventions.modules.steering import SteeringModule

# One concept: 3 positives, 3 negatives and 2 hard negatives that score above two positives.
POSITIVES, NEGATIVES, HARD = [0.9, 0.6, 0.4], [0.1, 0.5, 0.2], [0.95, 0.7]
FLOAT32_EPS = torch.finfo(torch.float32).eps  # the metric computes in float32: equal to its last bit


def _scored(labels: list[int]) -> dict:
    """ConceptAUROC over the planted rows: each row's tokens are (s, s − 1, a padded 100) with the
    padding masked out, so max-pooling gives s."""
    scores = torch.tensor(POSITIVES + NEGATIVES + HARD)
    tokens = torch.stack([scores, scores - 1.0, torch.full_like(scores, 100.0)], dim=1)  # (8, 3)
    mask = torch.tensor([[1, 1, 0]] * len(scores))
    metric = ConceptAUROC(1)
    metric.update(tokens, mask, torch.zeros(len(scores), dtype=torch.long), torch.tensor(labels))
    return metric.compute()


def test_auroc_leaves_hard_negatives_out_as_axbench():
    """AxBench's AUCROCEvaluator maps {positive: 1, negative: 0} (its map has no "hard negative"),
    drops the rows without a label and takes sklearn's roc_curve + auc. By hand: P(pos > neg) over
    the 3 × 3 pairs is 8/9; counting the hard negatives as negatives gives 9/15."""
    pairs = sum(p > n for p in POSITIVES for n in NEGATIVES)
    assert pairs == 8
    frame = pd.DataFrame(
        {
            "max_act": POSITIVES + NEGATIVES + HARD,
            "category": ["positive"] * 3 + ["negative"] * 3 + ["hard negative"] * 2,
        }
    )
    frame["label"] = frame["category"].map({"positive": 1, "negative": 0})
    kept = frame.dropna(subset=["label"])
    fpr, tpr, _ = roc_curve(kept["label"], kept["max_act"])
    official = auc(fpr, tpr)
    assert official == pytest.approx(8 / 9, abs=1e-12)

    dropped = _scored([1, 1, 1, 0, 0, 0, UNSCORED, UNSCORED])
    assert dropped["auroc"].item() == pytest.approx(official, rel=FLOAT32_EPS, abs=0)
    assert dropped["auroc_per_concept"].item() == dropped["auroc"].item()  # the mean of one concept
    assert dropped["max_score"].item() == torch.tensor(0.95).item()  # the hard negative: still the max activation

    as_negatives = _scored([1, 1, 1, 0, 0, 0, 0, 0])
    assert as_negatives["auroc"].item() == pytest.approx(9 / 15, rel=FLOAT32_EPS, abs=0)
    assert as_negatives["max_score"].item() == torch.tensor(0.95).item()


def test_one_concept_logs_its_auroc_and_records_its_max_activation():
    """torchmetrics squeezes a one-element result to a scalar; the callback still logs the one
    concept's AUROC under its name and records a (1,) max activation."""
    logged, recorded = {}, {}
    module = SimpleNamespace(
        concepts=["dogs/cats"],
        log_dict=logged.update,
        record_detection=lambda prefix, result: recorded.update(result),
    )
    result = _scored([1, 1, 1, 0, 0, 0, UNSCORED, UNSCORED])
    assert result["auroc_per_concept"].dim() == 0  # what torchmetrics hands the callback
    AUROCCallback().log_values(module, result, "val", None)
    assert sorted(logged) == ["val/auroc", "val/auroc/dogs∕cats"]
    assert logged["val/auroc/dogs∕cats"].item() == pytest.approx(8 / 9, rel=FLOAT32_EPS, abs=0)
    assert recorded["max_score"].shape == (1,) and recorded["max_score"].item() == torch.tensor(0.95).item()


def test_auroc_refuses_other_labels():
    with pytest.raises(ValueError, match=r"label must be 0 \(negative\), 1 \(positive\) or -1.*got \[-2, 0, 1\]"):
        ConceptAUROC(1).update(
            torch.zeros(3, 2), torch.ones(3, 2), torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, -2])
        )


def test_eval_labels_of_hard_negatives_follow_the_option(tiny_lm_dir):
    for option, expected in (("drop", UNSCORED), ("negative", 0)):
        dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concepts=[0, 1], max_length=128, hard_negatives=option)
        dm.setup()
        batches = list(dm.val_dataloader())
        label = torch.cat([b["label"] for b in batches])
        category = torch.cat([b["category"] for b in batches])
        hard = category == CATEGORIES["hard negative"]
        assert hard.sum().item() == 6 and (label[hard] == expected).all()
        assert (label[category == CATEGORIES["positive"]] == 1).all()
        assert (label[category == CATEGORIES["negative"]] == 0).all()
        assert (torch.cat([b["label"] for b in dm.train_dataloader()]) >= 0).all()  # train keeps 0 / 1
    with pytest.raises(ValueError, match="hard_negatives='ignore'; choose 'drop' or 'negative'"):
        AxBenchDataModule(lm=tiny_lm_dir("llama"), hard_negatives="ignore")


def test_a_concept_with_only_hard_negatives_needs_them_scored(tmp_path, tiny_lm_dir):
    data = load_concepts()
    keep = ~((data.eval.concept_id == 0) & (data.eval.category == "negative"))
    data.train.to_parquet(tmp_path / "train_data.parquet")
    data.eval[keep].to_parquet(tmp_path / "latent_eval_data.parquet")
    (tmp_path / "metadata.jsonl").write_text((BUILTIN_DIR / "metadata.jsonl").read_text())
    with pytest.raises(ValueError, match=r"concept 0 .* has 36 positive and 0 negative rows.*hard_negatives='drop'"):
        AxBenchDataModule(lm=tiny_lm_dir("llama"), concept_dir=str(tmp_path), concepts=[0])
    dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concept_dir=str(tmp_path), concepts=[0], hard_negatives="negative")
    assert dm.concept_ids == [0]


def test_dead_rows_steer_with_axbench_unit():
    """AxBench: `max_act if max_act > 0 else 50`."""
    torch.testing.assert_close(
        steering_units(torch.tensor([3.5, 0.0, -1.25, 1e-3])), torch.tensor([3.5, 50.0, 50.0, 1e-3])
    )
    assert DEAD_MAX_ACTIVATION == 50.0
    assert torch.isnan(steering_units(torch.tensor([float("nan")]))).all()  # never validated: refused later


def test_a_stored_dictionary_steers_its_dead_row_with_axbench_unit():
    vectors = torch.eye(3, 4)
    d = Dictionary(vectors, torch.tensor([2.0, 0.0, -1.0]), ["a", "b", "c"], model="tiny", layer=1, method="reft_r1")
    assert [d.steering_alpha(c, 0.5) for c in ("a", "b", "c")] == [1.0, 25.0, 25.0]
    assert d.max_activations.tolist() == [2.0, 0.0, -1.0]  # the file's values are kept as stored


def test_validation_sets_the_unit_of_a_dead_row(tiny_lm_dir):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="reft_r1", concept_names=["a", "b", "c"])
    module._trainer = SimpleNamespace(sanity_checking=False)
    result = {
        "auroc": torch.tensor(0.7),
        "auroc_per_concept": torch.tensor([0.9, 0.5, float("nan")]),
        "max_score": torch.tensor([12.0, 0.0, float("nan")]),
    }
    module.record_detection("val", result)
    assert module.max_activations[:2].tolist() == [12.0, 50.0] and module.max_activations[2].isnan()


def test_steering_generation_samples_from_the_top_50_by_default(monkeypatch):
    seen = []
    monkeypatch.setattr(steer, "generate_replies", lambda *a, **k: seen.append(k) or ["reply"])
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(max_position_embeddings=64)))
    tokenizer = SimpleNamespace(chat_template=None)
    steer.generate(model, tokenizer, ["Say hi."], 4, 1.0, 1, seed=0)
    steer.generate(model, tokenizer, ["Say hi."], 4, 1.0, 1, seed=0, top_k=0)
    steer.generate(model, tokenizer, ["Say hi."], 4, 0.0, 1, seed=0)
    sampling = [{k: v for k, v in s.items() if k in ("do_sample", "temperature", "top_k", "top_p")} for s in seen]
    assert sampling == [
        {"do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 1.0},
        {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        {"do_sample": False},
    ]
    with pytest.raises(ValueError, match="top_k=-1"):
        steer.run_steer_eval(dictionary="unused", top_k=-1)


def test_judge_samples_at_0_7_without_a_cap_as_axbench(monkeypatch):
    bodies = []
    judge = OpenAIJudge(base_url="http://127.0.0.1:9", model="tiny", cache=None, retries=0)
    monkeypatch.setattr(judge, "_post", lambda body: bodies.append(body) or "Rating: [[2]]")
    judge._chat("Rate this.")
    capped = OpenAIJudge(base_url="http://127.0.0.1:9", model="tiny", cache=None, temperature=0.0, max_tokens=256)
    monkeypatch.setattr(capped, "_post", lambda body: bodies.append(body) or "Rating: [[2]]")
    capped._chat("Rate this.")
    message = [{"role": "user", "content": "Rate this."}]
    assert bodies == [
        {"model": "tiny", "messages": message, "temperature": 0.7},
        {"model": "tiny", "messages": message, "temperature": 0.0, "max_tokens": 256},
    ]
    with pytest.raises(ValueError, match="max_tokens=0 must be an integer >= 1, or None"):
        OpenAIJudge(max_tokens=0)
