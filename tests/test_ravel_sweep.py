"""`lit-interventions sweep ravel --config configs/sweep_ravel.yaml` on a tiny model: the
summary, the change matrix and its heatmap, resuming, and bad input before any work."""

import csv

import pytest
from lit_interventions.datamodules.ravel import RavelDataModule

from lit_interventions.studies import ravel_sweep as sweep
from lit_interventions.studies.ravel_sweep import run_ravel_sweep
from tests.test_ravel_data import oracle


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
