"""The AxBench concept-method seam: a method is a registered name or a class_path config, asked by
capability.

A direction estimator that exists only in this file runs as an AxBench dictionary from a YAML alone
(`python -m lit_interventions fit`) and gives exactly the dictionary the built-in DiffMean gives; a
trained concept method written here gives exactly what the built-in SSV gives; registered names,
configs and instances build the same methods, through the CLI too; the class paths that run
configs of the closed forms name (concept_methods.DiffMeanMethod, ...) build their estimators and
`validate` such a run; a method's option given to
`SteeringModule` itself names the init_args it belongs in; a dictionary reads its latent from its
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
from lit_interventions.interventions.additive import ConceptDictionary, ReFTR1Dictionary, SSVDictionary
from lit_interventions.interventions.capabilities import is_trained
from lit_interventions.interventions.directions import LATDirection, PCADirection, ProbeDirection
from lit_interventions.interventions.registry import FITTED, TRAINED, kind, method_spec
from lit_interventions.modules.steering import SteeringModule, build_method, steering_methods

ROOT = Path(__file__).resolve().parents[1]
SEAM = "tests.test_axbench_seam"  # this file, as the subprocess imports it from the repository root


class PlantedDiffMean:
    """A direction estimator: fit(X, y) sets direction_ = (mean of the y = 1 rows − mean of the y = 0
    rows), normalised: DiffMean written out here with the same float64 operations."""

    name = "planted_diffmean"

    def fit(self, X, y):
        X, y = X.double().numpy(), np.asarray(y)
        a = X[y == 1].mean(0) - X[y == 0].mean(0)
        self.direction_ = torch.as_tensor(a / np.linalg.norm(a), dtype=torch.float32)
        return self


class PlantedSSV(ConceptDictionary):
    """Φ(h) = h + w_c on a concept's positives (`rows`) at the `where` tokens, w_c free norm starting
    at 0.01 (the built-in SSV's default), latent ReLU(h·w): SSV written out here."""

    name = "planted_ssv"
    latent = "relu"

    def __init__(self):
        super().__init__(unit_norm=False, fill=0.01)

    def forward(self, base, source=None, *, concept_id, factor=None, where=None, rows=None):
        if factor is not None:
            return super().forward(base, source, concept_id=concept_id, factor=factor)
        w = self.weight[concept_id.clamp(min=0)]
        keep = rows[:, None] & where
        return torch.where(keep[:, :, None], base + w.to(base.dtype)[:, None, :], base)

    def config(self):
        return {}


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
    axbench = {"diffmean", "pca", "lat", "probe", "lda", "kmeans", "random", "reft_r1", "ssv"}
    assert axbench <= set(steering_methods()) and not {"das", "vanilla", "dbm"} & set(steering_methods())
    path = "lit_interventions.interventions.additive.ReFTR1Dictionary"
    assert method_spec("reft_r1").class_path == path and method_spec("ssv").lr == 0.01
    for given in ("reft_r1", {"class_path": path, "init_args": {"topk": 3}}, ReFTR1Dictionary(topk=3)):
        built, name, options = build_method(given, 32, seed=0)
        assert type(built) is ReFTR1Dictionary and built.topk == (8 if given == "reft_r1" else 3) and name == "reft_r1"
        assert is_trained(built) and kind(built) == TRAINED and built.latent == "relu" and built.unit_norm
    lat, name, _ = build_method("lat", 32, seed=5)
    assert type(lat) is LATDirection and lat.random_state == 5 and name == "lat" and kind(lat) == FITTED
    mine = PCADirection(random_state=9)
    pca, name, _ = build_method(mine, 32, seed=2)  # a copy seeded by direction_seed; the given one untouched
    assert (pca.random_state, mine.random_state, name) == (2, 9, "pca")
    directions = "lit_interventions.interventions.directions"
    probe, name, _ = build_method({"class_path": f"{directions}.ProbeDirection", "init_args": {"l2": 1e-3}}, 32, 0)
    assert (probe.l2, probe.bias, name) == (1e-3, True, "probe")
    assert build_method(f"{SEAM}.PlantedDiffMean", 32, 0)[1] == "planted_diffmean"  # its own name
    assert not SSVDictionary().unit_norm and ReFTR1Dictionary().card() == {"topk": 8, "l1": 5e-3}
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=ReFTR1Dictionary(topk=3, l1=0.0))
    assert module.hparams.method == {
        "class_path": path,
        "init_args": {"topk": 3, "l1": 0.0, "l1_ramp": True, "negative_l1": False, "train_on_negative": True},
    }
    assert SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean").hparams.method == "diffmean"
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=ProbeDirection(l2=1e-3, bias=False))
    assert module.hparams.method["init_args"] == {
        "strength": None,
        "max_iter": 1000,
        "tol": 1e-6,
        "random_state": 0,
        "l2": 1e-3,
        "bias": False,
    }
    assert (module.method_name, module.latent, module.automatic_optimization) == ("probe", "linear", False)


def test_the_class_paths_of_old_run_configs_build_their_estimators(tiny_lm_dir):
    """Run configs and checkpoints of closed-form runs name concept_methods.DiffMeanMethod, PCAMethod,
    LATMethod (pairs) and ProbeMethod (l2, bias; AxBench's 1e-3 and no bias unless given): each
    builds the registered estimator with those options, and the card keeps its name. Those of
    trained runs name ReFTR1Method and SSVMethod: each builds the registered dictionary."""
    old = "lit_interventions.interventions.concept_methods"
    cases = [
        ({"class_path": f"{old}.DiffMeanMethod"}, "DiffMeanDirection", {}, "positives"),
        ({"class_path": f"{old}.PCAMethod", "init_args": {}}, "PCADirection", {}, "positives"),
        ({"class_path": f"{old}.LATMethod", "init_args": {"pairs": "all"}}, "LATDirection", {}, "all"),
        (
            {"class_path": f"{old}.ProbeMethod", "init_args": {}},
            "ProbeDirection",
            {"l2": 1e-3, "bias": False},
            "positives",
        ),
        (
            {"class_path": f"{old}.ProbeMethod", "init_args": {"l2": None, "bias": True}},
            "ProbeDirection",
            {"l2": None, "bias": True},
            "positives",
        ),
    ]
    for config, cls, options, unsupervised_on in cases:
        module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=config)
        assert type(module.method).__name__ == cls and module.unsupervised_on == unsupervised_on
        assert {k: getattr(module.method, k) for k in options} == options
        assert module.method_name == cls.removesuffix("Direction").lower() and module.hparams.method == config
    trained = [  # the trained methods' old class paths, with their options
        ({"class_path": f"{old}.ReFTR1Method", "init_args": {"topk": 3}}, ReFTR1Dictionary, {"topk": 3, "l1": 5e-3}),
        ({"class_path": f"{old}.SSVMethod", "init_args": {"init": 0.5}}, SSVDictionary, {"init": 0.5}),
    ]
    for (config, cls, options), name in zip(trained, ("reft_r1", "ssv")):
        module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method=config, concept_names=CONCEPTS)
        assert type(module.method) is cls and module.method is module.dictionary
        assert {k: getattr(module.method, k) for k in options} == options
        assert module.method_name == name and module.hparams.method == config


def test_an_old_run_config_validates_its_checkpoint_and_fits_again(tmp_path, tiny_lm_dir):
    """A run whose config.yaml names concept_methods.ProbeMethod: `train.py validate --config
    RUN/config.yaml --ckpt_path ...` gives the AUROC its fit logged, and `fit --config` gives the same
    dictionary again. (A closed form makes no optimizer step, so its checkpoint is one saved by hand.)"""
    lm, concepts = tiny_lm_dir("llama"), _concept_dir(tmp_path)
    directions = "lit_interventions.interventions.directions"
    method = {"class_path": f"{directions}.ProbeDirection", "init_args": {"l2": 1e-3, "bias": False}}
    fitted = train_main(["fit", "--config", str(_config(tmp_path, "run", lm, concepts, method))])
    (run,) = (tmp_path / "run").glob("**/version_0")
    fitted.trainer.save_checkpoint(run / "checkpoints" / "fitted.ckpt")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    old = {"class_path": "lit_interventions.interventions.concept_methods.ProbeMethod", "init_args": {}}
    saved["model"]["init_args"]["method"] = old
    saved["trainer"]["default_root_dir"] = str(tmp_path / "again")
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    ckpt = str(run / "checkpoints" / "fitted.ckpt")
    checked = train_main(["validate", "--config", str(run / "config.yaml"), "--ckpt_path", ckpt])
    assert type(checked.model.method) is ProbeDirection
    assert (checked.model.method.l2, checked.model.method.bias) == (1e-3, False)
    assert checked.trainer.callback_metrics["val/auroc"].item() == fitted.trainer.callback_metrics["val/auroc"].item()
    assert torch.equal(checked.model.dictionary.weight, fitted.model.dictionary.weight)
    train_main(["fit", "--config", str(run / "config.yaml")])
    again, first = _dictionary(tmp_path / "again"), _dictionary(run)
    assert torch.equal(again.vectors, first.vectors) and again.method == first.method == "probe"
    assert again.auroc == first.auroc


def test_bad_methods_and_moved_options_are_one_clear_error(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"topk=2 is an option of the reft_r1 method.*init_args: \{topk: 2\}"):
        SteeringModule(lm=lm, topk=2)
    with pytest.raises(ValueError, match=r"probe_l2=0\.1 is an option of the probe method.*l2: 0\.1.*ProbeDirection"):
        SteeringModule(lm=lm, method="probe", probe_l2=0.1)
    with pytest.raises(ValueError, match=r"bias=False is an option of the probe method.*--model.method.bias False"):
        SteeringModule(lm=lm, method="diffmean", bias=False)
    with pytest.raises(
        ValueError, match=r"init=0\.5 is an option of the ssv method.*method=SSVDictionary\(init=0\.5\)"
    ):
        SteeringModule(lm=lm, method="ssv", init=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tpok'"):
        SteeringModule(lm=lm, tpok=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lat_pairs'"):  # unsupervised_on instead
        SteeringModule(lm=lm, method="lat", lat_pairs="all")
    with pytest.raises(ValueError, match="unsupervised_on='some'; valid: positives, all"):
        SteeringModule(lm=lm, method="lat", unsupervised_on="some")
    with pytest.raises(ValueError, match="topk=0 must be an integer >= 1"):
        ReFTR1Dictionary(topk=0)
    for das in ("das", {"class_path": "lit_interventions.interventions.rotation.RotatedSpaceIntervention"}):
        with pytest.raises(ValueError, match="'RotatedSpaceIntervention' is neither a direction estimator.*diffmean"):
            SteeringModule(lm=lm, method=das)
    with pytest.raises(ValueError, match=r"a method config is \{class_path, init_args\}"):
        SteeringModule(lm=lm, method={"class_path": f"{SEAM}.PlantedDiffMean", "init_arg": {}})
    with pytest.raises(ValueError, match="bad init_args"):
        SteeringModule(lm=lm, method={"class_path": f"{SEAM}.PlantedDiffMean", "init_args": {"k": 1}})


def test_the_cli_takes_a_short_name_a_class_path_and_its_init_args(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    common = [f"--model.lm={lm}", "--model.layer=1", f"--data.lm={lm}"]
    cli = train_main(["--config", "configs/reft_r1.yaml", *common, "--model.method.topk=3"], run=False)
    assert type(cli.model.method) is ReFTR1Dictionary and cli.model.method.topk == 3 and cli.model.method.l1 == 0.005
    cli = train_main(["--config", "configs/reft_r1.yaml", *common, "--model.init_args.method", "ssv"], run=False)
    assert type(cli.model.method) is SSVDictionary and cli.model.hparams.method == "ssv"
    cli = train_main(
        ["--config", "configs/diffmean.yaml", *common, f"--model.method={SEAM}.PlantedDiffMean"], run=False
    )
    assert type(cli.model.method).__name__ == "PlantedDiffMean" and not cli.model.automatic_optimization
    cli = train_main(["--config", "configs/probe.yaml", *common, "--model.method.l2=0.01"], run=False)
    assert type(cli.model.method) is ProbeDirection and (cli.model.method.l2, cli.model.method.bias) == (0.01, False)
    assert cli.model.method_name == "probe"
    cli = train_main(["--config", "configs/lat.yaml", *common, "--model.unsupervised_on=all"], run=False)
    assert type(cli.model.method) is LATDirection and cli.model.unsupervised_on == "all"


def test_the_cli_reads_an_old_run_config_as_the_method_it_stands_for(tmp_path, tiny_lm_dir):
    """A run config.yaml naming a removed class path with init_args (which the parser would try to
    import) parses as the registered method: ReFTR1Method's options carry over, ProbeMethod gets
    AxBench's defaults under the given ones, LATMethod's pairs becomes unsupervised_on."""
    lm, old = tiny_lm_dir("llama"), "lit_interventions.interventions.concept_methods"
    cases = [
        ({"class_path": f"{old}.ReFTR1Method", "init_args": {"topk": 3, "l1": 0.01}}, ReFTR1Dictionary, "positives"),
        ({"class_path": f"{old}.ProbeMethod", "init_args": {"l2": 0.01}}, ProbeDirection, "positives"),
        ({"class_path": f"{old}.LATMethod", "init_args": {"pairs": "all"}}, LATDirection, "all"),
    ]
    for i, (method, cls, unsupervised_on) in enumerate(cases):
        config = yaml.safe_load((ROOT / "configs" / "reft_r1.yaml").read_text())
        config["model"]["init_args"].update(lm=lm, layer=1, method=method)
        config["data"]["init_args"]["lm"] = lm
        path = tmp_path / f"old{i}.yaml"
        path.write_text(yaml.safe_dump(config))
        cli = train_main(["--config", str(path)], run=False)
        assert type(cli.model.method) is cls and cli.model.unsupervised_on == unsupervised_on
    assert (cli.model.method_name, cli.model.hparams.method["class_path"]) == ("lat", method_spec("lat").class_path)
    cli = train_main(["--config", str(tmp_path / "old0.yaml")], run=False)
    assert (cli.model.method.topk, cli.model.method.l1, cli.model.method_name) == (3, 0.01, "reft_r1")
    cli = train_main(["--config", str(tmp_path / "old1.yaml")], run=False)
    assert (cli.model.method.l2, cli.model.method.bias) == (0.01, False)


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
