"""Two-process DDP on CPU (gloo): metrics sync across ranks and equal a single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


class DumpMetrics(L.Callback):
    """Rank 0 writes the final logged metrics to $DUMP_METRICS (used by this test's subprocesses)."""

    def _dump(self, trainer):
        if trainer.is_global_zero:
            values = {k: float(v) for k, v in trainer.callback_metrics.items()}
            Path(os.environ["DUMP_METRICS"]).write_text(json.dumps(values))

    def on_validation_end(self, trainer, module):
        self._dump(trainer)

    def on_fit_end(self, trainer, module):
        self._dump(trainer)


CAUSALGYM = (
    "configs/das.yaml",
    "--model.layer=1",
    "--data.train_pairs=16",
    "--data.eval_pairs=7",
    "--data.eval_batch_size=4",
    "--trainer.val_check_interval=1.0",
)


def _run(
    tmp_path,
    name,
    lm_dir,
    subcommand,
    devices,
    *extra,
    setup=CAUSALGYM,
    env=None,
    program=("train.py",),
    lm_option="--model.lm",
):
    out = tmp_path / f"{name}.json"
    config, *options = setup
    args = [
        sys.executable,
        *program,
        *([subcommand] if subcommand else []),
        "--config",
        config,
        *options,
        f"{lm_option}={lm_dir}",
        f"--trainer.default_root_dir={tmp_path / name}",
        "--trainer.accelerator=cpu",
        f"--trainer.devices={devices}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=tests.test_ddp.DumpMetrics",
        *extra,
    ]
    if devices > 1:
        args.append("--trainer.strategy=ddp")
    env = {**os.environ, **(env or {}), "DUMP_METRICS": str(out), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), tmp_path / name


@pytest.mark.slow
def test_ddp_validation_equals_single_process(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("gpt_neox")
    _, fit_dir = _run(tmp_path, "fit", lm_dir, "fit", 2)  # a DDP fit runs, and rank 0 exports
    (checkpoint,) = fit_dir.glob("**/version_0/checkpoints/*.ckpt")
    assert (checkpoint.parents[1] / "intervention.safetensors").is_file()
    single, _ = _run(tmp_path, "single", lm_dir, "validate", 1, f"--ckpt_path={checkpoint}")
    double, _ = _run(tmp_path, "double", lm_dir, "validate", 2, f"--ckpt_path={checkpoint}")
    for name in ("val/odds", "val/iia"):
        assert double[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name


def _fit_then_validate(tmp_path, lm_dir, setup, env=None):
    """A 2-process DDP fit, then its checkpoint validated by 1 and by 2 processes."""
    _, fit_dir = _run(tmp_path, "fit", lm_dir, "fit", 2, setup=setup, env=env)
    (checkpoint,) = fit_dir.glob("**/version_0/checkpoints/*.ckpt")
    single, _ = _run(tmp_path, "single", lm_dir, "validate", 1, f"--ckpt_path={checkpoint}", setup=setup, env=env)
    double, _ = _run(tmp_path, "double", lm_dir, "validate", 2, f"--ckpt_path={checkpoint}", setup=setup, env=env)
    return single, double, checkpoint


@pytest.mark.slow
def test_ddp_ravel_cause_iso_equal_single_process(tmp_path, tiny_lm_dir, monkeypatch):
    """Cause / Iso / Disentangle (and per attribute) under DDP. The data filter's model answers are
    written to the on-disk answer cache first (an oracle that knows every city), so the
    subprocesses read them instead of asking the random tiny model."""
    from lit_interventions.datamodules.ravel import RavelDataModule

    from tests.helpers import oracle

    lm_dir = tiny_lm_dir("llama")
    env = {"LIT_INTERVENTIONS_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", env["LIT_INTERVENTIONS_CACHE"])
    sizes = {"train_size": 24, "eval_size": 11, "max_candidates": 40, "eval_batch_size": 4}
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm_dir).data.entities)))
    RavelDataModule(lm=lm_dir, **sizes).setup()
    setup = (
        "configs/ravel/das.yaml",
        "--model.layer=1",
        "--model.k=4",
        "--trainer.max_epochs=1",
        *(f"--data.{k}={v}" for k, v in sizes.items()),
    )
    single, double, _ = _fit_then_validate(tmp_path, lm_dir, setup, env)
    names = [k for k in single if k.startswith(("val/cause", "val/iso", "val/disentangle", "val/change"))]
    assert {"val/cause", "val/iso", "val/disentangle", "val/iso/Continent", "val/change/Country"} <= set(names)
    for name in names:
        assert double[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name


AXBENCH = ("--data.max_length=96", "--data.concepts=[0, 5, 8]", "--data.eval_batch_size=7", "--trainer.max_epochs=1")


@pytest.mark.slow
def test_ddp_axbench_auroc_equals_single_process(tmp_path, tiny_lm_dir):
    """AUROC (max-pooled, min-max normalised per concept) of a ReFT-r1 dictionary trained under
    DDP, validated by 1 and 2 processes."""
    setup = ("configs/reft_r1.yaml", "--model.layer=1", *AXBENCH)
    single, double, checkpoint = _fit_then_validate(tmp_path, tiny_lm_dir("llama"), setup)
    names = [k for k in single if k.startswith("val/auroc")]
    assert "val/auroc" in names and len(names) == 4, names
    for name in names:
        assert double[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name
    assert (checkpoint.parents[1] / "dictionary.safetensors").is_file()  # rank 0 exported


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup, metric",
    [
        (("configs/loreft.yaml", "--model.layer=1"), "val/loss"),
        (("configs/lora.yaml", "--model.layers=[1]"), "val/loss"),
    ],
    ids=["loreft", "lora"],
)
def test_ddp_axbench_baselines_equal_single_process(tmp_path, tiny_lm_dir, setup, metric):
    """The other AxBench modules under DDP. Concept 0 is absent from some batches, so a process
    sometimes has nothing to train on in a step: it must still take part in the backward."""
    single, double, checkpoint = _fit_then_validate(tmp_path, tiny_lm_dir("llama"), (*setup, *AXBENCH))
    assert double[metric] == pytest.approx(single[metric], rel=1e-5, abs=1e-6)
    assert any(checkpoint.parents[1].glob("*.safetensors"))  # rank 0 exported


@pytest.mark.slow
def test_ddp_closed_form_fit_equals_single_process(tmp_path, tiny_lm_dir):
    """A closed-form direction (DiffMean) fitted under DDP, from the tokens of both processes,
    equals the single-process fit. (Closed-form fits take no optimizer step, so Lightning writes
    no checkpoint: the fits themselves are compared.)"""
    setup = ("configs/diffmean.yaml", "--model.layer=1", *AXBENCH)
    single, single_dir = _run(tmp_path, "single", tiny_lm_dir("llama"), "fit", 1, setup=setup)
    double, double_dir = _run(tmp_path, "double", tiny_lm_dir("llama"), "fit", 2, setup=setup)
    assert double["val/auroc"] == pytest.approx(single["val/auroc"], rel=1e-5, abs=1e-6)
    (one,), (two,) = single_dir.glob("**/dictionary.safetensors"), double_dir.glob("**/dictionary.safetensors")
    one, two = load_file(one)["vectors"], load_file(two)["vectors"]
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_ddp_sae_validation_equals_single_process(tmp_path, tiny_lm_dir):
    """The SAE featurizer fitted by 2 processes: its last logged (synced) validation metrics equal a
    single-process validation of its checkpoint."""
    from lit_interventions.datamodules.activations import RavelActivationsDataModule

    from lit_interventions.modules.sae import SAEModule

    lm_dir = tiny_lm_dir("gpt2")
    sizes = {"layer": 1, "max_prompts": 32, "batch_size": 8}
    setup = ("configs/sae.yaml", *(f"--data.{k}={v}" for k, v in sizes.items()), "--trainer.max_epochs=2")
    double, fit_dir = _run(
        tmp_path,
        "fit",
        lm_dir,
        "fit",
        2,
        setup=setup,
        program=("-m", "lit_interventions"),
        lm_option="--data.lm",
    )
    (checkpoint,) = fit_dir.glob("**/version_0/checkpoints/*.ckpt")
    assert (checkpoint.parents[1] / "sae.safetensors").is_file()  # rank 0 exported
    data = RavelActivationsDataModule(lm=lm_dir, **sizes)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (single,) = trainer.validate(SAEModule.load_from_checkpoint(checkpoint), datamodule=data, verbose=False)
    names = [k for k in single if k.startswith("val/")]
    assert {"val/mse", "val/fvu"} <= set(names), names
    for name in names:
        assert double[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name
