"""`lit-interventions sweep ravel --config configs/sweep_ravel.yaml` on a tiny model: the
summary, the change matrix and its heatmap, resuming, and bad input before any work."""

import csv
import json

import pytest
from lit_interventions.datamodules.ravel import RavelDataModule

from lit_interventions.interventions.registry import registered_methods
from lit_interventions.studies import ravel_sweep as sweep
from lit_interventions.studies.ravel_sweep import run_ravel_sweep
from tests.test_ravel_data import oracle
from tests.test_sweep import console

SWAP = {  # train.py's model section of the full swap: the sweep sets lm and layer, RAVEL's objective
    "class_path": "lit_interventions.modules.interchange.InterchangeModule",
    "init_args": {"intervention": {"class_path": "lit_interventions.interventions.featurizers.FullVectorSwap"}},
}


@pytest.fixture
def tiny_sweep(tmp_path, tiny_lm_dir, monkeypatch):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    lm = tiny_lm_dir("llama")
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    args = [
        "--config",
        "configs/sweep_ravel.yaml",
        f"--lm={lm}",
        "--layer=1",
        "--k=4",
        "--train_size=16",
        "--eval_size=12",
        "--max_candidates=40",
        "--attributes=[Country, Continent]",
        f"--out={tmp_path / 'out'}",
    ]
    return args, tmp_path / "out"


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_sweep_writes_summary_changes_and_heatmaps_then_resumes(tiny_sweep, monkeypatch, capsys):
    args, out = tiny_sweep
    sweep.main([*args, "--methods=[full_swap, das]"])
    summary = _rows(out / "summary.csv")
    assert [(r["method"], r["attribute"]) for r in summary] == [
        ("full_swap", "Country"),
        ("full_swap", "Continent"),
        ("das", "Country"),
        ("das", "Continent"),
    ]
    for r in summary:
        cause, iso, dis = float(r["cause"]), float(r["iso"]), float(r["disentangle"])
        assert 0 <= cause <= 1 and 0 <= iso <= 1 and dis == pytest.approx((cause + iso) / 2, abs=1e-6)
    changes = _rows(out / "changes.csv")
    assert {(c["method"], c["intervened"], c["queried"]) for c in changes} >= {
        ("das", "Country", "Language"),
        ("das", "Continent", "Country"),
    }
    assert all(0 <= float(c["change_rate"]) <= 1 for c in changes)
    assert (out / "das_changes.png").is_file() and (out / "full_swap_changes.png").is_file()
    table = _rows(out / "table.csv")
    assert [r["attribute"] for r in table] == ["average", "average"]
    printed = capsys.readouterr().out
    assert any(line.split()[:2] == ["das", "average"] for line in printed.splitlines()), printed

    def must_not_train(*a, **k):
        raise AssertionError("finished cells must be skipped")

    monkeypatch.setattr("lit_interventions.studies.ravel_sweep.run_cell", must_not_train)
    sweep.main([*args, "--methods=[full_swap, das]"])
    assert len(_rows(out / "summary.csv")) == 4


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--methods=[rlap]"], "Unknown methods ['rlap']"),
        (["--attributes=[Mayor]"], "Unknown attributes ['Mayor']"),
        (["--entity_type=planet"], "planet"),
        (["--layer=9"], "out of range"),
        (["--entity_templates=test"], "entity_templates='test'; choose one of all, train"),
        (["--entity_templates=train", "--split=context"], "applies to split='entity'"),
    ],
)
def test_bad_input_fails_before_any_work(tiny_sweep, monkeypatch, capsys, extra, message):
    args, out = tiny_sweep
    monkeypatch.setattr(
        "lit_interventions.studies.ravel_sweep.run_cell", lambda *a, **k: pytest.fail("no work on bad input")
    )
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([*args, *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_official_entity_templates_are_recorded_and_a_resume_at_the_other_is_refused(tiny_sweep, monkeypatch):
    args, out = tiny_sweep
    seen = []
    real = RavelDataModule.setup

    def recording(self, *a, **k):
        seen.append(self.hparams.entity_templates)
        return real(self, *a, **k)

    monkeypatch.setattr(RavelDataModule, "setup", recording)
    sweep.main([*args, "--methods=[full_swap]", "--attributes=[Country]", "--entity_templates=train"])
    assert seen and set(seen) == {"train"}  # every cell's data module takes the official templates
    assert json.loads((out / "meta.json").read_text())["entity_templates"] == "train"
    with pytest.raises(
        ValueError, match='holds a sweep with --entity_templates="train", this run has --entity_templates="all"'
    ):
        run_ravel_sweep(methods=["full_swap"], attributes=["Country"], lm=args[2].split("=", 1)[1], layer=1, k=4,
                        out=str(out), train_size=16, eval_size=12, max_candidates=40)  # fmt: skip


def test_out_dir_of_another_model_is_refused(tiny_sweep, tiny_lm_dir, monkeypatch):
    args, out = tiny_sweep
    sweep.main([*args, "--methods=[full_swap]", "--attributes=[Country]"])
    with pytest.raises(ValueError, match="Choose another --out"):
        run_ravel_sweep(
            methods=["full_swap"],
            attributes=["Country"],
            lm=tiny_lm_dir("gpt2"),
            layer=1,
            k=4,
            out=str(out),
            train_size=16,
            eval_size=12,
            max_candidates=40,
        )


def test_a_registered_name_and_a_model_section_run_from_the_console_script(tiny_sweep, tmp_path, capsys):
    args, out = tiny_sweep
    sweep.main([*args, "--methods=[full_swap]", "--attributes=[Country]"])  # the oracle's answers, cached
    methods = json.dumps(["lda", {"name": "swap", "model": SWAP}])  # lda: no configs/ravel/lda.yaml
    done = console(
        "sweep", "ravel", *args, f"--methods={methods}", "--attributes=[Country]", f"--out={tmp_path / 'new'}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line.split()[:2] for line in done.stdout.splitlines()]
    assert ["lda", "average"] in printed and ["swap", "average"] in printed
    rows = {r["method"]: r for r in _rows(tmp_path / "new" / "summary.csv")}
    assert sorted(rows) == ["lda", "swap"] and all(r["attribute"] == "Country" for r in rows.values())
    full_swap = _rows(out / "summary.csv")[0]  # the same swap as configs/ravel/full_swap.yaml: the same scores
    assert [rows["swap"][k] for k in ("cause", "iso", "disentangle")] == [
        full_swap[k] for k in ("cause", "iso", "disentangle")
    ]
    lda = {k: float(rows["lda"][k]) for k in ("cause", "iso", "disentangle")}
    assert lda["disentangle"] == pytest.approx((lda["cause"] + lda["iso"]) / 2, abs=1e-6)
    assert (tmp_path / "new" / "lda_changes.png").is_file()


def test_a_registered_name_without_a_config_file_runs_as_its_file_sets_it(tiny_sweep, tmp_path):
    args, out = tiny_sweep  # mdas from its registry spec (no file in tmp_path) and from configs/ravel/mdas.yaml
    both = [*args, "--methods=[mdas]", "--attributes=[Country]", "--epochs=1"]
    sweep.main([*both, f"--configs={tmp_path}", f"--out={tmp_path / 'spec'}"])
    sweep.main(both)
    spec, file = _rows(tmp_path / "spec" / "summary.csv"), _rows(out / "summary.csv")
    assert [r["method"] for r in spec] == ["mdas"] and spec == file  # bit for bit
    assert (tmp_path / "spec" / "changes.csv").read_text() == (out / "changes.csv").read_text()


@pytest.mark.parametrize(
    "methods,message",
    [
        ("[rlap]", f"Unknown methods ['rlap']; valid: {', '.join(registered_methods())} (or 'all')"),
        (
            json.dumps([{"name": "mine", "model": SWAP, "epochs": 1}]),
            f"a method is a registered name ({', '.join(registered_methods())}) or {{name: NAME, model: "
            "{class_path, init_args}} (train.py's model section); got ['epochs', 'model', 'name']",
        ),
    ],
)
def test_an_unknown_name_or_another_form_is_one_line_before_the_lm_loads(tmp_path, methods, message):
    refused = console(
        "sweep", "ravel", "--config", "configs/sweep_ravel.yaml", f"--lm={tmp_path / 'no_such_lm'}",
        f"--methods={methods}", f"--out={tmp_path / 'out'}",
    )  # fmt: skip  # no LM there: the refusal comes first
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [f"error: {message}"]
    assert not (tmp_path / "out").exists()
