"""Sweeps under torchrun: 2 processes on CPU (gloo) write the files one process writes, and
resume what an interrupted run left, whatever its world size."""

import csv
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lit_interventions import distributed
from lit_interventions.sweep import sweep_units

ROOT = Path(__file__).resolve().parents[1]
TASKS = "[agr_gender, agr_sv_num_pp]"


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _launch(tmp_path, nproc, *args, env=None):
    """`python -m lit_interventions.sweep ARGS` under torchrun with `nproc` processes (as test_ddp
    runs its DDP fits: a subprocess from the repository root)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "lit_interventions.sweep", *args]  # fmt: skip
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


def _causalgym(lm_dir, out, tasks=TASKS):
    return ["--config", "configs/sweep_causalgym.yaml", f"--lm={lm_dir}", f"--tasks={tasks}",
            "--methods=[das, diffmean, vanilla]", "--layers=[0, 2]", "--train_pairs=8", "--eval_pairs=4", f"--out={out}"]  # fmt: skip


def test_units_and_shards():
    assert sweep_units(["a", "b"], [0, 1, 2]) == [("a", (0, 1, 2)), ("b", (0, 1, 2))]
    assert sweep_units(["a"], [0, 1, 2], layers_per_unit=2) == [("a", (0, 1)), ("a", (2,))]
    with pytest.raises(ValueError, match=r"layers_per_unit=0 must be a positive integer"):
        sweep_units(["a"], [0], layers_per_unit=0)
    ranks = [distributed.Ranks(rank, 3) for rank in range(3)]
    assert [r.shard(list("abcdefg")) for r in ranks] == [list("adg"), list("be"), list("cf")]
    assert distributed.detect() == distributed.Ranks()  # pytest itself: rank 0 of 1


def test_ranks_from_torchrun_and_slurm(monkeypatch):
    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                        "SLURM_JOB_NAME": "sweep", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    ranks = distributed.detect()
    assert (ranks.rank, ranks.world_size, ranks.local_rank) == (5, 8, 1)
    assert ranks.environment.main_address == "gpu07"
    torchrun = {"RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
                "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}  # fmt: skip
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    ranks = distributed.detect()  # torchrun inside a SLURM allocation: torchrun's ranks
    assert (ranks.rank, ranks.world_size, ranks.local_rank) == (3, 4, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert distributed.pin_device(ranks) == "5" and os.environ["CUDA_VISIBLE_DEVICES"] == "5"


def test_causalgym_two_ranks_equal_one_process_and_resume(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _launch(tmp_path, 1, *_causalgym(lm_dir, one))
    _launch(tmp_path, 2, *_causalgym(lm_dir, two))
    for name in ("results.csv", "summary.csv"):
        assert _rows(two / name) == _rows(one / name), name  # same rows, same order, same numbers
    assert {r["task"] for r in _rows(two / "results.csv")} == {"agr_gender", "agr_sv_num_pp"}
    assert sorted(p.name for p in (two / "heatmaps").iterdir()) == sorted(p.name for p in (one / "heatmaps").iterdir())
    assert not (two / "ranks").exists()  # merged, then removed

    # Interrupted: rank 1 of an earlier run finished agr_gender (its odds marked 123) and nothing else.
    _launch(tmp_path, 1, *_causalgym(lm_dir, resumed, tasks="[agr_gender]"))
    with sqlite3.connect(resumed / "results.sqlite") as db:
        db.execute("UPDATE results SET odds = '123.0'")
    db.close()
    (resumed / "ranks" / "rank-1").mkdir(parents=True)
    (resumed / "results.sqlite").rename(resumed / "ranks" / "rank-1" / "results.sqlite")
    (resumed / "results.csv").unlink()
    _launch(tmp_path, 2, *_causalgym(lm_dir, resumed))
    rows = _rows(resumed / "results.csv")
    gender = [r for r in rows if r["task"] == "agr_gender"]
    assert gender and all(r["odds"] == "123.0" for r in gender)  # not recomputed
    assert [r for r in rows if r["task"] == "agr_sv_num_pp"] == [r for r in _rows(one / "results.csv") if r["task"] == "agr_sv_num_pp"]
    assert not (resumed / "ranks").exists()


def test_an_out_dir_of_another_config_stops_every_rank(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    out = tmp_path / "out"
    _launch(tmp_path, 1, *_causalgym(lm_dir, out, tasks="[agr_gender]")[:-3], "--methods=[vanilla]", "--layers=[0]",
            "--train_pairs=8", "--eval_pairs=4", f"--out={out}")  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "lit_interventions.sweep", *_causalgym(lm_dir, out, tasks="[agr_gender]"), "--train_pairs=6"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.count("differs in train_pairs (8 there, 6 here)") == 2  # both ranks say it, before any work
    assert not (out / "ranks").exists() and len(_rows(out / "results.csv")) == 4
