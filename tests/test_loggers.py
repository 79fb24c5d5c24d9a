"""Loggers beside the default TensorBoard one: CSV (for scripts) and Weights & Biases (offline).

Each runs a tiny fit through `train.main`, like tests/test_training.py; the W&B test writes an
offline run under tmp_path (WANDB_MODE=offline: nothing is sent) and is skipped when wandb is
not installed (`pip install 'lit-interventions[wandb]'`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import train


def _fit(tmp_path, lm_dir, *extra):
    args = [
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={lm_dir}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        "--trainer.val_check_interval=1.0",
        "--trainer.enable_progress_bar=false",
        "--trainer.max_epochs=2",
        "--trainer.log_every_n_steps=1",
        *extra,
    ]
    return train.main(args=args)


def test_csv_logger_writes_metrics_csv_and_the_artifact(tmp_path, tiny_lm_dir):
    from lightning.pytorch.loggers import CSVLogger

    from lit_interventions.artifacts.pretrained import from_pretrained

    cli = _fit(
        tmp_path,
        tiny_lm_dir("gpt_neox"),
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={tmp_path / 'csv'}",
        "--trainer.logger.name=das",
    )
    logger = cli.trainer.logger
    assert isinstance(logger, CSVLogger)  # the CLI kept the logger given, no TensorBoard one added
    assert len(cli.trainer.loggers) == 1
    log_dir = Path(logger.log_dir)
    assert log_dir.parent == tmp_path / "csv" / "das" and not list(tmp_path.rglob("events.out.tfevents.*"))
    with (log_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    train_loss = [r["train/loss"] for r in rows if r.get("train/loss")]
    val_odds = [r["val/odds"] for r in rows if r.get("val/odds")]
    assert train_loss and len(val_odds) == 2 and all(float(v) == float(v) for v in train_loss + val_odds)
    # the exported artifact sits beside metrics.csv, in the hub layout, and loads back
    assert cli.trainer.log_dir == str(log_dir)
    for name in ("hparams.yaml", "intervention.safetensors", "config.json", "README.md"):
        assert (log_dir / name).is_file(), name
    assert not (log_dir / "intervention.json").exists()  # one card per run
    config = json.loads((log_dir / "config.json").read_text())
    assert config["layer"] == 1 and config["metrics"]["val/odds"] == pytest.approx(float(val_odds[-1]), rel=1e-4)
    assert config["command"].startswith("lit-interventions fit --config ") and config["command"].endswith("config.yaml")
    assert "## Command" in (log_dir / "README.md").read_text()
    restored = from_pretrained(log_dir)
    assert type(restored) is type(cli.model.intervention)


def test_wandb_logger_offline(tmp_path, tiny_lm_dir, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed: pip install 'lit-interventions[wandb]'")
    from lightning.pytorch.loggers import WandbLogger

    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    save_dir = tmp_path / "wandb-runs"
    save_dir.mkdir()
    try:
        cli = _fit(
            tmp_path,
            tiny_lm_dir("gpt_neox"),
            "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
            "--trainer.logger.offline=true",
            "--trainer.logger.project=lit-interventions",
            f"--trainer.logger.save_dir={save_dir}",
            "--trainer.logger.name=das-tiny",
        )
        assert isinstance(cli.trainer.logger, WandbLogger) and len(cli.trainer.loggers) == 1
        run = cli.trainer.logger.experiment
        assert run.offline and run.name == "das-tiny"
        assert run.summary["val/odds"] == pytest.approx(float(cli.trainer.callback_metrics["val/odds"]))
        assert "train/loss" in set(run.summary.keys())
    finally:
        wandb.finish()
    (offline,) = (save_dir / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))  # the run, ready for `wandb sync`
    # the artifact goes to the run's own directory (where Lightning puts its checkpoints), not into
    # the save_dir every W&B run shares (Lightning's trainer.log_dir), in the hub layout
    run_dir = save_dir / "lit-interventions" / run.id
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    for name in ("intervention.safetensors", "config.json", "README.md"):
        assert (run_dir / name).is_file(), name
    assert not (save_dir / "config.json").exists() and not (save_dir / "README.md").exists()
