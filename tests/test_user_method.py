"""A user's methods, in a file of their own (`tests/user_methods.py`), run from YAML alone: one
interchange (`Line`) and one source-free edit (`Reflection`), in `train.py fit` on CausalGym
(the console script) and RAVEL, and in both sweeps; a direction estimator (`PositiveMean`) in
AxBench detection. Every module and study reaches an
intervention through one call, `capabilities.intervene`, which gives a source-free one no source
and reads no source forward for it."""

import json

import lightning as L
import pytest
import torch
import yaml
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from lit_interventions.datamodules.ravel import RavelDataModule
from safetensors.torch import load_file
from torch import nn

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.cli.lightning import train_main
from lit_interventions.core.forward import read_layers
from lit_interventions.core.lm import load_lm
from lit_interventions.interventions.capabilities import intervene, is_source_free, needs_source
from lit_interventions.interventions.compose import Composition
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.modules.multisite import MultiSiteInterchangeModule
from lit_interventions.objectives import Objective
from lit_interventions.studies import causalgym_sweep, ravel_sweep
from lit_interventions.studies.causalgym_tasks import _region_data
from tests.helpers import ROOT, csv_rows, run_command
from tests.test_axbench_seam import _concept_dir
from tests.test_ravel_data import oracle
from tests.user_methods import AwayFromBase, Line, Reflection

TASK = "agr_sv_num_pp"
SIZES = {"train_pairs": 10, "eval_pairs": 4, "seed": 0}
REGIONS = ["The", "subject", "prep", "the", "object"]


class Spy(nn.Module):
    """Records what forward was given."""

    def __init__(self, source_free: bool):
        super().__init__()
        self.edits_base_alone, self.given = source_free, []

    def forward(self, base, source=None, **context):
        self.given.append((source, context))
        return base + 1


def test_intervene_gives_a_source_free_intervention_no_source_and_requires_one_of_an_interchange():
    base, source = torch.zeros(2, 4), torch.ones(2, 4)
    free, interchange = Spy(True), Spy(False)
    assert torch.equal(intervene(free, base, source, factor=2.0), base + 1)
    assert free.given == [(None, {"factor": 2.0})]
    intervene(interchange, base, source)
    assert interchange.given[0][0] is source
    with pytest.raises(ValueError, match="Spy is an interchange intervention: .* needs the source state"):
        intervene(interchange, base)
    assert needs_source(Line(4)) and not needs_source(Reflection(4)) and not needs_source(free)
    assert is_source_free(Composition([Reflection(4), Reflection(4)]))
    assert not is_source_free(Composition([Reflection(4), Line(4)]))


def test_reflection_formula_by_hand():
    reflection = Reflection(3)
    with torch.no_grad():
        reflection.v.copy_(torch.tensor([0.0, 3.0, 4.0]))  # u = (0, 0.6, 0.8)
    h = torch.tensor([[1.0, 1.0, 2.0]])  # u·h = 2.2
    assert torch.allclose(reflection(h), torch.tensor([[1.0, 1.0 - 2.64, 2.0 - 3.52]]))
    with pytest.raises(ValueError, match="edits base alone"):
        reflection(h, h)


def _module(lm_dir, cache, intervention=Reflection):
    torch.manual_seed(0)
    return InterchangeModule(lm=lm_dir, layer=1, intervention=intervention, cache=cache)


@pytest.mark.parametrize("cache", [True, False])
def test_a_source_free_intervention_reads_no_source_and_edits_the_base_at_its_site(tiny_lm_dir, cache, monkeypatch):
    lm_dir = tiny_lm_dir("llama")
    data = CausalGymDataModule(task=TASK, lm=lm_dir, train_pairs=6, eval_pairs=4, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    module = _module(lm_dir, cache)
    if cache:
        module.prefill(data.val_dataloader())
    read = []
    site_representation = type(module).site_representation
    monkeypatch.setattr(
        type(module),
        "site_representation",
        lambda self, b, side="source": read.append(side) or site_representation(self, b, side),
    )
    logits = module.intervened_logits(batch)
    assert "source" not in read
    # by hand: the block's output at each base's site position reflected, then the LM to the end
    u = module.intervention.v.detach() / module.intervention.v.detach().norm()
    rows = torch.arange(len(batch))

    def hook(_, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        h = hidden[rows, batch.base.pos]
        hidden[rows, batch.base.pos] = h - 2 * (h @ u)[:, None] * u
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    lm = module.lm
    handle = lm.model.layers[1].register_forward_hook(hook)
    try:
        expected = lm(batch.base.input_ids, attention_mask=batch.base.attention_mask).logits[rows, batch.base.last]
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    clean = module.clean_logits(batch)
    assert not torch.allclose(logits, clean, atol=1e-3)  # the edit acts


def test_a_composition_reads_the_source_only_for_its_interchange_parts(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    data = CausalGymDataModule(task=TASK, lm=lm_dir, train_pairs=6, eval_pairs=4, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    sites = [{"layer": 0, "position": "region", "region": "subject"}, {"layer": 1, "position": "last"}]
    torch.manual_seed(0)
    mixed = InterchangeModule(lm=lm_dir, sites=sites, intervention=Reflection)
    mixed.intervention.parts[1] = RotatedSpaceIntervention(mixed.intervention.parts[1].v.shape[0])
    logits = mixed.intervened_logits(batch)  # a source-free part and DAS: no ValueError, one forward
    assert logits.shape == (len(batch), mixed.lm.config.vocab_size) and torch.isfinite(logits).all()


def _model_section(intervention: dict, lr: float = 0.02, **init_args) -> dict:
    """train.py's model section that trains `intervention` (InterchangeModule), a sweep's method."""
    init_args = {"intervention": intervention, "lr": lr, **init_args}
    return {"class_path": "lit_interventions.modules.interchange.InterchangeModule", "init_args": init_args}


def _user_yaml(tmp_path, base_config: str, method: str, **init_args) -> str:
    """`base_config` with its intervention replaced by the user's class, as a user writes it."""
    config = yaml.safe_load((ROOT / base_config).read_text())
    config["model"]["init_args"].pop("k", None)
    config["model"]["init_args"]["intervention"] = {
        "class_path": f"tests.user_methods.{method}",
        "init_args": init_args,
    }
    path = tmp_path / f"{method.lower()}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("method", ["Reflection", "Line"])
def test_train_py_fits_the_users_method_on_causalgym_from_yaml_alone(tmp_path, tiny_lm_dir, method):
    config = _user_yaml(tmp_path, "configs/das.yaml", method, scale=0.5)
    fit = run_command(
        "train.py", "fit", "--config", config, f"--model.lm={tiny_lm_dir('gpt2')}", "--model.layer=1",
        "--data.train_pairs=12", "--data.eval_pairs=4", "--trainer.val_check_interval=1.0",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "val/odds" in fit.stdout + fit.stderr
    run = tmp_path / TASK / "layer1" / "version_0"
    assert json.loads((run / "config.json").read_text())["class_path"] == f"tests.user_methods.{method}"
    trained = load_file(run / "intervention.safetensors")["v"]
    torch.manual_seed(0)  # seed_everything: 0, as the run built it
    assert not torch.equal(trained, 0.5 * torch.randn(trained.shape[0]))  # the optimiser moved it


def test_the_users_source_free_method_fits_on_ravel(tmp_path, tiny_lm_dir, monkeypatch):

    lm = tiny_lm_dir("llama")
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    config = _user_yaml(tmp_path, "configs/ravel/das.yaml", "Reflection")
    cli = train_main(
        [
            "fit", "--config", config, f"--model.lm={lm}", "--model.layer=1", "--data.train_size=16",
            "--data.eval_size=12", "--data.max_candidates=40", "--trainer.max_epochs=1",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        ],
    )  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert {"val/cause", "val/iso"} <= set(metrics), sorted(metrics)
    assert isinstance(cli.model.intervention, Reflection)


def test_both_methods_run_in_the_causalgym_sweep_and_both_scoring_paths_agree(tmp_path, tiny_lm_dir):
    methods = [
        {
            "name": "line",
            "model": _model_section({"class_path": "tests.user_methods.Line", "init_args": {"scale": 0.5}}),
        },
        {"name": "reflection", "model": _model_section({"class_path": "tests.user_methods.Reflection"})},
    ]
    rows = {}
    for stacked in (True, False):
        out = tmp_path / f"stacked_{stacked}"
        config = {
            "tasks": TASK, "methods": methods, "layers": [1], "lm": tiny_lm_dir("llama"), "out": str(out),
            "train_pairs": 10, "eval_pairs": 4, "stacked_scoring": stacked,
        }  # fmt: skip
        (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(config))
        causalgym_sweep.main(["--config", str(tmp_path / "sweep.yaml")])
        rows[stacked] = {(r["method"], r["region"]): (r["odds"], r["iia"]) for r in csv_rows(out / "results.csv")}
    assert sorted(rows[True]) == sorted((m, r) for m in ("line", "reflection") for r in REGIONS)
    for key, (odds, iia) in rows[True].items():  # the stacked forward and the module's score: one dispatch
        assert float(odds) == pytest.approx(float(rows[False][key][0]), rel=1e-4, abs=1e-5), key
        assert float(iia) == pytest.approx(float(rows[False][key][1]), abs=1e-6), key
    assert float(rows[True][("line", "The")][0]) == 0.0  # an interchange before the pairs differ: no change
    assert float(rows[True][("reflection", "The")][0]) != 0.0  # a source-free edit acts everywhere


def test_the_users_source_free_method_runs_in_the_ravel_sweep(tmp_path, tiny_lm_dir, monkeypatch):
    lm = tiny_lm_dir("llama")
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    section = yaml.safe_load((ROOT / _user_yaml(tmp_path, "configs/ravel/das.yaml", "Reflection")).read_text())
    methods = [{"name": "reflection", "model": section["model"]}, "full_swap"]  # --epochs: 1
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(methods))
    ravel_sweep.main(
        [
            "--config", "configs/sweep_ravel.yaml", f"--lm={lm}", "--layer=1", "--train_size=16", "--eval_size=12",
            "--max_candidates=40", "--attributes=[Country]", f"--out={tmp_path / 'out'}",
            f"--methods={json.dumps(methods)}",
        ]
    )  # fmt: skip
    rows = csv_rows(tmp_path / "out" / "summary.csv")
    assert {row["method"] for row in rows} == {"reflection", "full_swap"}


def test_the_projects_loreft_fits_on_causalgym_from_its_config(tmp_path, tiny_lm_dir):
    fit = run_command(
        "train.py", "fit", "--config", "configs/loreft_causalgym.yaml", f"--model.lm={tiny_lm_dir('gpt2')}",
        "--model.layer=1", "--data.train_pairs=12", "--data.eval_pairs=4", "--trainer.val_check_interval=1.0",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = tmp_path / TASK / "layer1" / "version_0"
    config = json.loads((run / "config.json").read_text())
    assert config["class_path"] == "lit_interventions.interventions.loreft.LoReFTIntervention"
    assert sorted(load_file(run / "intervention.safetensors")) == ["bias", "rotation", "weight"]


def _trained_alone_and_together(lm_dir, objective, datas):
    """{(layer, region): v} of `Line` trained on `datas` in one grid loop, and each site alone."""
    trainer = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer |= dict(enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    runs = {}
    for grid in [list(datas), *([site] for site in datas)]:
        module = MultiSiteInterchangeModule(
            lm=lm_dir, grid=grid, lr=0.05, seed=3, intervention=Line, objective=objective
        )
        L.Trainer(**trainer).fit(module.attach({site: datas[site] for site in grid}))
        runs[tuple(grid)] = {site: f.v.detach().clone() for site, f in module.trained().items()}
    return runs[tuple(datas)], {site: runs[(site,)][site] for site in datas}


def test_the_grid_module_trains_on_the_users_objective_as_each_site_alone(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    datas = {(layer, "subject"): _region_data(TASK, None, lm_dir, "subject", None, SIZES) for layer in (0, 1)}
    together, alone = _trained_alone_and_together(lm_dir, AwayFromBase(), datas)
    for site in datas:
        torch.testing.assert_close(together[site], alone[site], rtol=1e-4, atol=1e-5)
    usual, _ = _trained_alone_and_together(lm_dir, None, {(1, "subject"): datas[(1, "subject")]})
    assert not torch.allclose(usual[(1, "subject")], together[(1, "subject")], atol=1e-4)  # the objective is used


def test_the_grid_refuses_an_objective_without_row_losses_and_the_sweep_one_that_needs_iso_pairs(tmp_path, tiny_lm_dir):
    class Whole(Objective):
        def task_loss(self, logits, batch):
            return logits.mean()

    with pytest.raises(ValueError, match="defines row_losses"):
        MultiSiteInterchangeModule(lm=tiny_lm_dir("llama"), layer=1, regions=["subject"], objective=Whole())
    das = {"class_path": "lit_interventions.interventions.rotation.RotatedSpaceIntervention"}
    iso = {"class_path": "lit_interventions.objectives.CauseIsoLoss", "init_args": {"multitask": True}}
    mdas = {"name": "mdas", "model": _model_section(das, objective=iso)}
    with pytest.raises(ValueError, match="method 'mdas': objective CauseIsoLoss.* trains on Iso pairs"):
        causalgym_sweep.run_sweep(methods=[mdas], lm=tiny_lm_dir("llama"), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_users_source_free_method_trained_by_train_py_is_scored_by_steer(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    config = _user_yaml(tmp_path, "configs/das.yaml", "Reflection")
    fit = run_command(
        "train.py", "fit", "--config", config, f"--model.lm={lm}", "--model.layer=1", "--data.train_pairs=12",
        "--data.eval_pairs=4", f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = str(tmp_path / TASK / "layer1" / "version_0")
    (tmp_path / "instructions.json").write_text(json.dumps(["Tell me about rivers.", "Write a short poem."]))
    out = tmp_path / "steer"
    steer = [
        "steer", "--artifact", run, "--instruction_file", str(tmp_path / "instructions.json"), "--out", str(out),
        "--factors=[0.0, 1.0]", "--instructions=2", "--max_new_tokens=4", "--batch_size=2", "--temperature=0.0",
        "--judge", json.dumps({"backend": "local", "lm": lm, "max_new_tokens": 3}),
    ]  # fmt: skip
    refused = run_command(*steer)  # its class is the user's: imported only when they trust it
    assert refused.returncode == 2 and "tests.user_methods.Reflection" in refused.stderr
    assert "trust_remote_code" in refused.stderr and not out.exists()
    unnamed = run_command(*steer, "--trust_remote_code=true")  # trained on CausalGym: no concept of its own
    assert (
        unnamed.returncode == 2 and "names no concept to steer toward; give the one it is judged on" in unnamed.stderr
    )
    done = run_command(*steer, "--trust_remote_code=true", "--concepts=rivers")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert sorted({(r["concept"], r["factor"]) for r in rows}) == [("rivers", 0.0), ("rivers", 1.0)]
    by_factor = {f: [r["response"] for r in rows if r["factor"] == f] for f in (0.0, 1.0)}
    assert by_factor[0.0] != by_factor[1.0]  # the reflection changes what is generated


def test_train_py_fits_the_users_direction_estimator_per_concept_in_axbench(tmp_path, tiny_lm_dir):
    """`PositiveMean` is unsupervised, so each concept's row is fitted on its positive response tokens
    alone and oriented by the negative pool: w_c = ±mean(H⁺_c)/‖mean(H⁺_c)‖, the sign that makes
    mean(H⁺_c)·w ≥ mean(H⁻)·w. The exported rows are recomputed here from the LM's states."""
    lm, concepts = tiny_lm_dir("llama"), _concept_dir(tmp_path)
    config = yaml.safe_load((ROOT / "configs/diffmean.yaml").read_text())
    config["model"]["init_args"].update(lm=lm, layer=1, method={"class_path": "tests.user_methods.PositiveMean"})
    config["data"]["init_args"].update(lm=lm, concept_dir=str(concepts), max_length=64, batch_size=4)
    config["trainer"].update(default_root_dir=str(tmp_path / "run"), accelerator="cpu", enable_progress_bar=False)
    (tmp_path / "positive_mean.yaml").write_text(yaml.safe_dump(config))
    fit = run_command("train.py", "fit", "--config", str(tmp_path / "positive_mean.yaml"))
    assert fit.returncode == 0, fit.stderr[-3000:]
    (weights,) = (tmp_path / "run").glob("**/dictionary.safetensors")
    exported = Dictionary.load(weights)
    assert (exported.method, exported.latent, exported.vectors.shape) == ("PositiveMean", "linear", (2, 32))
    data = AxBenchDataModule(lm=lm, concept_dir=str(concepts), max_length=64, batch_size=4)
    data.setup("fit")
    model, states, labels = load_lm(lm), [], []
    with torch.no_grad():
        for batch in data.train_dataloader():
            hidden = read_layers(model, [1], batch["input_ids"], batch["attention_mask"])[1]
            text = batch["output_mask"].bool()
            label = torch.where(batch["label"][:, None] == 0, -1, batch["token_labels"])  # a negative's tokens: -1
            states.append(hidden[text].double()), labels.append(label[text])
    states, labels = torch.cat(states), torch.cat(labels)
    negatives = states[labels == -1].mean(0)
    for c in range(2):
        positives = states[labels == c].mean(0)
        w = positives / positives.norm()
        w = w if w @ (positives - negatives) >= 0 else -w
        torch.testing.assert_close(exported.vectors[c], w.float(), atol=1e-5, rtol=0)
    assert set(exported.auroc["per_concept"]) == set(exported.concepts)
