"""benchmarks/ravel_speed.py: our RAVEL fit (train.py's Lightning fit, the activation cache) and the
official loop's structure (pyvene, full base and source forwards) train the same rotation from the
same init on the same batches and score the same Cause / Iso, on a tiny Gemma 3; a bad argument
is one error line."""

import pytest
import torch
from lit_interventions.datamodules.ravel import RavelDataModule
from lit_interventions.datamodules.ravel_files import load_ravel

from tests.helpers import benchmark_module, oracle, run_benchmark


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """The benchmark module, with the model's answers cached under this test's directory and an
    oracle that answers every pair right."""
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path))
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(load_ravel(None, "city").entities)))
    return benchmark_module(monkeypatch, "ravel_speed")


@pytest.mark.parametrize("method", ["das", "mdas"])
def test_ours_and_the_reference_loop_train_and_score_the_same(bench, tiny_lm_dir, method):
    setting = bench.Setting(method, tiny_lm_dir("gemma3"), None, "Country", 1, 4, 24, 12, 2, "cpu")
    _, mine = bench.ours(setting)
    _, theirs = bench.reference(setting)
    torch.testing.assert_close(mine["initial"], theirs["initial"], rtol=0, atol=0)
    assert (mine["basis"] - mine["initial"]).abs().max() > 5e-2  # trained: 2 epochs of 2 batches
    # The first step's gradients agree to 1e-9 (of 2e-3), but Adam divides each entry by its own
    # magnitude: entries of the rotation's parameter whose gradient is ~1e-9 move by lr·g/(|g|+eps),
    # so float rounding there moves them by up to 4e-4, against 5e-2 for the training itself.
    torch.testing.assert_close(mine["basis"], theirs["basis"], rtol=0, atol=1e-3)
    assert (mine["cause"], mine["iso"]) == (theirs["cause"], theirs["iso"])


def test_max_candidates_reaches_the_data_module_both_sides_build(bench, tiny_lm_dir, tmp_path):
    setting = bench.Setting("das", tiny_lm_dir("gemma3"), None, "Country", 1, 4, 24, 12, 1, "cpu", max_candidates=7)
    data = bench.built_cli(setting.cli_args(str(tmp_path)), "cpu").datamodule
    assert data.hparams.max_candidates == 7
    assert len(data.candidates("Country", "train")) == 7


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ravel_dir", "/nonexistent/ravel"], "error: --ravel_dir /nonexistent/ravel is not a directory"),
        (["--methods", "dbm"], "error: argument --methods: invalid choice: 'dbm'"),
        (["--epochs", "0"], "error: --epochs 0 must be a positive integer"),
        (["--max_candidates", "0"], "error: --max_candidates 0 must be a positive integer"),
    ],
)
def test_bad_arguments_are_one_error_line(args, message):
    done = run_benchmark("ravel_speed.py", *args)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr
