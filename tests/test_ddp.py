"""Two-process DDP on CPU (gloo): metrics sync across ranks and equal a single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

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


def _run(tmp_path, name, lm_dir, subcommand, devices, *extra):
    out = tmp_path / f"{name}.json"
    args = [sys.executable, "train.py", subcommand, "--config", "configs/das.yaml", f"--model.lm={lm_dir}",
            "--model.layer=1", f"--trainer.default_root_dir={tmp_path / name}", "--data.train_pairs=16",
            "--data.eval_pairs=7", "--data.eval_batch_size=4", "--trainer.accelerator=cpu",
            f"--trainer.devices={devices}", "--trainer.val_check_interval=1.0", "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=tests.test_ddp.DumpMetrics", *extra]  # fmt: skip
    if devices > 1:
        args.append("--trainer.strategy=ddp")
    env = {**os.environ, "DUMP_METRICS": str(out), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), tmp_path / name


@pytest.mark.slow
def test_ddp_validation_equals_single_process(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("gpt_neox")
    _, fit_dir = _run(tmp_path, "fit", lm_dir, "fit", 2)  # a DDP fit runs, and rank 0 exports
    (checkpoint,) = fit_dir.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert (checkpoint.parents[1] / "intervention.safetensors").is_file()
    single, _ = _run(tmp_path, "single", lm_dir, "validate", 1, f"--ckpt_path={checkpoint}")
    double, _ = _run(tmp_path, "double", lm_dir, "validate", 2, f"--ckpt_path={checkpoint}")
    for name in ("val/odds", "val/iia"):
        assert double[name] == pytest.approx(single[name], rel=1e-5, abs=1e-6), name
