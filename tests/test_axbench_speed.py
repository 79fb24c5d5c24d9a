"""benchmarks/axbench_speed.py: our AxBench fit (train.py's Lightning fit, one dictionary for every
concept) and AxBench's loop structure (one pyvene model per concept, full forwards) learn the same
rows and score the same AUROC on a tiny Llama with our built-in concepts: ReFT-r1 and DiffMean on
one concept, DiffMean per concept over several; the script runs end to end; a bad argument is one
error line."""

import subprocess
import sys

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR

from tests.helpers import BENCHMARKS, benchmark_module, run_benchmark

LAYER, MAX_LENGTH = 1, 64  # the tiny LM has 3 blocks and 128 positions


@pytest.fixture
def bench(monkeypatch):
    return benchmark_module(monkeypatch, "axbench_speed")


def both(bench, lm: str, method: str, concepts: tuple[int, ...], epochs: int = 2, extra=()) -> tuple[dict, dict]:
    setting = bench.Setting(method, lm, None, concepts, "cpu", "float32", epochs, LAYER, MAX_LENGTH, tuple(extra))
    with pytest.warns(UserWarning, match="truncated"):  # the tiny tokenizer spells most words in bytes
        _, mine = bench.ours(setting)
        _, theirs = bench.reference(setting)
    return mine, theirs


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("reft_r1", ()),
        # the tiny LM's gradient norms are ~0.02: a lower clip and a strong L1 make both count
        ("reft_r1", ("--trainer.gradient_clip_val", "0.005", "--model.method.l1", "1.0")),
        ("diffmean", ()),
    ],
)
def test_one_concept_ours_and_the_reference_loop_learn_the_same_row_and_auroc(bench, tiny_lm_dir, method, extra):
    mine, theirs = both(bench, tiny_lm_dir("llama"), method, (0,), extra=extra)
    torch.testing.assert_close(mine["initial"], theirs["initial"], rtol=0, atol=0)
    assert (mine["rows"] - mine["initial"]).abs().max() > 1e-2  # trained (DiffMean: fitted)
    torch.testing.assert_close(mine["rows"], theirs["rows"], rtol=0, atol=1e-5)
    assert list(mine["auroc"]) == list(theirs["auroc"]) and len(mine["auroc"]) == 1
    assert mine["auroc"] == pytest.approx(theirs["auroc"], abs=1e-6)


def test_diffmean_over_several_concepts_is_the_same_per_concept(bench, tiny_lm_dir):
    mine, theirs = both(bench, tiny_lm_dir("llama"), "diffmean", (0, 1, 5))
    assert mine["rows"].shape[0] == 3
    torch.testing.assert_close(mine["rows"], theirs["rows"], rtol=0, atol=1e-5)
    assert list(mine["auroc"]) == list(theirs["auroc"])
    assert mine["auroc"] == pytest.approx(theirs["auroc"], abs=1e-6)


def test_the_script_runs_end_to_end_and_ends_with_the_ratios(tiny_lm_dir):
    args = ["--lm", tiny_lm_dir("llama"), "--concept_dir", str(BUILTIN_DIR), "--concepts", "1", "--epochs", "1"]
    args += ["--layer", str(LAYER), "--max_length", str(MAX_LENGTH), "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "axbench_speed.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for method in ("reft_r1", "diffmean"):
        assert any(line.startswith(f"{method}: AUROC reference") and " equal within 0.01" in line for line in lines)
        assert any(line.startswith("peak RSS (MiB): reference") for line in lines)
    assert lines[-1].startswith("diffmean ratio=") and any(line.startswith("reft_r1 ratio=") for line in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--concept_dir", "/nonexistent/concept10"],
            "error: --concept_dir /nonexistent/concept10 is not a directory: get the published files with "
            "`lit-interventions data axbench-concept10 --out /nonexistent/concept10`",
        ),
        (["--methods", "sae"], "error: argument --methods: invalid choice: 'sae'"),
        (["--epochs", "0"], "error: --epochs 0 must be a positive integer"),
        (["--concept_dir", str(BUILTIN_DIR), "--concepts", "0"], "error: --concepts 0: choose 1..10 concepts"),
        (["--concept_dir", str(BUILTIN_DIR), "--concepts", "1", "1"], "error: --concepts 1 1: give distinct"),
    ],
)
def test_bad_arguments_are_one_error_line(args, message):
    done = run_benchmark("axbench_speed.py", *args)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr
