"""The CausalGym sweep on a tiny model: files, resumption, the overall odds, degenerate sites, errors."""

import csv
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.templates import load_task, load_templates

from lit_interventions.studies import causalgym_scoring as scoring
from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies import causalgym_training as training
from lit_interventions.studies.causalgym_tasks import _region_data
from tests.helpers import ROOT

DAS_SECTION = {"class_path": "lit_interventions.modules.interchange.InterchangeModule", "init_args": {"k": 1}}


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _run(tmp_path, lm_dir, **kwargs):
    options = dict(
        tasks="agr_sv_num_pp",
        methods=["diffmean", "vanilla"],
        layers=[0, 2],
        lm=lm_dir,
        out=str(tmp_path / "out"),
        train_pairs=10,
        eval_pairs=4,
    )
    return sweep.run_sweep(**{**options, **kwargs})


def console(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`lit-interventions ARGS`, the console script installed next to this Python, run from the
    repository root, its output captured."""
    script = Path(sys.executable).with_name("lit-interventions")
    return subprocess.run(
        [str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


def test_overall_odds_by_hand():
    # layer 0: best region 2.0; layer 1: best region 4.0 -> mean 3.0 (CausalGym eq. 19)
    assert sweep.overall({(0, "a"): 1.0, (0, "b"): 2.0, (1, "a"): 4.0, (1, "b"): -1.0}) == 3.0


def test_overall_and_selectivity_skip_regions_before_the_label_variable(tmp_path):
    # agr_sv_num_pp: regions The | subject prep the object; the label variable is `subject`, so
    # `The` (before the alternation, odds exactly 0) is left out, as the paper's code never scores it.
    assert load_task("agr_sv_num_pp", None).scored_regions == ["subject", "prep", "the", "object"]
    assert load_task("garden_npz_obj", None).scored_regions[0] == "comma"  # after While the / subject / verb
    assert load_task("agr_gender", None).scored_regions[0] == "name"  # the label variable comes first
    odds = {  # layer 0: every scored region negative; layer 1: positive
        (0, "The"): 0.0,
        (0, "subject"): -0.5,
        (0, "prep"): -1.5,
        (0, "the"): -2.0,
        (0, "object"): -0.25,
        (1, "The"): 0.0,
        (1, "subject"): 3.0,
        (1, "prep"): 1.0,
        (1, "the"): 0.5,
        (1, "object"): 2.0,
    }
    control = {  # control odds above the task's everywhere after `The`: selectivity < 0 at both layers
        (0, "The"): 0.0,
        (0, "subject"): 0.5,
        (0, "prep"): 0.5,
        (0, "the"): 0.0,
        (0, "object"): 0.75,
        (1, "The"): 0.0,
        (1, "subject"): 4.0,
        (1, "prep"): 2.0,
        (1, "the"): 1.0,
        (1, "object"): 2.5,
    }
    rows = [
        {
            "task": "agr_sv_num_pp",
            "method": "das",
            "layer": str(layer),
            "region": region,
            "odds": str(value),
            "control_odds": str(control[(layer, region)]),
        }
        for (layer, region), value in odds.items()
    ]
    regions = {"agr_sv_num_pp": ["The", "subject", "prep", "the", "object"]}
    scored = {"agr_sv_num_pp": load_task("agr_sv_num_pp", None).scored_regions}
    (line,) = sweep.summarise(rows, {"agr_sv_num_pp": 0.9}, regions, tmp_path, scored)
    # layer 0: max(-0.5, -1.5, -2.0, -0.25) = -0.25; layer 1: 3.0 -> (-0.25 + 3.0) / 2
    assert line["overall_odds"] == 1.375
    # odds − control: layer 0: -1.0, -2.0, -2.0, -1.0 -> -1.0; layer 1: -1.0, -1.0, -0.5, -0.5 -> -0.5
    assert line["selectivity"] == -0.75
    # counting `The` (0 at every layer) as before: (0 + 3.0) / 2 and (0 + 0) / 2
    (old,) = sweep.summarise(rows, {"agr_sv_num_pp": 0.9}, regions, tmp_path)
    assert (old["overall_odds"], old["selectivity"]) == (1.5, 0.0)
    assert (tmp_path / "heatmaps" / "agr_sv_num_pp_das.png").is_file()  # the heatmap keeps every region


def test_sweep_writes_results_summary_and_heatmaps(tmp_path, tiny_lm_dir):
    summary = _run(tmp_path, tiny_lm_dir("llama"), control=True)
    out = tmp_path / "out"
    rows = _rows(out / "results.csv")
    regions = ["The", "subject", "prep", "the", "object"]
    assert {(r["method"], int(r["layer"]), r["region"]) for r in rows} == {
        (m, layer, region) for m in ("diffmean", "vanilla") for layer in (0, 2) for region in regions
    }
    assert all(r["control_odds"] != "" for r in rows)
    # Under causal attention the first token's state is the same in base and source: no effect.
    assert all(float(r["odds"]) == 0.0 for r in rows if r["region"] == "The")
    by_method = {line["method"]: line for line in summary}
    vanilla = {(int(r["layer"]), r["region"]): float(r["odds"]) for r in rows if r["method"] == "vanilla"}
    assert by_method["vanilla"]["overall_odds"] == pytest.approx(sweep.overall(vanilla, regions[1:]))
    assert "selectivity" in by_method["vanilla"] and 0.0 <= by_method["vanilla"]["accuracy"] <= 1.0
    assert (out / "heatmaps" / "agr_sv_num_pp_diffmean.png").stat().st_size > 1000
    assert len(_rows(out / "summary.csv")) == 2


def test_rerun_skips_finished_sites(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    _run(tmp_path, lm_dir, methods=["diffmean"])
    first = _rows(tmp_path / "out" / "results.csv")
    _run(tmp_path, lm_dir, methods=["diffmean", "vanilla"])
    second = _rows(tmp_path / "out" / "results.csv")
    assert second[: len(first)] == first and len(second) == 2 * len(first)
    _run(tmp_path, lm_dir, methods=["diffmean", "vanilla"])
    assert _rows(tmp_path / "out" / "results.csv") == second


def test_das_and_closed_form_methods_at_one_site(tmp_path, tiny_lm_dir):
    summary = _run(tmp_path, tiny_lm_dir("gpt_neox"), methods="all", layers=[1])
    assert {line["method"] for line in summary} == set(sweep.METHODS)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"methods": ["das", "magic"]}, r"Unknown methods \['magic'\]; valid: das, probe"),
        ({"tasks": ["agr_nope"]}, r"Unknown tasks \['agr_nope'\]; valid: agr_gender"),
        ({"layers": [0, 9]}, r"layers \[9\] are out of range: this model has 3 layers"),
        ({"batch_size": 0}, r"batch_size=0 must be a positive integer"),
    ],
)
def test_bad_input_fails_before_the_sweep(tmp_path, tiny_lm_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, tiny_lm_dir("llama"), **kwargs)
    assert not (tmp_path / "out" / "results.csv").exists()


def test_output_directory_of_another_model_is_refused(tmp_path, tiny_lm_dir):
    _run(tmp_path, tiny_lm_dir("llama"), methods=["diffmean"], layers=[0])
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["lm"] == tiny_lm_dir("llama")
    with pytest.raises(ValueError, match="holds results for lm="):
        _run(tmp_path, tiny_lm_dir("gpt_neox"), methods=["diffmean"], layers=[0])


def test_command_line(tmp_path, tiny_lm_dir, capsys):
    sweep.main(
        [
            "--config",
            "configs/sweep_causalgym.yaml",
            f"--lm={tiny_lm_dir('gpt2')}",
            "--methods=[diffmean]",
            "--layers=[1]",
            f"--out={tmp_path / 'cli'}",
            "--train_pairs=10",
            "--eval_pairs=4",
        ]
    )
    header, row, files = capsys.readouterr().out.strip().splitlines()[-3:]  # the summary table, then where
    assert header.split() == ["task", "method", "accuracy", "overall_odds"] and row.split()[:2] == [
        "agr_sv_num_pp",
        "diffmean",
    ]
    assert files == f"files in {tmp_path / 'cli'}"
    with pytest.raises(SystemExit):
        sweep.main(["--config", "configs/sweep_causalgym.yaml", f"--lm={tiny_lm_dir('gpt2')}", "--methods=[nope]"])
    assert "error: Unknown methods ['nope']" in capsys.readouterr().err


def test_other_data_sizes_are_refused_and_control_is_added_on_rerun(tmp_path, tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    _run(tmp_path, lm_dir, methods=["diffmean"], layers=[0])
    with pytest.raises(ValueError, match=r"differs in train_pairs \(10 there, 12 here\)"):
        _run(tmp_path, lm_dir, methods=["diffmean"], layers=[0], train_pairs=12)
    summary = _run(tmp_path, lm_dir, methods=["diffmean"], layers=[0], control=True)
    assert "selectivity" in summary[0]  # the sites run without the control were redone with it
    summary = _run(tmp_path, lm_dir, methods=["diffmean"], layers=[1])
    assert {int(r["layer"]) for r in _rows(tmp_path / "out" / "results.csv")} == {0, 1}
    assert summary[0]["overall_odds"] == pytest.approx(
        sweep.overall(
            {(1, r["region"]): float(r["odds"]) for r in _rows(tmp_path / "out" / "results.csv") if r["layer"] == "1"},
            regions=["subject", "prep", "the", "object"],
        )
    )  # the summary covers the layers asked for


def test_the_control_runs_on_the_tasks_listed_only(tmp_path, tiny_lm_dir, monkeypatch):
    # The whole study in one command: the control on the agreement tasks, not on the others.
    lm_dir = tiny_lm_dir("llama")
    options = dict(tasks=["agr_sv_num_pp", "garden_npz_obj"], methods=["diffmean"], layers=[0])
    summary = _run(tmp_path / "listed", lm_dir, control=["agr_sv_num_pp"], **options)
    rows = _rows(tmp_path / "listed" / "out" / "results.csv")
    assert {r["task"] for r in rows if r["control_odds"] != ""} == {"agr_sv_num_pp"}
    assert {r["task"] for r in rows if r["control_odds"] == ""} == {"garden_npz_obj"}
    assert {line["task"]: "selectivity" in line for line in summary} == {"agr_sv_num_pp": True, "garden_npz_obj": False}
    _run(tmp_path / "alone", lm_dir, control=True, **{**options, "tasks": ["agr_sv_num_pp"]})
    alone = _rows(tmp_path / "alone" / "out" / "results.csv")
    assert [r for r in rows if r["task"] == "agr_sv_num_pp"] == alone  # as the control on that task alone

    scored = []  # a rerun with the control on both tasks redoes only the task that had none
    score_unit = sweep.score_unit
    monkeypatch.setattr(sweep, "score_unit", lambda task, *a, **k: scored.append(task) or score_unit(task, *a, **k))
    _run(tmp_path / "listed", lm_dir, control=True, **options)
    assert scored == ["garden_npz_obj"]
    assert all(r["control_odds"] != "" for r in _rows(tmp_path / "listed" / "out" / "results.csv"))
    with pytest.raises(
        ValueError, match=r"Unknown control tasks \['npi_any_subj-relc'\]; valid: agr_sv_num_pp, garden"
    ):
        _run(tmp_path / "bad", lm_dir, control=["npi_any_subj-relc"], **options)
    assert not (tmp_path / "bad" / "out").exists()  # refused before the output directory is claimed


def test_the_study_config_runs_every_task_with_the_control_on_agreement_and_npi(monkeypatch):
    seen = {}

    @functools.wraps(sweep.run_sweep)
    def run_sweep(**options):
        seen.update(options)
        return []

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    sweep.main(["--config", "configs/sweep_causalgym.yaml", "--config", "configs/causalgym_study.yaml"])
    agreement_npi = [t for t in load_templates() if t.startswith(("agr_", "npi_"))]
    assert len(agreement_npi) == 11 and sorted(seen["control"]) == sorted(agreement_npi)
    assert (seen["tasks"], seen["layers"], seen["dtype"], len(seen["methods"])) == ("all", "all", "bfloat16", 9)


def test_trained_das_is_saved_and_reused_after_an_interruption(tmp_path, tiny_lm_dir, monkeypatch):
    from safetensors.torch import load_file

    lm_dir = tiny_lm_dir("llama")
    _run(tmp_path, lm_dir, methods=["das"], layers=[1])
    out = tmp_path / "out"
    saved = load_file(out / "das" / "agr_sv_num_pp_1.safetensors")
    assert set(saved) == {"The", "subject", "prep", "the", "object"} and saved["subject"].shape == (1, 32)
    first = _rows(out / "results.csv")
    for name in ("results.csv", "results.sqlite"):  # as if interrupted after training, before any site was scored
        (out / name).unlink()
    monkeypatch.setattr(training, "train_das", lambda *a, **k: pytest.fail("the saved subspaces must be reused"))
    _run(tmp_path, lm_dir, methods=["das"], layers=[1])
    again = _rows(out / "results.csv")
    assert [r["region"] for r in again] == [r["region"] for r in first]
    assert [float(r["odds"]) for r in again] == pytest.approx([float(r["odds"]) for r in first])


def test_forward_batch_size_changes_no_result(tmp_path, tiny_lm_dir, monkeypatch):
    # The cache fill, the fitted states and the scoring run 3 rows at a time instead of 64: the
    # batches differ in padding and composition, the numbers must not (a GPU raises batch_size).
    from lit_interventions.datamodules.causalgym import CausalGymDataModule

    lm_dir = tiny_lm_dir("llama")
    methods = ["das", "diffmean", "probe", "vanilla"]
    big = _run(tmp_path / "big", lm_dir, methods=methods, layers=[1], control=True)
    sizes, loader = [], CausalGymDataModule.loader

    def recorded(self, split, batch_size, *args, **kwargs):
        sizes.append(batch_size)
        return loader(self, split, batch_size, *args, **kwargs)

    monkeypatch.setattr(CausalGymDataModule, "loader", recorded)
    small = _run(tmp_path / "small", lm_dir, methods=methods, layers=[1], control=True, batch_size=3)
    assert set(sizes) == {3, 4}  # 4: DAS trains at the paper's batch
    columns = ("odds", "iia", "control_odds", "control_iia")
    numbers = [float(r[c]) for r in _rows(tmp_path / "big" / "out" / "results.csv") for c in columns]
    again = [float(r[c]) for r in _rows(tmp_path / "small" / "out" / "results.csv") for c in columns]
    assert numbers == pytest.approx(again, abs=1e-4) and any(n != 0.0 for n in numbers)
    assert [line["accuracy"] for line in big] == [line["accuracy"] for line in small]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stacked_scoring_equals_site_by_site(tmp_path, tiny_lm_dir, monkeypatch, arch):
    # Every site × method of the unit in stacked forwards of 7 rows (pieces of several sites,
    # methods and the clean rows at different layers share a forward) gives the results.csv
    # that scoring each site alone gives, to float rounding, the control task included.
    calls, score = [], scoring.score_stacked

    def counted(*args, **kwargs):  # counts the calls that returned (a failure falls back to site by site)
        scores = score(*args, **kwargs)
        calls.append(1)
        return scores

    monkeypatch.setattr(scoring, "score_stacked", counted)
    lm_dir = tiny_lm_dir(arch)
    methods = ["das", "diffmean", "probe", "vanilla"]
    options = dict(methods=methods, layers=[0, 1, 2], control=True, batch_size=7)
    alone = _run(tmp_path / "alone", lm_dir, stacked_scoring=False, **options)
    assert calls == []
    forwarded = []  # rows of each stacked forward

    def counted_rows(model, input_ids, *args, **kwargs):
        forwarded.append(len(input_ids))
        return hidden(model, input_ids, *args, **kwargs)

    hidden = scoring.stacked_hidden
    monkeypatch.setattr(scoring, "stacked_hidden", counted_rows)
    stacked = _run(tmp_path / "stacked", lm_dir, **options)
    assert len(calls) == 1  # the task and its control in one call for the unit
    # the control shares the clean rows and the fitted directions' rows: only its DAS rows are extra
    # (15 sites × 8 eval rows × (clean + 4 methods + control DAS), not twice 15 × 8 × 5), and the
    # rows a method leaves unchanged (region "The", before the pair's difference, at 3 layers) are
    # their clean rows, not run again
    assert sum(forwarded) == 15 * 8 * (1 + len(methods) + 1) - 3 * 8 * (len(methods) + 1)
    before, after = (
        _rows(tmp_path / "alone" / "out" / "results.csv"),
        _rows(tmp_path / "stacked" / "out" / "results.csv"),
    )
    key = ("task", "method", "layer", "region")
    assert [tuple(r[k] for k in key) for r in before] == [tuple(r[k] for k in key) for r in after]
    assert len(before) == len(methods) * 3 * 5
    columns = ("odds", "iia", "control_odds", "control_iia")
    numbers = [float(r[c]) for r in before for c in columns]
    again = [float(r[c]) for r in after for c in columns]
    assert again == pytest.approx(numbers, rel=1e-4, abs=1e-5) and any(n != 0.0 for n in numbers)
    assert all(float(r["odds"]) == 0.0 for r in after if r["region"] == "The")  # no effect before the alternation
    assert [line["overall_odds"] for line in stacked] == pytest.approx(
        [line["overall_odds"] for line in alone], rel=1e-4
    )


def test_a_failed_stacked_scoring_falls_back_to_site_by_site_with_a_warning(tmp_path, tiny_lm_dir, monkeypatch):
    options = dict(methods=["diffmean", "vanilla"], layers=[0, 1])
    alone = _run(tmp_path / "alone", tiny_lm_dir("llama"), stacked_scoring=False, **options)

    def unsupported(*args, **kwargs):
        raise NotImplementedError("rows entering at different layers")

    monkeypatch.setattr(scoring, "score_stacked", unsupported)
    with pytest.warns(
        UserWarning,
        match=r"stacked scoring failed on .*NotImplementedError: rows entering at different "
        r"layers.*each site is scored in its own forwards",
    ):
        fallen = _run(tmp_path / "fallen", tiny_lm_dir("llama"), **options)
    assert fallen == alone
    assert _rows(tmp_path / "fallen" / "out" / "results.csv") == _rows(tmp_path / "alone" / "out" / "results.csv")


def test_a_failed_fit_is_raised_not_retried_site_by_site(tmp_path, tiny_lm_dir, monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("singular covariance")

    monkeypatch.setattr(scoring, "fit_site", broken)
    with pytest.raises(ValueError, match="singular covariance"):
        _run(tmp_path, tiny_lm_dir("llama"), methods=["lda"], layers=[0])
    assert calls == [1]


def test_stacked_scoring_packs_rows_across_jobs_shortest_runs_first():
    from lit_interventions.studies.causalgym_scoring import _pieces

    runs = {"a": [3, 1, 3, 1, 2], "b": [2, 2, 2], "c": [1, 9, 9, 1, 1, 9]}  # each row's run, in columns
    runs = {job: dict(enumerate(row_runs)) for job, row_runs in runs.items()}
    assert list(_pieces(runs, 4)) == [
        [("a", [1, 3]), ("c", [0, 3])],
        [("c", [4]), ("a", [4]), ("b", [0, 1])],
        [("b", [2]), ("a", [0, 2]), ("c", [1])],
        [("c", [2, 5])],
    ]
    with pytest.raises(ValueError, match="rows=0 must be a positive integer"):
        from lit_interventions.studies.causalgym_scoring import score_stacked

        score_stacked(None, None, {}, {}, rows=0)


def test_a_task_whose_label_words_share_a_token_is_one_clear_line(tmp_path, tiny_lm_dir, capsys):
    """The data module's error reaches the user as it is (it was once turned into an AttributeError
    by the sweep, which took every ValueError of a region for an empty region)."""
    import json

    templates = json.loads(Path("datamodules/data/causalgym.json").read_text())
    task = templates["agr_sv_num_pp"]
    task["labels"] = {t: ["is"] for t in task["labels"]}  # both types: the same label word
    path = tmp_path / "templates.json"
    path.write_text(json.dumps({"agr_sv_num_pp": task}))
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(
            [
                "--config",
                "configs/sweep_causalgym.yaml",
                f"--lm={tiny_lm_dir('gpt2')}",
                f"--templates={path}",
                "--methods=[diffmean]",
                "--layers=[1]",
                f"--out={tmp_path / 'out'}",
                "--train_pairs=10",
                "--eval_pairs=4",
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # (progress bars of the tiny model's load come first)
    assert "error: Task 'agr_sv_num_pp': label words" in err[-1] and "share their first token" in err[-1]


def test_das_of_every_layer_in_one_loop_equals_one_loop_per_layer(tmp_path, tiny_lm_dir, monkeypatch):
    """The stacked loop (every layer and region of the task at once) changes no result: DAS
    rows equal the per-layer loops' to float rounding, every other method's exactly."""
    from functools import partial

    lm_dir = tiny_lm_dir("llama")
    options = dict(methods=["das", "diffmean"], layers=[-1, 0, 2], control=True)
    calls = []
    train_das = training.train_das
    monkeypatch.setattr(
        training, "train_das", lambda datas, *a, **k: calls.append(sorted(datas)) or train_das(datas, *a, **k)
    )
    _run(tmp_path / "one", lm_dir, **options)
    regions = ["The", "subject", "prep", "the", "object"]
    every_site = sorted((layer, region) for layer in (-1, 0, 2) for region in regions)
    assert calls == [every_site, every_site]  # one loop for the task, one for its control task
    monkeypatch.setattr(training, "train_das", partial(train_das, one_loop=False))
    _run(tmp_path / "per_layer", lm_dir, **options)
    one, per_layer = (
        _rows(tmp_path / "one" / "out" / "results.csv"),
        _rows(tmp_path / "per_layer" / "out" / "results.csv"),
    )
    assert [r["method"] for r in one] == [r["method"] for r in per_layer] and len(one) == 2 * len(every_site)
    for a, b in zip(one, per_layer):
        numbers = [float(a[c]) for c in ("odds", "iia", "control_odds", "control_iia")]
        again = [float(b[c]) for c in ("odds", "iia", "control_odds", "control_iia")]
        if a["method"] == "das":
            assert numbers == pytest.approx(again, rel=1e-4, abs=1e-6)
        else:
            assert a == b


def test_a_rerun_trains_only_the_missing_das_sites(tmp_path, tiny_lm_dir, monkeypatch):
    from safetensors.torch import load_file, save_file

    lm_dir = tiny_lm_dir("llama")
    _run(tmp_path, lm_dir, methods=["das"], layers=[0, 1])
    out = tmp_path / "out"
    first = _rows(out / "results.csv")
    kept = load_file(out / "das" / "agr_sv_num_pp_0.safetensors")
    save_file({r: w for r, w in kept.items() if r != "prep"}, out / "das" / "agr_sv_num_pp_0.safetensors")
    (out / "das" / "agr_sv_num_pp_1.safetensors").unlink()
    for name in ("results.csv", "results.sqlite"):
        (out / name).unlink()
    calls, progress, train_das = [], [], training.train_das
    monkeypatch.setattr(
        training,
        "train_das",
        lambda datas, *a, **k: (
            calls.append(sorted(datas)) or progress.append(k["progress"]) or train_das(datas, *a, **k)
        ),
    )
    _run(tmp_path, lm_dir, methods=["das"], layers=[0, 1])
    regions = ["The", "subject", "prep", "the", "object"]
    assert calls == [sorted([(0, "prep")] + [(1, region) for region in regions])]  # in one loop
    assert progress == [out / "das" / "progress" / "agr_sv_num_pp"]  # saved as it trains, gone once done
    assert not list((out / "das").glob("progress/*"))
    again = load_file(out / "das" / "agr_sv_num_pp_0.safetensors")
    assert set(again) == set(regions) and all(torch.equal(again[r], kept[r]) for r in regions if r != "prep")
    # a site trained in a smaller stack gets the same subspace, to float rounding
    torch.testing.assert_close(again["prep"], kept["prep"], rtol=1e-4, atol=1e-6)
    assert [float(r["odds"]) for r in _rows(out / "results.csv")] == pytest.approx(
        [float(r["odds"]) for r in first], abs=1e-6
    )


def test_an_interrupted_das_loop_resumes_from_its_progress(tmp_path, tiny_lm_dir, monkeypatch):
    """The DAS loop killed after 3 of its 12 steps, rerun, takes the last 9 from the saved progress
    (weights, Adam moments, schedules, each site's place in its shuffled batches) and ends where
    the loop run whole does; the progress file is gone after."""
    from datetime import timedelta

    from lit_interventions.callbacks.resume import SaveProgress
    from lit_interventions.core.cache import ActivationCache
    from lit_interventions.core.lm import load_lm
    from lit_interventions.modules.multisite import MultiSiteInterchangeModule

    lm_dir = tiny_lm_dir("llama")
    datas = {
        (layer, region): _region_data("agr_sv_num_pp", None, lm_dir, region, None, {"train_pairs": 24, "eval_pairs": 2})
        for layer in (0, 2)
        for region in ("subject", "prep")
    }
    cache = ActivationCache(load_lm(lm_dir), [0, 2])
    step, steps = MultiSiteInterchangeModule.training_step, []
    monkeypatch.setattr(MultiSiteInterchangeModule, "training_step", lambda self, *a: steps.append(1) or step(self, *a))
    whole = training.train_das(datas, lm_dir, cache, seed=1)
    assert len(steps) == 12  # 24 pairs, both ways, in batches of 4

    class Killed(Exception):
        pass

    save = SaveProgress.on_train_batch_end

    def save_then_die_at_3(self, trainer, *args):
        save(self, trainer, *args)
        if trainer.lightning_module._steps == 3:
            raise Killed

    monkeypatch.setattr(SaveProgress, "on_train_batch_end", save_then_die_at_3)
    with pytest.raises(Killed):
        training.train_das(datas, lm_dir, cache, seed=1, progress=tmp_path / "agr", every=timedelta(0))
    assert len(list(tmp_path.glob("agr-*.ckpt"))) == 1
    monkeypatch.setattr(SaveProgress, "on_train_batch_end", save)
    steps.clear()
    training.train_das(datas, lm_dir, cache, seed=2, progress=tmp_path / "agr")  # another setup: not resumed
    assert len(steps) == 12 and len(list(tmp_path.glob("agr-*.ckpt"))) == 1
    steps.clear()
    resumed = training.train_das(datas, lm_dir, cache, seed=1, progress=tmp_path / "agr")
    assert len(steps) == 9 and not list(tmp_path.glob("agr-*"))
    assert set(resumed) == set(datas)
    for site in datas:
        torch.testing.assert_close(resumed[site].basis, whole[site].basis, rtol=0, atol=1e-6)
    fresh = MultiSiteInterchangeModule(lm=lm_dir, grid=list(datas), seed=1).trained()
    assert not torch.allclose(fresh[(0, "prep")].basis, whole[(0, "prep")].basis, atol=1e-3)  # training moved it


def test_das_does_not_train_sites_no_pair_differs_at(tiny_lm_dir, monkeypatch):
    # Region "The" comes before every pair's first difference: under causal attention its base and
    # source states are equal at every layer, so any subspace leaves its rows as they are (f* = f(b)).
    # The loop does not run it: it keeps its initial subspace. The other sites train.
    from lit_interventions.core.cache import ActivationCache
    from lit_interventions.core.lm import load_lm
    from lit_interventions.modules.multisite import MultiSiteInterchangeModule

    lm_dir = tiny_lm_dir("llama")
    datas = {
        (layer, region): _region_data("agr_sv_num_pp", None, lm_dir, region, None, {"train_pairs": 24, "eval_pairs": 2})
        for layer in (0, 2)
        for region in ("The", "subject")
    }
    cache = ActivationCache(load_lm(lm_dir), [0, 2])
    assert training.unchanged_sites(datas, cache) == {(0, "The"), (2, "The")}
    looped, attach = [], MultiSiteInterchangeModule.attach
    monkeypatch.setattr(
        MultiSiteInterchangeModule,
        "attach",
        lambda self, group, *a, **k: looped.append(sorted(group)) or attach(self, group, *a, **k),
    )
    trained = training.train_das(datas, lm_dir, cache, seed=1)
    assert looped == [[(0, "subject"), (2, "subject")]] and set(trained) == set(datas)
    fresh = MultiSiteInterchangeModule(lm=lm_dir, grid=list(datas), seed=1).trained()
    for site in ((0, "The"), (2, "The")):
        assert torch.equal(trained[site].basis, fresh[site].basis)
    assert not torch.allclose(trained[(0, "subject")].basis, fresh[(0, "subject")].basis, atol=1e-3)


def test_a_registered_name_and_a_model_section_run_from_the_console_script(tmp_path, tiny_lm_dir):
    # {name, model}: an InterchangeModule section of DAS of rank 1 at the registered das's lr and
    # warmup is the registered das, trained in its own loop: the same odds and IIA, bit for bit
    config = {"methods": ["das", "diffmean", {"name": "mine", "model": DAS_SECTION}], "layers": [1]}
    (tmp_path / "sweep.yaml").write_text(json.dumps(config))
    done = console(
        "sweep", "causalgym", "--config", "configs/sweep_causalgym.yaml", "--config", str(tmp_path / "sweep.yaml"),
        f"--lm={tiny_lm_dir('llama')}", f"--out={tmp_path / 'out'}", "--train_pairs=10", "--eval_pairs=4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines[-4:-1]] == ["das", "diffmean", "mine"]  # the summary table
    assert lines[-1] == f"files in {tmp_path / 'out'}"
    rows = {(r["method"], r["region"]): (r["odds"], r["iia"]) for r in _rows(tmp_path / "out" / "results.csv")}
    regions = ["The", "subject", "prep", "the", "object"]
    assert sorted(rows) == sorted((m, r) for m in ("das", "diffmean", "mine") for r in regions)
    assert all(rows[("mine", r)] == rows[("das", r)] for r in regions)
    assert any(float(rows[("mine", r)][0]) != 0.0 for r in regions)
    assert (tmp_path / "out" / "mine" / "agr_sv_num_pp_1.safetensors").is_file()


@pytest.mark.parametrize(
    "methods",
    [
        [{"name": "das", "class_path": "lit_interventions.interventions.rotation.RotatedSpaceIntervention"}],
        ["diffmean", {"name": "mine", "model": DAS_SECTION, "lr": 0.01}],
    ],
)
def test_the_class_path_form_is_one_error_line_showing_the_form_before_the_lm_loads(tmp_path, methods):
    (tmp_path / "sweep.yaml").write_text(json.dumps({"methods": methods}))
    refused = console(
        "sweep", "causalgym", "--config", "configs/sweep_causalgym.yaml", "--config", str(tmp_path / "sweep.yaml"),
        f"--lm={tmp_path / 'no_such_lm'}", f"--out={tmp_path / 'out'}",
    )  # fmt: skip  # no LM there: the refusal comes first
    assert refused.returncode == 2 and refused.stdout == ""
    got = sorted(next(m for m in methods if isinstance(m, dict)))
    assert refused.stderr.splitlines() == [
        f"error: a method is a registered name ({', '.join(sweep.registered_methods())}) or {{name: NAME, model: "
        f"{{class_path, init_args}}}} (train.py's model section); got {got}"
    ]
    assert not (tmp_path / "out").exists()
