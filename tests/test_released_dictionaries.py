"""The released AxBench concept dictionaries in checkpoints/axbench/ (smollm2-135m-instruct, layer 15).

Fast tests read the files only (shape, card, unit norm, max activations, the Hugging Face layout);
the slow test runs the LM and checks that each dictionary scores a text about one of its concepts
above an unrelated one.
"""

import json
from pathlib import Path

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary

RELEASED = Path(__file__).resolve().parents[1] / "checkpoints" / "axbench"
MODEL, LAYER, HIDDEN = "smollm2-135m-instruct", 15, 576
DATASETS = {"builtin": "builtin", "concept10": "concept10_2b_l20"}  # name -> what the card's training_data ends with
METHODS = ("reft_r1", "diffmean")
RUNS = [(data, method) for data in DATASETS for method in METHODS]

# (concept, a text about it, an unrelated text), written for these tests
PAIRS = {
    "builtin": (
        "references to music and musical instruments",
        "She played the violin while her brother kept the rhythm on the drums.",
        "The cake needs two cups of flour, three eggs and a pinch of salt.",
    ),
    "concept10": (
        "references to academic papers and their formatting",
        "Smith et al. (2019), Journal of Applied Physics, vol. 12, pp. 45-67, doi:10.1000/xyz123.",
        "The cake needs two cups of flour, three eggs and a pinch of salt.",
    ),
}


def _load(data: str, method: str) -> Dictionary:
    return Dictionary.load(RELEASED / f"{data}-{method}" / "dictionary.safetensors")


@pytest.mark.parametrize("data,method", RUNS)
def test_card_and_vectors(data, method):
    d = _load(data, method)
    assert d.model == MODEL and d.layer == LAYER and d.method == method
    assert d.vectors.shape == (10, HIDDEN) and d.max_activations.shape == (10,)
    assert len(d.concepts) == 10 and PAIRS[data][0] in d.concepts
    assert d.training_data is not None and d.training_data.rstrip("/").endswith(DATASETS[data])
    assert torch.allclose(d.vectors.norm(dim=1), torch.ones(10), atol=1e-4)  # both methods are unit norm
    assert torch.isfinite(d.max_activations).all() and (d.max_activations >= 0).all()
    # a ReFT-r1 row can die (ReLU(h·w) = 0 on every eval token): builtin's "SQL queries" row did
    assert (d.max_activations > 0).sum() >= 9
    assert set(d.auroc["per_concept"]) == set(d.concepts)
    per_concept = [d.auroc["per_concept"][name] for name in d.concepts]
    # the recorded mean is the mean of the recorded per-concept AUROCs
    assert d.auroc["mean"] == pytest.approx(sum(per_concept) / len(per_concept), abs=1e-6)
    # a dead ReFT-r1 row scores 0 on every eval text: all ties, AUROC exactly 0.5
    for name, largest in zip(d.concepts, d.max_activations.tolist()):
        if largest == 0:
            assert d.auroc["per_concept"][name] == 0.5, name
    # DiffMean separates every concept on the held-out eval set; the short ReFT-r1 runs most of them
    if method == "diffmean":
        assert min(per_concept) > 0.85 and d.auroc["mean"] > 0.95, d.auroc
    else:
        assert sum(v > 0.85 for v in per_concept) >= 6 and d.auroc["mean"] > 0.8, d.auroc


@pytest.mark.parametrize("data,method", RUNS)
def test_hub_layout(data, method):
    """Each directory is a hub model repository: dictionary.safetensors, config.json, README.md."""
    from huggingface_hub import ModelCard

    directory = RELEASED / f"{data}-{method}"
    assert sorted(p.name for p in directory.iterdir()) == ["README.md", "config.json", "dictionary.safetensors"]
    config = json.loads((directory / "config.json").read_text())
    assert config["kind"] == "dictionary" and config["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["command"].startswith("python train.py fit --config configs/") and config["layer"] == LAYER
    card = ModelCard.load(directory / "README.md")
    assert card.data.library_name == "lit-interventions" and card.data.base_model == config["base_model"]
    assert "residual stream after block 15" in card.text and config["command"] in card.text
    by_directory, by_file = Dictionary.from_pretrained(directory), _load(data, method)
    assert torch.equal(by_directory.vectors, by_file.vectors) and by_directory.card == by_file.card


@pytest.mark.parametrize("data", list(DATASETS))
def test_concept10_and_builtin_differ(data):
    """The two datasets' dictionaries name different concepts (no file copied twice)."""
    other = next(name for name in DATASETS if name != data)
    assert set(_load(data, "diffmean").concepts).isdisjoint(_load(other, "diffmean").concepts)


@pytest.mark.slow
@pytest.mark.parametrize("data,method", RUNS)
def test_detects_its_concept(data, method):
    concept, positive, negative = PAIRS[data]
    d = _load(data, method)
    # the same first word: the comparison is decided by the concept, not by how the text starts
    scores = d.detect(["Note: " + positive, "Note: " + negative])  # (2, concepts), loads smollm2-135m-instruct
    row = d.index(concept)
    assert scores.shape == (2, 10)
    assert scores[0, row] > scores[1, row], scores[:, row]
