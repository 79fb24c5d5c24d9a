"""One method seam: a method is a class_path config, run by what it can do.

A closed-form direction and a trained intervention that exist only in this file run in the
CausalGym sweep from a YAML alone; DBM (RAVEL's mask, with its penalty and annealed temperature)
runs in the sweep's multi-site loop and gives what `InterchangeModule` gives it at one site; the
capabilities are declared types; the registry maps short names to specs."""

import csv
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from torch import nn

from lit_interventions.interventions.capabilities import (
    Annealed,
    DirectionEstimator,
    Fitted,
    Penalised,
    is_source_free,
    is_trained,
)
from lit_interventions.interventions.directions import DiffMeanDirection
from lit_interventions.interventions.fitted import DirectionInterchange
from lit_interventions.interventions.mask import SigmoidMaskIntervention
from lit_interventions.interventions.registry import (
    FITTED,
    FIXED,
    TRAINED,
    MethodSpec,
    kind,
    method_entry,
    method_spec,
    register_method,
    registered_methods,
)
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.objectives import CounterfactualLoss, build_objective
from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies import ravel_sweep
from lit_interventions.studies.causalgym_tasks import _region_data
from tests.user_methods import Line

TASK, SIZES = "agr_sv_num_pp", {"train_pairs": 10, "eval_pairs": 4, "seed": 0}


class PlantedDiffMean:
    """a = μ1 − μ0, normalised: DiffMean, written out here with the same float64 operations."""

    def fit(self, X, y):
        X = np.asarray(X).astype(np.float64)
        classes, codes = np.unique(np.asarray(y), return_inverse=True)
        a = X[codes == 1].mean(0) - X[codes == 0].mean(0)
        norm = np.linalg.norm(a)
        if not np.isfinite(norm) or norm == 0:
            raise ValueError("identical class means: no direction")
        self.direction_ = torch.as_tensor(a / norm, dtype=torch.float32)
        return self

    def to_intervention(self) -> nn.Module:
        return FixedSubspaceIntervention(self.direction_)


def _module(intervention, **init_args):
    """train.py's model section: InterchangeModule with `intervention` and the loop's options."""
    if intervention is not None:
        init_args["intervention"] = intervention
    return {"class_path": "lit_interventions.modules.interchange.InterchangeModule", "init_args": init_args}


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _sweep_from_yaml(tmp_path, lm_dir, methods, **options):
    config = {
        "tasks": TASK,
        "methods": methods,
        "layers": [1],
        "lm": lm_dir,
        "out": str(tmp_path / "out"),
        "train_pairs": SIZES["train_pairs"],
        "eval_pairs": SIZES["eval_pairs"],
        **options,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    sweep.main(["--config", str(path)])
    return {(r["method"], r["region"]): r for r in _rows(tmp_path / "out" / "results.csv")}


def test_capabilities_are_declared_types():
    das, mask = RotatedSpaceIntervention(8), SigmoidMaskIntervention(8, temperature_end=1e-7)
    assert is_trained(das) and is_trained(mask) and not is_trained(FixedSubspaceIntervention(torch.eye(8)))
    assert isinstance(mask, Annealed) and isinstance(mask, Penalised)
    assert not isinstance(das, Annealed) and not isinstance(das, Penalised)
    assert isinstance(DiffMeanDirection(), DirectionEstimator) and isinstance(PlantedDiffMean(), Fitted)
    assert isinstance(DirectionInterchange(8), Fitted) and not isinstance(DirectionInterchange(8), DirectionEstimator)
    assert not is_source_free(das)
    assert [kind(PlantedDiffMean()), kind(Line(8)), kind(FixedSubspaceIntervention(torch.eye(8)))] == [
        FITTED,
        TRAINED,
        FIXED,
    ]
    with pytest.raises(ValueError, match="neither fitted"):
        kind(object())


def test_registry_maps_short_names_to_specs():
    names = ["das", "probe", "diffmean", "lda", "pca", "kmeans", "random", "lat", "vanilla", "dbm"]
    assert registered_methods()[: len(names)] == names
    assert method_spec("diffmean").class_path == "lit_interventions.interventions.directions.DiffMeanDirection"
    assert isinstance(method_spec("das").build(8), RotatedSpaceIntervention)
    assert method_spec("probe").build(8, seed=5).random_state == 5  # the sweep's seed, where the class has one
    dbm = method_spec("dbm")
    assert dbm.lr == 0.01 and build_objective(dbm).sparsity == 0.001
    assert dbm.build(8).temperature_end == 1e-7
    with pytest.raises(ValueError, match="already registered"):
        register_method("das", "lit_interventions.interventions.rotation.RotatedSpaceIntervention")
    with pytest.raises(ValueError, match="Unknown method 'nope'"):
        method_spec("nope")
    with pytest.raises(
        ValueError, match=r"a method is a registered name .* or \{name: NAME, model: .*got \['class_path'"
    ):
        method_entry({"name": "x", "class_path": "a.B", "init_arg": {}})
    with pytest.raises(ValueError, match="cannot be imported"):
        MethodSpec("x", "tests.test_method_seam.Nope").build(8)


def test_methods_of_the_test_module_run_in_the_sweep_from_a_yaml_alone(tmp_path, tiny_lm_dir):
    methods = [
        {"name": "diffmean", "model": {"class_path": "lit_interventions.interventions.directions.DiffMeanDirection"}},
        {"name": "planted", "model": {"class_path": "tests.test_method_seam.PlantedDiffMean"}},
        {
            "name": "line",
            "model": _module({"class_path": "tests.user_methods.Line", "init_args": {"scale": 0.5}}, lr=0.02),
        },
        "vanilla",
    ]
    rows = _sweep_from_yaml(tmp_path, tiny_lm_dir("llama"), methods, stacked_scoring=False)
    regions = ["The", "subject", "prep", "the", "object"]
    assert sorted(rows) == sorted((m, r) for m in ("diffmean", "planted", "line", "vanilla") for r in regions)
    for region in regions:  # the planted direction is DiffMean's: the same odds and IIA, bit for bit
        planted, diffmean = rows[("planted", region)], rows[("diffmean", region)]
        assert (planted["odds"], planted["iia"]) == (diffmean["odds"], diffmean["iia"])
    assert any(float(rows[("planted", r)]["odds"]) != 0.0 for r in regions)
    assert float(rows[("line", "The")]["odds"]) == 0.0  # before the pairs' difference: nothing changes
    saved = sweep_file_keys(tmp_path / "out" / "line" / f"{TASK}_1.safetensors")
    assert saved == {f"{r}/v" for r in regions}  # the trained line, kept for a rerun


def sweep_file_keys(path):
    with safe_open(path, "pt") as f:
        return set(f.keys())


def test_dbm_in_the_sweep_equals_dbm_trained_alone_at_its_site(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    mask = {
        "class_path": "lit_interventions.interventions.mask.SigmoidMaskIntervention",
        "init_args": {"temperature": 0.01, "temperature_end": 1.0e-07},
    }
    objective = {"class_path": "lit_interventions.objectives.CounterfactualLoss", "init_args": {"sparsity": 0.001}}
    dbm = {"name": "dbm", "model": _module(mask, lr=0.01, objective=objective)}
    rows = _sweep_from_yaml(tmp_path, lm_dir, [dbm, "das"])
    assert {m for m, _ in rows} == {"dbm", "das"}
    data = _region_data(TASK, None, lm_dir, "subject", None, SIZES)
    L.seed_everything(0)
    alone = InterchangeModule(
        lm=lm_dir,
        layer=1,
        region="subject",
        intervention=partial(SigmoidMaskIntervention, temperature=0.01, temperature_end=1e-7),
        objective=CounterfactualLoss(sparsity=0.001),
        lr=0.01,
    )
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(alone, train_dataloaders=data.loader("train", 4, shuffle=True, seed=0))
    assert float(alone.intervention.temperature) == pytest.approx(1e-7)  # annealed to its end
    scores = alone.score(list(data.loader("eval", 64)))
    swept = rows[("dbm", "subject")]
    assert float(swept["odds"]) == pytest.approx(scores["odds"], rel=1e-4, abs=1e-5)
    assert float(swept["iia"]) == pytest.approx(scores["iia"], abs=1e-6)
    assert float(swept["odds"]) != pytest.approx(float(rows[("das", "subject")]["odds"]), rel=1e-3)
    assert sweep_file_keys(tmp_path / "out" / "dbm" / f"{TASK}_1.safetensors") >= {
        "subject/logits",
        "subject/temperature",
    }


def test_short_names_unknown_names_and_twice_are_refused_before_any_work(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"Unknown methods \['magic'\]; valid: das, probe.*dbm"):
        sweep.run_sweep(methods=["das", "magic"], lm=lm_dir, out=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="name a method twice"):
        sweep.run_sweep(
            methods=["das", {"name": "das", "model": _module(None, k=2)}], lm=lm_dir, out=str(tmp_path / "b")
        )
    with pytest.raises(ValueError, match="cannot be imported"):
        sweep.run_sweep(
            methods=[{"name": "x", "model": {"class_path": "tests.nope.X"}}], lm=lm_dir, out=str(tmp_path / "c")
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    assert [spec.name for spec in sweep.choose_methods("all")] == sweep.METHODS


def test_ravel_methods_are_registered_names_or_name_and_model_entries(tmp_path):
    configs = Path("configs/ravel")
    section, epochs = ravel_sweep.method_config(configs, "full_swap")
    inline = {"name": "mine", "model": section}
    assert [name for name, _, _ in ravel_sweep.choose_methods("all")] == ravel_sweep.ALL
    chosen = ravel_sweep.choose_methods(["das", inline])
    options = ravel_sweep._method_options(chosen, "gpt2", None, None, None)
    assert list(options) == ["das", "mine"]
    assert options["das"][1] == 3 and options["mine"][1] == 1  # das.yaml's max_epochs; an inline method: 1
    no_files = ravel_sweep.choose_methods(["full_swap"], tmp_path)  # the registered spec, as the file sets it
    assert options["mine"] == ravel_sweep._method_options(no_files, "gpt2", None, None, None)["full_swap"]
    with pytest.raises(ValueError, match=r"Unknown methods \['nope'\]; valid: das, .*pca_features, sae"):
        ravel_sweep.choose_methods(["nope"])
    with pytest.raises(ValueError, match=r"a method is a registered name .*got \['class_path', 'name'\]"):
        ravel_sweep.choose_methods([{"name": "x", "class_path": "a.B"}])
    with pytest.raises(ValueError, match=r"got \['epochs', 'model', 'name'\]"):
        ravel_sweep.choose_methods([{**inline, "epochs": 1}])
    with pytest.raises(ValueError, match="twice"):
        ravel_sweep.choose_methods([inline, inline])


def test_a_ravel_method_without_a_config_file_runs_its_registry_spec():
    configs = Path("configs/ravel")
    lda, mdas = ravel_sweep.choose_methods(["lda", "mdas"], Path("tests"))  # no config files there
    intervention = lda[1]["init_args"]["intervention"]
    assert intervention == {"class_path": ravel_sweep.DIRECTION_INTERCHANGE, "init_args": {"method": "lda", "k": 8}}
    assert lda[1]["init_args"]["objective"] == ravel_sweep.OBJECTIVE and lda[2] is None
    section, _ = ravel_sweep.method_config(configs, "mdas")  # the registered mdas is what mdas.yaml sets
    spec = mdas[1]["init_args"]
    assert spec["intervention"]["init_args"] == {"k": section["init_args"]["k"]}
    assert [spec[key] for key in ("layer", "lr", "warmup_ratio", "objective")] == [
        section["init_args"][key] for key in ("layer", "lr", "warmup_ratio", "objective")
    ]
    for name in ("mdbm", "pca_features", "full_swap", "sae"):  # each file's intervention and objective
        file = ravel_sweep.method_config(configs, name)[0]["init_args"]
        built = ravel_sweep.choose_methods([name], Path("tests"))[0][1]["init_args"]
        assert built["intervention"] == {"init_args": {}, **file["intervention"]}, name
        assert built["objective"] == file["objective"], name
        assert built.get("lr", 5e-3) == file.get("lr", 5e-3), name
    with pytest.raises(ValueError, match="LDADirection is not an intervention"):
        ravel_sweep.choose_methods([{"name": "x", "model": {"class_path": method_spec("lda").class_path}}])


@pytest.mark.parametrize(
    ("study", "name", "reason"),
    [
        ("causalgym", "fgsm", "needs probe, target, epsilon at each call, which the CausalGym sweep does not give"),
        ("causalgym", "reft_r1", "needs concept_id at each call, which the CausalGym sweep does not give"),
        ("ravel", "ssv", "needs concept_id at each call, which the RAVEL sweep does not give"),
        ("causalgym", "loreft", "is a LightningModule of its own; the CausalGym sweep"),
        ("ravel", "random_sign", "needs epsilon at each call, which the RAVEL sweep does not give"),
        ("ravel", "lora", "is a LightningModule of its own; the RAVEL sweep"),
    ],
)
def test_a_name_of_another_studys_kind_is_one_line_before_any_work(tmp_path, study, name, reason):
    """Every name is in the one registry; a sweep refuses one it cannot run at a site (an attack,
    a concept method, a steering module) by what its class can do, before the LM loads."""
    from tests.helpers import run_command

    done = run_command("sweep", study, f"--methods=[{name}]", f"--out={tmp_path / 'out'}", "--lm=no-such-lm")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: method {name!r} (") and reason in line
    assert not (tmp_path / "out").exists()
