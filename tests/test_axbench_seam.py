"""The AxBench concept-method seam: a concept method is a class_path config, asked by capability.

A closed-form concept method that exists only in this file runs as an AxBench dictionary from a
YAML alone (`python -m lit_interventions fit`) and gives exactly the dictionary the built-in
DiffMean gives; a trained one written here gives exactly what the built-in SSV gives; short
names, configs and instances build the same methods, through the CLI too; a method's option given
to `SteeringModule` itself names the init_args it belongs in; a dictionary reads its latent from its
card (a card without one, by the method's name)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR
from test_axbench_methods import CONCEPTS, SyntheticConcepts, _trainer

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.cli.lightning import train_main
from lit_interventions.interventions.capabilities import Fitted, is_trained
from lit_interventions.interventions.concept_methods import (
    ClosedFormConceptMethod,
    DiffMeanMethod,
    LATMethod,
    ProbeMethod,
    ReFTR1Method,
    SSVMethod,
    TrainedConceptMethod,
)
from lit_interventions.interventions.concept_registry import concept_method, registered_concept_methods
from lit_interventions.interventions.registry import FITTED, TRAINED, kind
from lit_interventions.modules.steering import SteeringModule

ROOT = Path(__file__).resolve().parents[1]
SEAM = "tests.test_axbench_seam"  # this file, as the subprocess imports it from the repository root


class PlantedDiffMean(ClosedFormConceptMethod):
    """w_c = mean(H⁺_c) − mean(H⁻), normalised: DiffMean written out here with the same float64 operations."""

    name = "planted_diffmean"

    def direction(self, positives, negatives, seed=0):
        a = positives.double().numpy().mean(0) - negatives.double().numpy().mean(0)
        return torch.as_tensor(a / np.linalg.norm(a), dtype=torch.float32)


class PlantedSSV(TrainedConceptMethod):
    """Φ(h) = h + w_c on a concept's positives, w_c free norm: SSV written out here."""

    name = "planted_ssv"
    unit_norm = False
    init = 0.01  # every coordinate's start, as the built-in SSV's default

    def steer(self, hidden, w, where, seen):
        return hidden + w.to(hidden.dtype)[:, None, :]


def _concept_dir(tmp_path) -> Path:
    """A tiny directory in the AxBench layout: 2 built-in concepts, 6 train positives each, 8 pool
    negatives; 4 eval positives and 4 negatives each."""
    out = tmp_path / "concepts"
    out.mkdir()
    meta = (BUILTIN_DIR / "metadata.jsonl").read_text().splitlines()[:2]
    (out / "metadata.jsonl").write_text("\n".join(meta) + "\n")
    train = pd.read_json(BUILTIN_DIR / "train_data.jsonl", lines=True, dtype=False)
    evaluation = pd.read_json(BUILTIN_DIR / "latent_eval_data.jsonl", lines=True, dtype=False)
    parts = [train[train["concept_id"] == c].head(6) for c in (0, 1)] + [train[train["concept_id"] == -1].head(8)]
    pd.concat(parts).to_parquet(out / "train_data.parquet")
    parts = [
        evaluation[(evaluation["concept_id"] == c) & (evaluation["category"] == category)].head(4)
        for c in (0, 1)
        for category in ("positive", "negative")
    ]
    pd.concat(parts).to_parquet(out / "latent_eval_data.parquet")
    return out


def _config(tmp_path, name: str, lm: str, concepts: Path, method) -> Path:
    config = {
        "seed_everything": 0,
        "model": {
            "class_path": "lit_interventions.modules.steering.SteeringModule",
            "init_args": {"lm": lm, "layer": 1, "method": method},
        },
        "data": {
            "class_path": "lit_interventions.datamodules.axbench.AxBenchDataModule",
            "init_args": {"lm": lm, "concept_dir": str(concepts), "max_length": 64, "batch_size": 4},
        },
        "trainer": {
            "max_epochs": 1,
            "accelerator": "cpu",
            "devices": 1,
            "default_root_dir": str(tmp_path / name),
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _dictionary(run_dir: Path) -> Dictionary:
    (weights,) = run_dir.glob("**/dictionary.safetensors")
    return Dictionary.load(weights)


def test_a_method_written_here_runs_from_yaml_as_the_builtin_diffmean(tmp_path, tiny_lm_dir):
    lm, concepts = tiny_lm_dir("llama"), _concept_dir(tmp_path)
    planted = _config(tmp_path, "planted", lm, concepts, {"class_path": f"{SEAM}.PlantedDiffMean"})
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]  # this file imports its neighbours
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-m", "lit_interventions", "fit", "--config", str(planted)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    train_main(["fit", "--config", str(_config(tmp_path, "builtin", lm, concepts, "diffmean"))])
    ours, builtin = _dictionary(tmp_path / "planted"), _dictionary(tmp_path / "builtin")
    assert torch.equal(ours.vectors, builtin.vectors) and ours.vectors.shape == (2, 32)
    assert torch.equal(ours.max_activations, builtin.max_activations)
    assert ours.auroc == builtin.auroc and ours.concepts == builtin.concepts
    assert (ours.method, ours.latent, builtin.method, builtin.latent) == (
        "planted_diffmean",
        "linear",
        "diffmean",
        "linear",
    )
    saved = yaml.safe_load(next((tmp_path / "planted").glob("**/hparams.yaml")).read_text())
    assert saved["method"]["class_path"] == f"{SEAM}.PlantedDiffMean"  # a config, not an object


def test_a_trained_method_written_here_trains_as_the_builtin_ssv(tmp_path, tiny_lm_dir, tokenizer):
    weights = []
    for method in ("ssv", PlantedSSV()):
        L.seed_everything(0)
        module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=method, lr=1e-2)
        _trainer(tmp_path / str(len(weights)), limit_val_batches=0).fit(module, datamodule=SyntheticConcepts(tokenizer))
        weights.append(module.dictionary.weight.detach().clone())
        assert module.automatic_optimization and module.dictionary.unit_norm is False
    assert weights[0].abs().sum() > 0 and torch.equal(weights[0], weights[1])
    exported = module.to_dictionary()
    assert (exported.method, exported.latent, exported.concepts) == ("planted_ssv", "relu", CONCEPTS)
    assert module.hparams.method == {"class_path": f"{PlantedSSV.__module__}.PlantedSSV", "init_args": {}}


def test_names_configs_and_instances_build_the_same_methods(tiny_lm_dir):
    assert registered_concept_methods() == ["reft_r1", "ssv", "diffmean", "pca", "lat", "probe"]
    path = "lit_interventions.interventions.concept_methods.ReFTR1Method"
    for given in ("reft_r1", {"class_path": path, "init_args": {"topk": 3}}, ReFTR1Method(topk=3)):
        built = concept_method(given)
        assert type(built) is ReFTR1Method and built.topk == (8 if given == "reft_r1" else 3)
        assert is_trained(built) and kind(built) == TRAINED and built.latent == "relu" and built.unit_norm
    assert concept_method("lat", pairs="all").config() == {"pairs": "all"}
    assert kind(concept_method("probe")) == FITTED and isinstance(DiffMeanMethod(), Fitted)
    assert not SSVMethod().unit_norm and ProbeMethod().card() == {} and ReFTR1Method().card() == {"topk": 8, "l1": 5e-3}
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=ReFTR1Method(topk=3, l1=0.0))
    assert module.hparams.method == {
        "class_path": path,
        "init_args": {"topk": 3, "l1": 0.0, "l1_ramp": True, "negative_l1": False, "train_on_negative": True},
    }
    assert SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean").hparams.method == "diffmean"


def test_bad_methods_and_moved_options_are_one_clear_error(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"topk=2 is an option of the reft_r1 method.*init_args: \{topk: 2\}"):
        SteeringModule(lm=lm, topk=2)
    with pytest.raises(ValueError, match=r"probe_l2=0\.1 is an option of the probe method.*l2: 0\.1"):
        SteeringModule(lm=lm, method="probe", probe_l2=0.1)
    with pytest.raises(ValueError, match=r"lat_pairs='all' .*method=LATMethod\(pairs='all'\)"):
        SteeringModule(lm=lm, method="lat", lat_pairs="all")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tpok'"):
        SteeringModule(lm=lm, tpok=2)
    with pytest.raises(ValueError, match="topk=0 must be an integer >= 1"):
        ReFTR1Method(topk=0)
    with pytest.raises(ValueError, match="pairs='some'; valid: positives, all"):
        LATMethod(pairs="some")
    with pytest.raises(ValueError, match="is not a concept method"):
        concept_method({"class_path": "lit_interventions.interventions.directions.DiffMeanDirection"})
    with pytest.raises(ValueError, match=r"a method config is \{class_path, init_args\}"):
        concept_method({"class_path": f"{SEAM}.PlantedDiffMean", "init_arg": {}})
    with pytest.raises(ValueError, match="bad init_args"):
        concept_method({"class_path": f"{SEAM}.PlantedDiffMean", "init_args": {"k": 1}})


def test_the_cli_takes_a_short_name_a_class_path_and_its_init_args(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    common = [f"--model.lm={lm}", "--model.layer=1", f"--data.lm={lm}"]
    cli = train_main(["--config", "configs/reft_r1.yaml", *common, "--model.method.topk=3"], run=False)
    assert type(cli.model.method) is ReFTR1Method and cli.model.method.topk == 3 and cli.model.method.l1 == 0.005
    cli = train_main(["--config", "configs/reft_r1.yaml", *common, "--model.init_args.method", "ssv"], run=False)
    assert type(cli.model.method) is SSVMethod and cli.model.hparams.method == "ssv"
    cli = train_main(
        ["--config", "configs/diffmean.yaml", *common, f"--model.method={SEAM}.PlantedDiffMean"], run=False
    )
    assert type(cli.model.method).__name__ == "PlantedDiffMean" and not cli.model.automatic_optimization


def test_a_dictionary_reads_its_latent_from_the_card_and_old_cards_by_name(tmp_path):
    vectors, hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[[-2.0, 3.0]]])
    mine = Dictionary(vectors, torch.ones(2), ["a", "b"], "m", 1, "planted_ssv", latent="relu")
    mine.save(tmp_path / "mine")
    loaded = Dictionary.load(tmp_path / "mine")
    assert loaded.card_dict()["latent"] == "relu" and loaded.latents(hidden).tolist() == [[[0.0, 3.0]]]
    card = tmp_path / "mine.json"
    for method, expected in (("reft_r1", [0.0, 3.0]), ("diffmean", [-2.0, 3.0])):
        written = json.loads(card.read_text())
        written.pop("latent", None)  # a card written without the field
        card.write_text(json.dumps({**written, "method": method}))
        assert Dictionary.load(tmp_path / "mine").latents(hidden)[0, 0].tolist() == expected
    with pytest.raises(ValueError, match="latent='sigmoid'; valid: linear, relu"):
        Dictionary(vectors, torch.ones(2), ["a", "b"], "m", 1, "x", latent="sigmoid")
