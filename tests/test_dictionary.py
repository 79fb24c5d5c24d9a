"""The released concept dictionary: files, errors, detection and steering on the tiny llama."""

from __future__ import annotations

import json

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.forward import read_layers


def _dictionary(lm_dir, method="diffmean", d=32, names=("dogs", "giving", "rent")):
    vectors = torch.nn.functional.normalize(
        torch.randn(len(names), d, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    return Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([2.0, 3.0, float("nan")])[: len(names)],
        concepts=list(names),
        model=lm_dir,
        layer=1,
        method=method,
        training_data="builtin",
        auroc={"mean": 0.8, "per_concept": {n: 0.8 for n in names}},
        card={"model_type": "llama"},
    )


def test_save_load_round_trip(tmp_path, tiny_lm_dir):
    d = _dictionary(tiny_lm_dir("llama"))
    path = d.save(tmp_path / "dictionary")  # suffix added
    assert path.name == "dictionary.safetensors" and (tmp_path / "dictionary.json").is_file()
    card = json.loads((tmp_path / "dictionary.json").read_text())
    assert card["hidden_size"] == 32 and card["concepts"] == ["dogs", "giving", "rent"] and card["latent"] == "linear"
    for where in (path, tmp_path / "dictionary.json", tmp_path / "dictionary"):
        loaded = Dictionary.load(where)
        torch.testing.assert_close(loaded.vectors, d.vectors)
        torch.testing.assert_close(loaded.max_activations, d.max_activations, equal_nan=True)
        assert (loaded.concepts, loaded.model, loaded.layer, loaded.method) == (d.concepts, d.model, 1, "diffmean")
        assert loaded.auroc == d.auroc and loaded.training_data == "builtin" and loaded.card == {"model_type": "llama"}
    with pytest.raises(FileNotFoundError, match="NAME.safetensors"):
        Dictionary.load(tmp_path / "missing.safetensors")


def test_bad_dictionaries_and_concepts(tiny_lm_dir):
    d = _dictionary(tiny_lm_dir("llama"))
    assert d.index("giving") == 1 and d.index(2) == 2
    with pytest.raises(
        ValueError, match="concept 'cats' is not in this dictionary; valid concepts include 'dogs', 'giving'"
    ):
        d.index("cats")
    with pytest.raises(ValueError, match="index 3 is out of range: this dictionary has 3 concepts"):
        d.index(3)
    with pytest.raises(ValueError, match="2 concept names for 3 vectors"):
        Dictionary(
            vectors=torch.zeros(3, 4),
            max_activations=torch.zeros(3),
            concepts=["a", "b"],
            model="m",
            layer=0,
            method="diffmean",
        )
    with pytest.raises(ValueError, match="no max activation"):
        d.steering_alpha("rent", 1.0)
    assert d.steering_alpha("giving", 2.0) == pytest.approx(6.0)


def test_errors_name_both_models(tiny_lm_dir, tiny_lm):
    d = _dictionary(tiny_lm_dir("llama"), d=16)  # hidden size 16, the tiny llama has 32
    with pytest.raises(ValueError, match=r"trained for model .*hidden size 16.*has hidden size 32"):
        d.detect(["the dog"], lm=tiny_lm("llama"))
    with pytest.raises(ValueError, match=r"trained for model '.*tiny-llama.*', not 'gemma-3-270m'"):
        with d.steer("gemma-3-270m", "dogs"):
            pass
    other = _dictionary(tiny_lm_dir("llama"))
    with pytest.raises(ValueError, match="a llama model.*a gpt_neox model"):
        with other.steer(tiny_lm("gpt_neox"), "dogs"):
            pass


@pytest.mark.parametrize("method", ["diffmean", "reft_r1"])
def test_detect_is_the_max_latent_over_tokens(tiny_lm_dir, tiny_lm, tokenizer, method):
    lm_dir = tiny_lm_dir("llama")
    d = _dictionary(lm_dir, method=method)
    texts = ["The dog is here.", "give the dog"]
    scores = d.detect(texts, tokenizer=tokenizer)
    assert scores.shape == (2, 3)
    model = tiny_lm("llama")
    for i, text in enumerate(texts):
        ids = torch.tensor([tokenizer("<bos>" + text)["input_ids"]])  # the tiny tokenizer adds no BOS itself
        assert ids[0, 0] == tokenizer.bos_token_id
        hidden = read_layers(model, [1], ids, torch.ones_like(ids))[1][0, 1:]  # (seq - 1, d): the BOS is not scored
        latents = hidden @ d.vectors.T
        if method == "reft_r1":
            latents = latents.relu()
        torch.testing.assert_close(scores[i], latents.max(0).values, atol=1e-5, rtol=0)


def test_steering_changes_generation_and_is_undone(tiny_lm_dir, tiny_lm, tokenizer):
    model = tiny_lm("llama")
    d = _dictionary(tiny_lm_dir("llama"))
    ids = torch.tensor([tokenizer("The dog is here.")["input_ids"]])

    def generate():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
        return out[0, ids.shape[1] :].tolist()

    plain = generate()
    with d.steer(model, "giving", factor=20.0) as steered:  # α = 20 × 3.0 along w_giving
        assert steered is model
        changed = generate()
    assert changed != plain
    assert generate() == plain  # the hook is gone after the block
    with d.steer(model, 0, alpha=0.0):
        assert generate() == plain  # α = 0 adds nothing
