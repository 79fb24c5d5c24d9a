"""The CausalGym sweep on a counterfactual pairs file (`--pairs`, `studies/causalgym_tasks.py`): one
task named for the file, regions `site` and `last`; results, summary and heatmaps; a site's odds
equal `train.py`'s validation odds on the same pairs (bit for bit where both compute the frozen
states in the same forward); `--pairs` with `--tasks`,
`--templates` or `--control` is one error line; a resumed run on a changed file is refused."""

import hashlib
import json
import shutil

import pytest

import train
from lit_interventions.studies import causalgym_sweep as sweep
from tests.helpers import ONE_QUIET_EPOCH, csv_rows, write_jsonl
from tests.test_pairs_data import PAIRS, example_rows

LAYERS = [0, 1]
REGIONS = ["site", "last"]


def _thrice(tmp_path):
    """12 pairs, as train, as val and as test: `train.py` validates on the pairs the sweep scores
    (its eval split is the file's test rows), and both compute the frozen states of the same 24
    sentences in one forward (a batched forward's bits for a sentence depend on the sentences
    beside it)."""
    rows = example_rows()[:12]
    return write_jsonl(
        tmp_path / "agreement.jsonl", [row | {"split": s} for s in ("train", "val", "test") for row in rows]
    )


def _sweep(lm, out, pairs=PAIRS, **kwargs):
    options = dict(methods=["das", "diffmean"], layers=LAYERS, lm=lm, out=str(out), pairs=str(pairs))
    return sweep.run_sweep(**{**options, **kwargs})


def test_the_sweep_on_a_pairs_file_writes_results_summary_and_heatmaps(tmp_path, tiny_lm_dir):
    out = tmp_path / "out"
    summary = _sweep(tiny_lm_dir("llama"), out)
    rows = csv_rows(out / "results.csv")
    assert [(r["task"], r["method"], int(r["layer"]), r["region"]) for r in rows] == [
        ("pairs", method, layer, region) for layer in LAYERS for region in REGIONS for method in ("das", "diffmean")
    ]  # one row per (method, layer, region), site after site
    assert all(r["control_odds"] == "" for r in rows)
    assert [(line["task"], line["method"]) for line in summary] == [("pairs", "das"), ("pairs", "diffmean")]
    for line in summary:  # both regions scored: the mean over layers of the better region
        cells = {(int(r["layer"]), r["region"]): float(r["odds"]) for r in rows if r["method"] == line["method"]}
        assert line["overall_odds"] == sweep.overall(cells) == sweep.overall(cells, REGIONS)
        assert "selectivity" not in line
    written = csv_rows(out / "summary.csv")
    assert [(r["task"], r["method"], float(r["overall_odds"])) for r in written] == [
        (line["task"], line["method"], line["overall_odds"]) for line in summary
    ]
    # Acc over the 20 eval examples (the file's 10 test pairs, each swapped too)
    assert round(summary[0]["accuracy"] * 20, 9).is_integer() and summary[0]["accuracy"] == summary[1]["accuracy"]
    for method in ("das", "diffmean"):
        assert (out / "heatmaps" / f"pairs_{method}.png").stat().st_size > 1000
    assert sorted(path.name for path in (out / "das").glob("*.safetensors")) == [
        "pairs_0.safetensors",
        "pairs_1.safetensors",
    ]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["pairs"] == str(PAIRS) and meta["pairs_sha256"] == hashlib.sha256(PAIRS.read_bytes()).hexdigest()
    assert "templates_sha256" not in meta and "train_pairs" not in meta


@pytest.fixture(scope="module")
def site_rows(tmp_path_factory, tiny_lm_dir):
    """The sweep's rows at layer 1, scored site by site: {(method, region): (odds, iia)}."""
    tmp = tmp_path_factory.mktemp("pairs-sweep")
    path = _thrice(tmp)
    lm = tiny_lm_dir("llama")
    _sweep(lm, tmp / "out", path, methods=["vanilla", "diffmean"], layers=[1], stacked_scoring=False, batch_size=64)
    rows = csv_rows(tmp / "out" / "results.csv")
    assert {r["task"] for r in rows} == {"agreement"}  # the file's stem
    return path, {(r["method"], r["region"]): (float(r["odds"]), float(r["iia"])) for r in rows}


@pytest.mark.parametrize(
    "method, region", [("vanilla", "site"), ("vanilla", "last"), ("diffmean", "site"), ("diffmean", "last")]
)
def test_the_sweeps_odds_at_a_site_equal_train_py_validation(method, region, site_rows, tmp_path, tiny_lm_dir):
    path, rows = site_rows
    intervention = (
        ["--model.intervention=lit_interventions.interventions.rotation.FullSubspaceSwap"]
        if method == "vanilla"
        else [  # a fitted method runs `fit`, whose validation scores it
            "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
            "--model.intervention.method=diffmean",
        ]
    )
    cli = train.main(
        args=[
            "validate" if method == "vanilla" else "fit",
            "--config",
            "configs/das_pairs.yaml",
            f"--data.path={path}",
            f"--model.lm={tiny_lm_dir('llama')}",
            "--model.layer=1",
            f"--model.region={region}",
            *intervention,
            "--data.eval_batch_size=64",  # the sweep's batch_size
            *ONE_QUIET_EPOCH,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    splits = cli.datamodule.splits
    assert [e.base_text for e in splits["dev"]] == [e.base_text for e in splits["eval"]] and len(splits["dev"]) == 24
    metrics = cli.trainer.callback_metrics
    odds, iia = rows[(method, region)]
    if method == "vanilla":  # `validate`: the same 24 sentences in the same one forward, bit for bit
        assert (metrics["val/odds"].item(), metrics["val/iia"].item()) == (odds, iia)
    else:  # `fit` reads the train split shuffled, so its forward holds the sentences in another order
        assert metrics["val/iia"].item() == iia and metrics["val/odds"].item() == pytest.approx(odds, rel=0, abs=1e-7)
    assert odds != 0.0 and abs(odds) > 1e-4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--control=true"], "error: control=True with pairs="),
        (["--tasks=agr_gender"], "error: tasks='agr_gender' with pairs="),
        (["--templates=my_templates.json"], "error: templates='my_templates.json' with pairs="),
    ],
    ids=["control", "tasks", "templates"],
)
def test_pairs_with_control_tasks_or_templates_is_one_error_line(extra, message, tmp_path, tiny_lm_dir, capsys):
    args = ["--config", "configs/sweep_causalgym.yaml", f"--pairs={PAIRS}", f"--lm={tiny_lm_dir('llama')}"]
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([*args, "--methods=[diffmean]", f"--out={tmp_path / 'out'}", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "out").exists()  # refused before the output directory is claimed


def test_a_resumed_run_on_a_changed_file_is_refused(tmp_path, tiny_lm_dir, monkeypatch):
    lm = tiny_lm_dir("llama")
    path = write_jsonl(tmp_path / "pairs.jsonl", example_rows())
    out = tmp_path / "out"
    first = _sweep(lm, out, path, methods=["diffmean"], layers=[0])
    moved = tmp_path / "elsewhere" / "pairs.jsonl"  # the same rows at another path: resumed, nothing to do
    moved.parent.mkdir()
    shutil.copy(path, moved)
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("the rerun loaded the model"))
    assert _sweep(lm, out, moved, methods=["diffmean"], layers=[0]) == first
    rows = example_rows()
    write_jsonl(
        path, rows[:-1] + [rows[-1] | {"base_label": rows[-1]["source_label"], "source_label": rows[-1]["base_label"]}]
    )
    with pytest.raises(ValueError, match=r"holds results for lm=.*; this run differs in pairs_sha256 \('"):
        _sweep(lm, out, path, methods=["diffmean"], layers=[0])
