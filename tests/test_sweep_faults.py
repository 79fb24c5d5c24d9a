"""The studies write their results first and their figures last, every file whole: a figure that
cannot be written (a full disk, simulated: `Figure.savefig` raising ENOSPC) is one `error:` line
naming it and exit status 1, the results kept and a rerun drawing it without recomputing; a
results.sqlite that is not a results database is one line naming it and what to do, exit status 2,
before any model loads."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from lit_interventions.artifacts.plots import FigureNotWritten
from lit_interventions.artifacts.results import ResultsStore
from lit_interventions.studies import calm, ravel_sweep, steer
from lit_interventions.studies import causalgym_sweep as sweep
from tests.helpers import csv_rows
from tests.test_ravel_sweep import tiny_sweep  # noqa: F401  (the RAVEL sweep's tiny setup)

ROOT = Path(__file__).resolve().parents[1]
NO_SPACE = "No space left on device"
WHAT_TO_DO = (
    "delete it (a rerun imports the rows of the CSV files beside it and redoes the rest) or choose another --out"
)


def _args(lm: str, out: Path) -> list[str]:
    return [
        "--config=configs/sweep_causalgym.yaml",
        f"--lm={lm}",
        "--methods=[diffmean,vanilla]",
        "--layers=[0,2]",
        f"--out={out}",
        "--train_pairs=10",
        "--eval_pairs=4",
    ]


def _full_disk(monkeypatch) -> list[str]:
    """Every figure's write fails as on a full disk (the CSVs, JSON and database are written as
    usual); the names of the files it was asked to write."""
    asked = []

    def savefig(self, fname, *args, **kwargs):
        asked.append(Path(fname).name)
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return asked


def _figure_line(path: Path, others: int = 0) -> str:
    more = f" (nor {others} more)" if others else ""
    return (
        f"error: figure {path} could not be written ({NO_SPACE}){more}; the results are written: rerun the same "
        "command to draw the figures once there is room (nothing is recomputed)"
    )


@pytest.fixture(scope="module")
def reference(tiny_lm_dir, tmp_path_factory) -> Path:
    """The same CausalGym sweep with room for everything."""
    out = tmp_path_factory.mktemp("reference") / "out"
    sweep.main(_args(tiny_lm_dir("llama"), out))
    return out


def test_a_full_disk_keeps_the_causalgym_results_and_names_the_figure(
    reference, tmp_path, tiny_lm_dir, monkeypatch, capsys
):
    out = tmp_path / "out"
    asked = _full_disk(monkeypatch)
    with pytest.raises(SystemExit) as failed:
        sweep.main(_args(tiny_lm_dir("llama"), out))
    assert failed.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert err.rstrip("\n").splitlines()[-1] == _figure_line(out / "heatmaps" / "agr_sv_num_pp_diffmean.png", 1)
    # every figure tried, each through a temporary file beside it
    assert [name.split(".png.")[0] for name in asked] == [".agr_sv_num_pp_diffmean", ".agr_sv_num_pp_vanilla"]
    for name in ("results.csv", "summary.csv"):  # the results, as with room for everything
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert not list(out.rglob("*.png")) and not list(out.rglob("*.tmp"))

    monkeypatch.undo()  # room again: the rerun draws the figures, and computes nothing
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("the rerun loaded the model"))
    sweep.main(_args(tiny_lm_dir("llama"), out))
    for name in ("agr_sv_num_pp_diffmean.png", "agr_sv_num_pp_vanilla.png"):
        assert (out / "heatmaps" / name).read_bytes() == (reference / "heatmaps" / name).read_bytes()
    assert (out / "results.csv").read_bytes() == (reference / "results.csv").read_bytes()


def test_a_full_disk_as_a_command_is_one_line_and_exit_status_1(reference, tmp_path, tiny_lm_dir):
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import errno, sys
        from matplotlib.figure import Figure

        def savefig(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, {NO_SPACE!r})

        Figure.savefig = savefig
        from lit_interventions.cli.commands import main
        sys.exit(main(["sweep", "causalgym", *{_args(tiny_lm_dir("llama"), out)!r}]))
    """)
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}  # stderr: nothing but the line
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert done.stderr == _figure_line(out / "heatmaps" / "agr_sv_num_pp_diffmean.png", 1) + "\n"
    assert csv_rows(out / "summary.csv") == csv_rows(reference / "summary.csv")
    assert csv_rows(out / "results.csv") == csv_rows(reference / "results.csv")


def test_a_full_disk_keeps_the_ravel_results(tiny_sweep, monkeypatch, capsys):  # noqa: F811
    args, out = tiny_sweep
    _full_disk(monkeypatch)
    with pytest.raises(SystemExit) as failed:
        ravel_sweep.main([*args, "--methods=[full_swap]"])
    assert failed.value.code == 1
    err = capsys.readouterr().err
    assert err.rstrip("\n").splitlines()[-1] == _figure_line(out / "full_swap_changes.png")
    assert [(r["method"], r["attribute"]) for r in csv_rows(out / "summary.csv")] == [
        ("full_swap", "Country"),
        ("full_swap", "Continent"),
    ]
    assert [r["attribute"] for r in csv_rows(out / "table.csv")] == ["average"]
    assert csv_rows(out / "changes.csv") and not list(out.glob("*.png")) and not list(out.glob(".*.tmp"))


def test_a_full_disk_keeps_the_steering_csvs(tmp_path, monkeypatch):
    rows = [
        {"method": "m", "concept": c, "factor": f, "half": h, **dict.fromkeys(steer.SCORES, f)}
        for c in ("dogs", "rivers")
        for f in (0.5, 1.0)
        for h in ("select", "report")
    ]
    cells = {(c, f) for c in ("dogs", "rivers") for f in (0.5, 1.0)}
    _full_disk(monkeypatch)
    with pytest.raises(FigureNotWritten) as failed:
        steer.write_report(tmp_path, rows, cells)
    assert (failed.value.path, failed.value.reason.errno) == (tmp_path / "steering.png", errno.ENOSPC)
    assert [(r["concept"], r["factor"]) for r in csv_rows(tmp_path / "summary.csv")] == [
        ("dogs", "1.0"),
        ("rivers", "1.0"),
    ]
    assert len(csv_rows(tmp_path / "factors.csv")) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["factors.csv", "summary.csv"]


def test_calm_results_are_whole_or_as_they_were(tmp_path, monkeypatch):
    first = [{"task": "Country", "method": "pgd", "competence": 0.5}]
    calm.write_results(tmp_path, first, first, {"lm": "x"}, {})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["results.csv", "summary.csv", "summary.json"]
    assert json.loads(before["summary.json"])["results"] == first

    def full(fd):
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(os, "fsync", full)  # each file's last write fails, as on a full disk
    second = [{"task": "Country", "method": "pgd", "competence": 0.75}]
    with pytest.raises(OSError, match=NO_SPACE):
        calm.write_results(tmp_path, second, second, {"lm": "x"}, {})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no half file, no temporary


def _garbage(path: Path, kind: str) -> str:
    """Write a results.sqlite that is not one; what SQLite says of it."""
    if kind == "random bytes":
        path.write_bytes(bytes(range(256)) * 64)
        return "file is not a database"
    if kind == "text":
        path.write_text("task,method,layer\nagr_sv_num_pp,das,0\n")
        return "file is not a database"
    db = sqlite3.connect(path)  # another program's database, with a table of the same name
    db.execute("CREATE TABLE results (id INTEGER, payload TEXT)")
    db.commit()
    db.close()
    return ""


@pytest.mark.parametrize("kind", ["random bytes", "text", "another program's table"])
def test_a_garbage_results_sqlite_is_one_line_before_any_model_loads(tmp_path, tiny_lm_dir, monkeypatch, capsys, kind):
    out = tmp_path / "out"
    out.mkdir()
    db = out / "results.sqlite"
    said = _garbage(db, kind)
    before = db.read_bytes()
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as refused:
        sweep.main(_args(tiny_lm_dir("llama"), out))
    assert refused.value.code == 2
    if said:
        expected = f"error: {db} is not a results database ({said}); {WHAT_TO_DO}\n"
    else:
        expected = (
            f"error: {db} holds a table 'results' with columns ['id', 'payload'], not "
            f"{sweep.RESULT_COLUMNS}: it is another program's database; {WHAT_TO_DO}\n"
        )
    assert capsys.readouterr().err == expected
    assert db.read_bytes() == before and not (out / "meta.json").exists()  # nothing written


def test_a_garbage_results_sqlite_stops_the_ravel_sweep_too(tiny_sweep, monkeypatch, capsys):  # noqa: F811
    args, out = tiny_sweep
    out.mkdir()
    _garbage(out / "results.sqlite", "text")
    monkeypatch.setattr(ravel_sweep, "run_cell", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as refused:
        ravel_sweep.main([*args, "--methods=[full_swap]"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {out / 'results.sqlite'} is not a results database (file is not a database); {WHAT_TO_DO}\n"
    )


def test_an_empty_results_sqlite_is_a_new_database_and_a_rank_store_is_checked_too(tmp_path):
    (tmp_path / "results.sqlite").touch()
    ResultsStore(tmp_path, [sweep.RESULTS]).close()  # an empty file is SQLite's empty database
    rank = tmp_path / "ranks" / "rank-1"
    rank.mkdir(parents=True)
    _garbage(rank / "results.sqlite", "random bytes")
    with pytest.raises(ValueError, match=rf"^{rank / 'results.sqlite'} is not a results database"):
        ResultsStore(rank, [sweep.RESULTS])
