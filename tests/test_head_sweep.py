"""The CausalGym sweep at attention heads (`--component attention_head`) on a tiny model: each
(layer, head, region) equals `train.py fit` at that head, heads are not mixed up, the `head`
column, resumption, the per-head summary and heatmaps, bad input and the command line."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import train
from lit_interventions.studies import causalgym_sweep as sweep
from tests.helpers import ONE_QUIET_EPOCH, csv_rows, run_command

REGIONS = ["The", "subject", "prep", "the", "object"]  # agr_sv_num_pp's
SIZES = dict(tasks="agr_sv_num_pp", train_pairs=10, eval_pairs=4, batch_size=64)


def _sweep(lm, out, **kwargs):
    options = dict(methods=["das", "diffmean"], layers=[1], component="attention_head", heads=[0, 2])
    return sweep.run_sweep(lm=lm, out=str(out), **SIZES, **{**options, **kwargs})


def _by_site(rows):
    return {(r["method"], int(r["layer"]), int(r["head"]), r["region"]): float(r["odds"]) for r in rows}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_lm_dir):
    """A head sweep of DAS and DiffMean at layer 1, heads 0 and 2 (of 4): (out, summary, rows)."""
    out = tmp_path_factory.mktemp("head-sweep") / "out"
    summary = _sweep(tiny_lm_dir("llama"), out)
    return out, summary, csv_rows(out / "results.csv")


def test_the_head_sweep_writes_a_head_column_per_head_summaries_and_heatmaps(swept):
    out, summary, rows = swept
    assert list(rows[0]) == ["task", "method", "layer", "head", "region", "odds", "iia", "control_odds", "control_iia"]
    assert set(_by_site(rows)) == {("das", 1, h, r) for h in (0, 2) for r in REGIONS} | {
        ("diffmean", 1, h, r) for h in (0, 2) for r in REGIONS
    }
    # under causal attention the first token's head output is the same in base and source
    assert all(float(r["odds"]) == 0.0 for r in rows if r["region"] == "The")
    odds = _by_site(rows)
    assert [(line["method"], line["head"]) for line in summary] == [
        ("das", 0),
        ("das", 2),
        ("diffmean", 0),
        ("diffmean", 2),
    ]
    for line in summary:  # one layer: the overall odds at a head is its best scored region's odds
        best = max(odds[(line["method"], 1, line["head"], r)] for r in REGIONS[1:])
        assert line["overall_odds"] == best
    written = csv_rows(out / "summary.csv")
    assert list(written[0]) == ["task", "method", "head", "accuracy", "overall_odds", "selectivity"]
    assert [float(r["overall_odds"]) for r in written] == [line["overall_odds"] for line in summary]
    for method in ("das", "diffmean"):
        assert (out / "heatmaps" / f"agr_sv_num_pp_{method}_heads.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "das").glob("*.safetensors")) == [
        "agr_sv_num_pp_1_h0.safetensors",
        "agr_sv_num_pp_1_h2.safetensors",
    ]
    assert json.loads((out / "meta.json").read_text())["component"] == "attention_head"


def test_the_best_region_grid_takes_the_best_scored_region_of_each_layer_and_head():
    rows = [
        {"layer": "0", "head": "1", "region": "a", "odds": "1.0"},
        {"layer": "0", "head": "1", "region": "b", "odds": "3.0"},
        {"layer": "0", "head": "1", "region": "skipped", "odds": "9.0"},
        {"layer": "2", "head": "0", "region": "a", "odds": "-2.0"},
    ]
    matrix, layers, found = sweep.best_region_grid(rows, ["a", "b"])
    assert (layers, found) == ([0, 2], [0, 1])
    assert matrix[0, 1] == 3.0 and matrix[1, 0] == -2.0
    assert math.isnan(matrix[0, 0]) and math.isnan(matrix[1, 1])


@pytest.mark.parametrize("head", [0, 2])
@pytest.mark.parametrize("method", ["das", "diffmean"])
def test_a_head_sites_odds_equal_train_py_fit_at_that_head(swept, tiny_lm_dir, tmp_path, method, head):
    """`train.py fit --model.component attention_head --model.head H` at the same site and seed,
    its intervention scored on the eval split as the sweep scores it: the sweep's odds, bit for
    bit. The two heads give different odds, so a mixed-up head index fails here."""
    _, _, rows = swept
    odds = _by_site(rows)
    region = "object"
    assert odds[(method, 1, 0, region)] != odds[(method, 1, 2, region)]
    intervention = (
        []
        if method == "das"
        else [
            "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
            "--model.intervention.method=diffmean",
        ]
    )
    cli = train.main(
        args=[
            "fit",
            "--config",
            "configs/das.yaml",
            f"--model.lm={tiny_lm_dir('llama')}",
            "--model.layer=1",
            "--model.component=attention_head",
            f"--model.head={head}",
            f"--model.region={region}",
            *intervention,
            "--data.train_pairs=10",
            "--data.eval_pairs=4",
            *ONE_QUIET_EPOCH,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    scored = cli.model.score(list(cli.datamodule.loader("eval", 64)))
    assert scored["odds"] == odds[(method, 1, head, region)]  # the same computation, bit for bit
    assert abs(scored["odds"]) > 1e-4  # a site where the intervention does something


def test_an_interrupted_head_sweep_resumes_to_the_same_rows_and_reuses_trained_das(
    swept, tiny_lm_dir, tmp_path, monkeypatch
):
    _, _, expected = swept
    lm = tiny_lm_dir("llama")
    real, calls = sweep.sweep_site, []

    def stop_at_the_fourth(*args, **kwargs):
        calls.append(kwargs["head"])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "sweep_site", stop_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        _sweep(lm, tmp_path / "out")
    first = csv_rows(tmp_path / "out" / "results.csv")
    assert len(first) == 3 * 2  # three sites, each whole (both methods)
    monkeypatch.setattr(sweep, "sweep_site", real)
    trained = []
    monkeypatch.setattr(sweep, "train_at_site", lambda *a: trained.append((a[2], a[4], a[5].region)) or pytest.fail())
    with pytest.raises(pytest.fail.Exception):
        _sweep(lm, tmp_path / "out")
    # the fourth site's DAS was saved before the interruption: the first training is the fifth site's
    assert trained == [(1, 0, "object")]
    monkeypatch.undo()
    _sweep(lm, tmp_path / "out")
    resumed = csv_rows(tmp_path / "out" / "results.csv")
    assert resumed[:6] == first
    assert _by_site(resumed) == _by_site(expected)
    # a rerun finds every site done: nothing is trained or scored again
    monkeypatch.setattr(sweep, "train_at_site", lambda *a: pytest.fail("retrained"))
    monkeypatch.setattr(sweep, "sweep_site", lambda *a, **k: pytest.fail("rescored"))
    _sweep(lm, tmp_path / "out")
    assert csv_rows(tmp_path / "out" / "results.csv") == resumed


def test_more_heads_on_rerun_add_their_rows_and_keep_the_others(tiny_lm_dir, tmp_path):
    lm = tiny_lm_dir("gpt_neox")
    _sweep(lm, tmp_path / "out", methods=["diffmean"], heads=[3])
    first = csv_rows(tmp_path / "out" / "results.csv")
    assert {int(r["head"]) for r in first} == {3}
    summary = _sweep(lm, tmp_path / "out", methods=["diffmean"], heads="all")
    second = csv_rows(tmp_path / "out" / "results.csv")
    assert second[: len(first)] == first and len(second) == 4 * len(first)
    assert [line["head"] for line in summary] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"heads": [1, 4]},
            r"heads \[4\] are out of range for component='attention_head': this model has 4 attention heads \(0\.\.3, or 'all'\)",
        ),
        ({"heads": [1, 1]}, r"heads \[1, 1\] name a head twice: give each head once"),
        ({"heads": []}, r"heads=\[\] names no head index: this model has 4 attention heads \(0\.\.3, or 'all'\)"),
        ({"heads": "first"}, r"heads='first' names no head index: this model has 4 attention heads"),
        (
            {"component": "block_output", "heads": [0]},
            r"heads=\[0\] is given with component='block_output', which has no heads: heads is only for attention_head, query, key, value$",
        ),
        (
            {"component": "heads", "heads": None},
            r"component='heads' is not swept; choose one of: block_output, attention_output, mlp_output, block_input, attention_head, query, key, value, mlp_neuron$",
        ),
        (
            {"layers": [-1, 1]},
            r"layer -1 \(the embeddings\) has no attention_head: choose layers 0\.\. with component='attention_head'$",
        ),
    ],
)
def test_bad_heads_or_component_fail_before_any_model_work(tiny_lm_dir, tmp_path, monkeypatch, kwargs, message):
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("the LM loaded"))
    with pytest.raises(ValueError, match=message):
        _sweep(tiny_lm_dir("llama"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_directory_of_the_other_component_is_refused(swept, tiny_lm_dir):
    out, _, rows = swept
    with pytest.raises(
        ValueError, match=r'holds a sweep with --component="attention_head", this run has --component="block_output"'
    ):
        sweep.run_sweep(lm=tiny_lm_dir("llama"), out=str(out), methods=["diffmean"], layers=[1], **SIZES)
    assert csv_rows(out / "results.csv") == rows


def test_the_command_line_sweeps_heads(tiny_lm_dir, tmp_path):
    common = ["sweep", "causalgym", "--config", "configs/sweep_causalgym.yaml", f"--lm={tiny_lm_dir('gpt2')}"]
    common += ["--methods=[diffmean]", "--layers=[0]", "--train_pairs=10", "--eval_pairs=4"]
    done = run_command(*common, "--component=attention_head", "--heads=[1,3]", f"--out={tmp_path / 'cli'}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-4].split() == ["task", "method", "head", "accuracy", "overall_odds"]
    assert [line.split()[:3] for line in lines[-3:-1]] == [
        ["agr_sv_num_pp", "diffmean", "1"],
        ["agr_sv_num_pp", "diffmean", "3"],
    ]
    assert lines[-1] == f"files in {tmp_path / 'cli'}"
    assert {r["head"] for r in csv_rows(tmp_path / "cli" / "results.csv")} == {"1", "3"}
    bad = run_command(*common, "--component=attention_head", "--heads=[7]", f"--out={tmp_path / 'bad'}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: heads [7] are out of range for component='attention_head': this model has 4 attention heads (0..3, or 'all')"
    )
    assert not (tmp_path / "bad").exists()


def test_the_control_task_at_heads_gives_control_odds_and_selectivity_per_head(tiny_lm_dir, tmp_path):
    summary = _sweep(tiny_lm_dir("gpt_neox"), tmp_path / "out", heads=[1], control=True)
    rows = csv_rows(tmp_path / "out" / "results.csv")
    assert len(rows) == 2 * len(REGIONS) and all(r["control_odds"] != "" for r in rows)
    assert sorted(p.name for p in (tmp_path / "out" / "das").iterdir()) == [
        "agr_sv_num_pp_1_h1.safetensors",
        "agr_sv_num_pp_1_h1_dog_give.safetensors",
    ]
    for line in summary:
        mine = [r for r in rows if r["method"] == line["method"] and r["region"] in REGIONS[1:]]
        assert line["selectivity"] == max(float(r["odds"]) - float(r["control_odds"]) for r in mine)


def test_das_where_no_train_pair_differs_is_what_train_py_leaves_there(swept, tiny_lm_dir, tmp_path, monkeypatch):
    """At `The` (before the alternation) base and source states are equal: the sweep skips the
    epoch, whose gradient is zero, and keeps the initialised subspace, as `train.py fit` ends with."""
    out, _, _ = swept
    saved = load_file(out / "das" / "agr_sv_num_pp_1_h2.safetensors")
    cli = train.main(
        args=[
            "fit",
            "--config",
            "configs/das.yaml",
            f"--model.lm={tiny_lm_dir('llama')}",
            "--model.layer=1",
            "--model.component=attention_head",
            "--model.head=2",
            "--model.region=The",
            "--data.train_pairs=10",
            "--data.eval_pairs=4",
            *ONE_QUIET_EPOCH,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 5  # train.py took its 5 steps there
    torch.testing.assert_close(saved["The"], cli.model.intervention.basis.detach(), rtol=0, atol=0)
    assert not torch.equal(saved["The"], saved["subject"])  # trained elsewhere
