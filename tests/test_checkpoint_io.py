"""Checkpoints are whole or absent: a write that fails (a full disk) leaves the previous
checkpoint under its name and no temporary file; every Lightning run writes through it."""

from __future__ import annotations

import errno

import pytest
import torch

from lit_interventions.artifacts import checkpoint_io
from lit_interventions.artifacts.checkpoint_io import AtomicCheckpointIO
from lit_interventions.cli.commands import run


def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(1)}, path)
    real_save = torch.save

    def disk_full(obj, file):  # half a checkpoint, then no space left
        real_save(obj, file)
        with open(file, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_io.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_every_lightning_run_writes_its_checkpoints_through_it(tmp_path, tiny_lm_dir):
    cli = run(
        [
            "fit",
            "--config",
            "das.yaml",
            f"--model.lm={tiny_lm_dir('gpt2')}",
            "--model.layer=1",
            "--data.train_pairs=12",
            "--data.eval_pairs=4",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    (checkpoint,) = tmp_path.glob("**/checkpoints/*.ckpt")
    assert torch.load(checkpoint, weights_only=True)["state_dict"]
