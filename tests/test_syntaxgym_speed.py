"""benchmarks/syntaxgym_speed.py: our batched suite scoring and lm-zoo's one-sentence loop give the
same region surprisals on tiny models (every region, every condition, every item), the reference
loop equals a hand computation of s(x_t) = -log2 p(x_t | x_<t), and a bad argument is one error line."""

import math

import pytest
import torch

from lit_interventions.core.lm import load_lm
from tests.helpers import benchmark_module, run_benchmark
from tests.test_syntaxgym import TINY_SUITE, _write


@pytest.fixture
def bench(monkeypatch):
    return benchmark_module(monkeypatch, "syntaxgym_speed")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3"])
def test_ours_and_the_one_sentence_loop_give_the_same_region_surprisals(bench, tiny_lm_dir, tmp_path, arch):
    path = str(_write(tmp_path, TINY_SUITE))
    lm = tiny_lm_dir(arch)
    _, ours = bench.run_ours([path], lm, "float32", "cpu", 2, None)
    _, reference = bench.run_reference([path], lm, "float32", "cpu", 2, None)
    assert bench.first_difference(ours, reference, 1e-5) is None
    read = {("match", 3), ("match", 4), ("mismatch", 3)}  # the regions the prediction's formula reads
    assert [set(values) for values in ours[0][1]] == [read] * 3  # ours scores those, every item
    assert [len(values) for values in reference[0][1]] == [8] * 3  # the reference every region, as lm-zoo
    assert all(value > 0 for values in ours[0][1] for value in values.values())


def test_a_planted_difference_is_named(bench, tiny_lm_dir, tmp_path):
    path = str(_write(tmp_path, TINY_SUITE))
    _, ours = bench.run_ours([path], tiny_lm_dir("llama"), "float32", "cpu", 4, None)
    changed = [(name, [dict(values) for values in items]) for name, items in ours]
    assert bench.first_difference(changed, ours, 1e-4) is None and bench.largest_difference(changed, ours) == 0.0
    value = changed[0][1][1]["mismatch", 3]
    changed[0][1][1]["mismatch", 3] += 2e-4 * value  # past 1e-4 of its size; 0.5e-4 of it elsewhere passes
    changed[0][1][2]["match", 3] += 0.5e-4 * max(1.0, changed[0][1][2]["match", 3])
    assert bench.largest_difference(changed, ours) == pytest.approx(2e-4 * value, rel=1e-6)
    found = bench.first_difference(changed, ours, 1e-4)
    assert found.startswith("suite 'tiny_agreement', item 2, condition 'mismatch', region 3: ")


def test_the_reference_is_lm_zoos_definition_by_hand(bench, tiny_lm_dir):
    model = load_lm(tiny_lm_dir("llama"))
    ids = [1, 40, 41, 42, 43]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    by_hand = [0.0] + [
        (logits[t - 1].logsumexp(-1) - logits[t - 1, ids[t]]).item() / math.log(2) for t in range(1, len(ids))
    ]
    assert bench.sentence_surprisals(model, ids) == pytest.approx(by_hand, abs=1e-5)


def test_the_script_runs_end_to_end_and_ends_with_the_ratio(tiny_lm_dir, tmp_path):
    _write(tmp_path, TINY_SUITE, "tiny_agreement.json")
    done = run_benchmark(
        "syntaxgym_speed.py", "--suites_dir", str(tmp_path), "--suites", "all", "--lm", tiny_lm_dir("llama")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "1 suites, 3 items: largest region difference " in lines[-4]
    assert lines[-3].startswith("seconds: reference ") and lines[-2].startswith("peak RSS (MiB): reference ")
    assert lines[-1].startswith("syntaxgym ratio=") and float(lines[-1].split("=")[1]) > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--suites_dir", "/nonexistent/sg"],
            "syntaxgym_speed.py: error: --suites_dir /nonexistent/sg holds no SyntaxGym suites",
        ),
        (["--batch_size", "0"], "syntaxgym_speed.py: error: --batch_size=0 must be a positive integer"),
        (["--dtype", "bfloat16"], "syntaxgym_speed.py: error: --dtype bfloat16 rounds differently per batch"),
        (["--tolerance", "-1"], "syntaxgym_speed.py: error: --tolerance=-1.0 must be a non-negative number"),
    ],
)
def test_bad_arguments_are_one_error_line(args, message):
    done = run_benchmark("syntaxgym_speed.py", *args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(message), done.stderr
