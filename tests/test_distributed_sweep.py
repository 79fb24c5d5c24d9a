"""Sweeps under torchrun: 2 processes on CPU (gloo) write the files one process writes, and
resume what an interrupted run left, whatever its world size."""

import csv
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies import distributed
from lit_interventions.studies.causalgym_sweep import sweep_units

ROOT = Path(__file__).resolve().parents[1]
TASKS = "[agr_gender, agr_sv_num_pp]"


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _launch(tmp_path, nproc, *args, env=None, benchmark="causalgym"):
    """`lit-interventions sweep BENCHMARK ARGS` under torchrun with `nproc` processes (as test_ddp
    runs its DDP fits: a subprocess from the repository root)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "lit_interventions",
        "sweep",
        benchmark,
        *args,
    ]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(f"torchrun --nproc_per_node={nproc}: {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


CAUSALGYM = dict(
    tasks=["agr_gender", "agr_sv_num_pp"],
    methods=["das", "diffmean", "vanilla"],
    layers=[1],
    train_pairs=8,
    eval_pairs=4,
)


def _causalgym(lm_dir, out, **changes):
    """The command-line options of `run_sweep(**CAUSALGYM, **changes)`."""
    options = {**CAUSALGYM, "lm": lm_dir, "out": out, **changes}
    return [
        "--config",
        "configs/sweep_causalgym.yaml",
        *(f"--{k}=[{', '.join(map(str, v))}]" if isinstance(v, list) else f"--{k}={v}" for k, v in options.items()),
    ]


@pytest.fixture
def one_thread():
    """torch on one thread, as each torchrun process (OMP_NUM_THREADS=1): the same sums in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _as_if_rank_left_it(out, rank):
    """Move DIR's store into DIR/ranks/rank-R, as rank R of an interrupted run leaves it."""
    (out / "ranks" / f"rank-{rank}").mkdir(parents=True)
    (out / "results.sqlite").rename(out / "ranks" / f"rank-{rank}" / "results.sqlite")
    for csv_file in out.glob("*.csv"):
        csv_file.unlink()


def test_units_and_shards():
    assert sweep_units(["a", "b"], [0, 1, 2]) == [("a", (0, 1, 2)), ("b", (0, 1, 2))]
    assert sweep_units(["a"], [0, 1, 2], layers_per_unit=2) == [("a", (0, 1)), ("a", (2,))]
    with pytest.raises(ValueError, match=r"layers_per_unit=0 must be a positive integer"):
        sweep_units(["a"], [0], layers_per_unit=0)
    assert list(distributed.Ranks().take(list("cab"), cost=ord, queue="q")) == list("cab")  # alone: all, in order
    assert distributed.detect() == distributed.Ranks()  # pytest itself: rank 0 of 1


def test_a_free_rank_takes_the_next_unit_costliest_first():
    """Two ranks on one store: whichever asks next gets the costliest unit left; each unit once."""
    import torch.distributed as dist

    store = dist.HashStore()
    sites = {"a": 90, "b": 306, "c": 126, "d": 144, "e": 126}
    zero, one = (
        distributed.Ranks(rank, 2, _store=store).take(list(sites), cost=sites.get, queue="q") for rank in (0, 1)
    )
    assert (next(zero), next(one)) == ("b", "d")
    assert (next(one), next(one)) == (
        "c",
        "e",
    )  # rank 0 still busy with b: rank 1 goes on (c before e: ties keep order)
    assert next(zero) == "a" and next(zero, None) is None and next(one, None) is None
    again = distributed.Ranks(0, 2, _store=store).take(list(sites), cost=sites.get, queue="another run")
    assert next(again) == "b"  # every run has its own queue


def test_ranks_from_torchrun_and_slurm(monkeypatch):
    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NAME": "sweep",
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "1234",
    }.items():
        monkeypatch.setenv(name, value)
    ranks = distributed.detect()
    assert (ranks.rank, ranks.world_size, ranks.local_rank) == (5, 8, 1)
    assert ranks.environment.main_address == "gpu07"
    torchrun = {
        "RANK": "3",
        "GROUP_RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "TORCHELASTIC_RUN_ID": "x",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    ranks = distributed.detect()  # torchrun inside a SLURM allocation: torchrun's ranks
    assert (ranks.rank, ranks.world_size, ranks.local_rank) == (3, 4, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert distributed.pin_device(ranks) == "5" and os.environ["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.mark.slow
def test_causalgym_two_ranks_equal_one_process(tmp_path, tiny_lm_dir, one_thread):
    lm_dir = tiny_lm_dir("llama")
    one, two = tmp_path / "one", tmp_path / "two"
    sweep.run_sweep(**CAUSALGYM, lm=lm_dir, out=str(one))
    _launch(tmp_path, 2, *_causalgym(lm_dir, two))
    for name in ("results.csv", "summary.csv"):
        assert _rows(two / name) == _rows(one / name), name  # same rows, same order, same numbers
    assert {r["task"] for r in _rows(two / "results.csv")} == {"agr_gender", "agr_sv_num_pp"}
    assert sorted(p.name for p in (two / "heatmaps").iterdir()) == sorted(p.name for p in (one / "heatmaps").iterdir())
    assert sorted(p.name for p in (two / "das").iterdir()) == [
        "agr_gender_1.safetensors",
        "agr_sv_num_pp_1.safetensors",
    ]
    assert not (two / "ranks").exists()  # merged, then removed


@pytest.mark.slow
def test_causalgym_resumes_what_a_rank_left(tmp_path, tiny_lm_dir, one_thread):
    """Rank 1 of an interrupted run finished agr_gender (its odds marked 123 here); a 2-process rerun
    merges it and does only agr_sv_num_pp, which one rank takes while the other has nothing to do."""
    lm_dir = tiny_lm_dir("llama")
    out = tmp_path / "out"
    options = {**CAUSALGYM, "methods": ["diffmean", "vanilla"]}
    sweep.run_sweep(**{**options, "tasks": ["agr_sv_num_pp"]}, lm=lm_dir, out=str(tmp_path / "reference"))
    sweep.run_sweep(**{**options, "tasks": ["agr_gender"]}, lm=lm_dir, out=str(out))
    with sqlite3.connect(out / "results.sqlite") as db:
        db.execute("UPDATE results SET odds = '123.0'")
    db.close()
    _as_if_rank_left_it(out, 1)
    done = _launch(tmp_path, 2, *_causalgym(lm_dir, out, methods=options["methods"]))
    assert "2 ranks for 1 units of work left: 1 ranks have nothing to do (--layers_per_unit" in done.stderr
    rows = _rows(out / "results.csv")
    assert [r["task"] for r in rows] == ["agr_gender"] * 8 + ["agr_sv_num_pp"] * 10
    assert all(r["odds"] == "123.0" for r in rows[:8])  # not recomputed
    assert rows[8:] == _rows(tmp_path / "reference" / "results.csv")
    assert [line["overall_odds"] for line in _rows(out / "summary.csv")][:2] == ["123.0", "123.0"]
    assert not (out / "ranks").exists()


@pytest.mark.slow
def test_an_out_dir_of_another_config_stops_every_rank_before_any_work(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    out = tmp_path / "out"
    sweep.run_sweep(**{**CAUSALGYM, "methods": ["vanilla"], "tasks": ["agr_gender"]}, lm=lm_dir, out=str(out))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "lit_interventions",
        "sweep",
        "causalgym",
        *_causalgym(lm_dir, out, train_pairs=6),
    ]
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert done.stderr.count("differs in train_pairs (8 there, 6 here)") == 2, done.stderr[-3000:]  # every rank says it
    assert not (out / "ranks").exists() and len(_rows(out / "results.csv")) == 4


@pytest.mark.slow
def test_ravel_two_ranks_resume_and_equal_one_process(tmp_path, tiny_lm_dir, monkeypatch, one_thread):
    """Rank 1 of an interrupted run finished the full-swap cells (their scores marked here); a
    2-process rerun merges them and the free ranks take the 2 DAS cells: every file equals a
    one-process run's but for the marks. The model's answers (the data filter) come from the
    on-disk cache the one-process run fills with an oracle, as in test_ddp."""
    from lit_interventions.datamodules.ravel import RavelDataModule

    from lit_interventions.studies.ravel_sweep import run_ravel_sweep
    from tests.helpers import oracle

    cache = {"LIT_INTERVENTIONS_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", cache["LIT_INTERVENTIONS_CACHE"])
    lm_dir = tiny_lm_dir("llama")
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm_dir).data.entities)))
    options = dict(
        lm=lm_dir, layer=1, k=4, train_size=16, eval_size=12, max_candidates=40, attributes=["Country", "Continent"]
    )
    one, two = tmp_path / "one", tmp_path / "two"
    run_ravel_sweep(**options, methods=["full_swap", "das"], out=str(one))
    run_ravel_sweep(**options, methods=["full_swap"], out=str(two))
    with sqlite3.connect(two / "results.sqlite") as db:
        db.execute("UPDATE summary SET cause = '0.125'")
        db.execute("UPDATE changes SET change_rate = '0.25'")
    db.close()
    _as_if_rank_left_it(two, 1)
    args = [
        "--config",
        "configs/sweep_ravel.yaml",
        f"--lm={lm_dir}",
        "--layer=1",
        "--k=4",
        "--train_size=16",
        "--eval_size=12",
        "--max_candidates=40",
        "--attributes=[Country, Continent]",
        "--methods=[full_swap, das]",
        f"--out={two}",
    ]
    _launch(tmp_path, 2, *args, env=cache, benchmark="ravel")

    def marked(rows, **marks):
        return [{**r, **marks} if r["method"] == "full_swap" else r for r in rows]

    assert _rows(two / "summary.csv") == marked(_rows(one / "summary.csv"), cause="0.125")
    assert _rows(two / "changes.csv") == marked(_rows(one / "changes.csv"), change_rate="0.25")
    das = [r for r in _rows(two / "table.csv") if r["method"] == "das"]
    assert das == [r for r in _rows(one / "table.csv") if r["method"] == "das"]
    assert (two / "das_changes.png").is_file() and not (two / "ranks").exists()


def test_a_rank_alone_gives_up_with_one_clear_error(monkeypatch):
    """`lit-interventions sweep causalgym` run bare in a SLURM batch script of 2 tasks: the one
    process is rank 0 of 2 and no other comes."""
    import socket
    from datetime import timedelta

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "sweep",
        "SLURM_NODELIST": "localhost",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "MEET", timedelta(seconds=2))
    ranks = distributed.detect()
    with pytest.raises(ValueError, match=r"rank 0 of 2 waited 0:00:02 for the others at 127.0.0.1:\d+ and gave up"):
        ranks.from_main(lambda: pytest.fail("no work before the ranks meet"))
