"""Nothing lost, nothing silent: damaged results files, two runs on one --out, rejected runs, too
many pairs asked for, and a crash in the middle of writing a unit."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from lit_interventions.datamodules.templates import load_task, sample_pairs

from lit_interventions.artifacts import results
from lit_interventions.artifacts.results import OutDirBusy, OutDirLock, ResultsStore, Table
from lit_interventions.studies import causalgym_scoring as scoring
from lit_interventions.studies import causalgym_sweep as sweep
from tests.helpers import csv_rows as _rows
from tests.helpers import run_command


def _run(out, lm_dir, **kwargs):
    options = dict(
        tasks="agr_sv_num_pp",
        methods=["diffmean", "vanilla"],
        layers=[0],
        lm=lm_dir,
        out=str(out),
        train_pairs=10,
        eval_pairs=4,
    )
    return sweep.run_sweep(**{**options, **kwargs})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_lm_dir):
    """An undamaged run: its directory, its results.csv bytes and rows."""
    out = tmp_path_factory.mktemp("reference") / "out"
    _run(out, tiny_lm_dir("llama"))
    return out, (out / "results.csv").read_bytes(), _rows(out / "results.csv")


def _old_run(reference, tmp_path, data: bytes):
    """A directory as an older version left it: meta.json and results.csv, no database."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(reference[0] / "meta.json", out / "meta.json")
    (out / "results.csv").write_bytes(data)
    return out


def _cut(data: bytes, after: bytes, extra: int = 0) -> bytes:
    """The file cut `extra` bytes after `after` in its last line."""
    start = data.rstrip(b"\r\n").rfind(b"\n") + 1
    return data[: data.index(after, start) + len(after) + extra]


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: _cut(d, b",object,", 4),  # inside the odds: kept as a wrong number before
        lambda d: _cut(d, b",van"),  # inside a method name: the next row was glued onto it
        lambda d: _cut(d, b",object,"),  # right after a comma
        lambda d: d.rstrip(b"\r\n"),  # every field there, the newline missing
        lambda d: _cut(d, b",van") + d[d.index(b"\n") + 1 :].split(b"\n")[0] + b"\n",  # a row glued onto a cut one
    ],
    ids=["in-number", "in-method", "after-comma", "no-newline", "glued"],
)
def test_damaged_tail_is_reported_and_recomputed(reference, tmp_path, tiny_lm_dir, damage):
    data = damage(reference[1])
    last = data.count(b"\n") + (not data.endswith(b"\n"))  # the damaged line's number
    out = _old_run(reference, tmp_path, data)
    with pytest.warns(UserWarning, match=rf"results\.csv: line {last} is incomplete or damaged"):
        _run(out, tiny_lm_dir("llama"))
    assert _rows(out / "results.csv") == reference[2]
    assert (out / "results.csv").read_bytes() == reference[1]


@pytest.mark.parametrize(
    "data,message", [(b"", "is empty"), (None, "line 1 is not the header")], ids=["empty", "headerless"]
)
def test_a_csv_with_nothing_usable_is_recomputed(reference, tmp_path, tiny_lm_dir, data, message):
    if data is None:  # rows appended after the file was truncated to 0 bytes: no header
        data = reference[1].split(b"\n", 1)[1]
    out = _old_run(reference, tmp_path, data)
    with pytest.warns(UserWarning, match=message):
        _run(out, tiny_lm_dir("llama"))
    assert (out / "results.csv").read_bytes() == reference[1]


def test_an_intact_old_csv_is_imported_and_nothing_recomputed(reference, tmp_path, tiny_lm_dir, monkeypatch):
    out = _old_run(reference, tmp_path, reference[1])
    monkeypatch.setattr(scoring, "fit_site", lambda *a, **k: pytest.fail("finished sites must be skipped"))
    _run(out, tiny_lm_dir("llama"))
    assert (out / "results.csv").read_bytes() == reference[1]
    (out / "results.csv").write_bytes(b"garbage")  # the database, not the export, is the record now
    _run(out, tiny_lm_dir("llama"))
    assert (out / "results.csv").read_bytes() == reference[1]


def test_a_second_run_on_the_same_out_is_refused(reference, tmp_path, tiny_lm_dir):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from lit_interventions.artifacts.results import OutDirLock
        OutDirLock({str(out)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutDirBusy, match=rf"^{out} is in use by another run \(pid {holder.pid}\); wait for it"):
            _run(out, tiny_lm_dir("llama"))
        assert not (out / "meta.json").exists()
    finally:
        holder.kill()
        holder.wait()
    _run(out, tiny_lm_dir("llama"))  # the lock died with its holder
    assert _rows(out / "results.csv") == reference[2]


def test_the_command_line_says_so_in_one_line(tmp_path, tiny_lm_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    lock = OutDirLock(out).acquire()  # a second holder in this process: flock is per open file
    try:
        with pytest.raises(SystemExit) as exit_info:
            sweep.main(
                [
                    "--config",
                    "configs/sweep_causalgym.yaml",
                    f"--lm={tiny_lm_dir('llama')}",
                    "--methods=[diffmean]",
                    "--layers=[0]",
                    f"--out={out}",
                    "--train_pairs=10",
                    "--eval_pairs=4",
                ]
            )
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"error: {out} is in use by another run (pid {os.getpid()})" in err and err.count("\n") == 1


@pytest.mark.parametrize("stacked_scoring", [True, False], ids=["stacked", "site_by_site"])
def test_the_lock_is_released_when_the_run_fails(tmp_path, tiny_lm_dir, monkeypatch, stacked_scoring):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(scoring, "fit_site", broken)  # both scoring paths fit every site first
    with pytest.raises(RuntimeError, match="out of memory"):
        _run(tmp_path / "out", tiny_lm_dir("llama"), stacked_scoring=stacked_scoring)
    OutDirLock(tmp_path / "out").acquire().release()


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"dtype": "float8"}, r"dtype='float8' is not supported"),
        ({"methods": ["magic"]}, r"Unknown methods \['magic'\]"),
        ({"eval_pairs": 0}, r"eval_pairs=0 must be a positive integer"),
    ],
)
def test_a_rejected_run_leaves_nothing_that_blocks_the_corrected_one(reference, tmp_path, tiny_lm_dir, bad, message):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        _run(out, tiny_lm_dir("llama"), **bad)
    assert not (out / "meta.json").exists() and not (out / "results.sqlite").exists()
    _run(out, tiny_lm_dir("llama"))
    assert _rows(out / "results.csv") == reference[2]


def test_too_many_pairs_are_refused_at_once(tmp_path, tiny_lm_dir, monkeypatch):
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("refused before the model is loaded"))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"train_pairs=1000000 but task 'agr_sv_num_pp' has only 66560 distinct pairs"):
        _run(tmp_path / "out", tiny_lm_dir("llama"), train_pairs=1_000_000)
    with pytest.raises(ValueError, match=r"1000000 pairs asked for, but task 'agr_sv_num_pp' has only 66560 distinct"):
        sample_pairs(load_task("agr_sv_num_pp"), 1_000_000, seed=0)
    assert time.perf_counter() - start < 5 and not (tmp_path / "out" / "meta.json").exists()


NARROW = {  # 4 sentences, so 4 distinct pairs: 4 training pairs use every sentence, none is left for eval
    "templates": ["{subj} ran and"],
    "label": "subj",
    "labels": {"sg": ["is"], "pl": ["are"]},
    "variables": {"subj": {"sg": ["The dog", "A cat"], "pl": ["The dogs", "Two cats"]}},
}
ROOMY = {
    "templates": ["{subj} {verb} and"],
    "label": "subj",
    "labels": {"sg": ["is"], "pl": ["are"]},
    "variables": {
        "subj": {"sg": ["The dog", "A cat", "The bird"], "pl": ["The dogs", "Two cats", "The birds"]},
        "verb": ["ran", "sat", "slept", "ate", "sang"],
    },
}


def test_a_task_whose_splits_cannot_be_drawn_is_refused_before_any_work(tmp_path, tiny_lm_dir):
    # `narrow` passes the distinct-pairs check (4 train, 2 eval of 4) but its eval split cannot
    # avoid the training sentences. It comes after `roomy`, so a sweep that drew a task's pairs
    # only on reaching it would train and score `roomy` first.
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps({"roomy": ROOMY, "narrow": NARROW}))
    out = tmp_path / "out"
    args = ["--templates", str(templates), "--tasks", "all", "--methods", "[das,probe]", "--layers", "[0]"]
    done = run_command(
        "sweep",
        "causalgym",
        *args,
        "--lm",
        str(tiny_lm_dir("llama")),
        "--out",
        str(out),
        "--train_pairs",
        "4",
        "--eval_pairs",
        "2",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        "error: eval split of task 'narrow' (train_pairs=4, eval_pairs=2): Task 'narrow' yields only 0 distinct "
        "pairs of the 2 asked for with no sentence among the other splits' 4; add options to its variables or "
        "ask for fewer pairs."
    )
    assert not out.exists()


def test_distinct_pairs_is_the_number_sampling_can_reach():
    task = load_task("garden_npz_obj")  # 8192 distinct pairs: all of them can be drawn, one more cannot
    assert len(sample_pairs(task, task.distinct_pairs(), seed=0)) == 2 * task.distinct_pairs()
    with pytest.raises(ValueError, match=f"has only {task.distinct_pairs()} distinct pairs"):
        sample_pairs(task, task.distinct_pairs() + 1, seed=0)


# --- the store itself: a crash inside a unit ---

TABLE = Table("results", ("name", "value"), key=("name",), numeric=("value",))


def test_an_exception_inside_a_unit_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path, [TABLE])
    store.add({"results": [{"name": "a", "value": 1.0}]})
    before = (tmp_path / "results.csv").read_bytes()
    text, calls = results._text, []

    def failing(value):
        calls.append(value)
        if len(calls) > 3:  # the second row of the unit: the first is already inserted
            raise KeyboardInterrupt
        return text(value)

    monkeypatch.setattr(results, "_text", failing)
    with pytest.raises(KeyboardInterrupt):
        store.add({"results": [{"name": "b", "value": 2.0}, {"name": "c", "value": 3.0}]})
    monkeypatch.setattr(results, "_text", text)
    assert store.rows("results") == [{"name": "a", "value": "1.0"}]
    assert (tmp_path / "results.csv").read_bytes() == before
    store.add({"results": [{"name": "b", "value": 2.0}, {"name": "c", "value": 3.0}]})
    store.close()
    assert [r["name"] for r in _rows(tmp_path / "results.csv")] == ["a", "b", "c"]


def test_a_process_killed_inside_a_unit_loses_only_that_unit(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from lit_interventions.artifacts import results
        from tests.test_faults import TABLE
        store = results.ResultsStore({str(tmp_path)!r}, [TABLE])
        store.add({{"results": [{{"name": "a", "value": 1.0}}]}})
        text, calls = results._text, []
        def dying(value):
            calls.append(value)
            if len(calls) > 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return text(value)
        results._text = dying
        store.add({{"results": [{{"name": "b", "value": 2.0}}, {{"name": "c", "value": 3.0}}]}})
    """)
    killed = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd())
    assert killed.returncode == -9
    store = ResultsStore(tmp_path, [TABLE])
    assert store.rows("results") == [{"name": "a", "value": "1.0"}]
    assert _rows(tmp_path / "results.csv") == [{"name": "a", "value": "1.0"}]
    store.close()


def test_a_replaced_row_keeps_one_copy_and_an_old_doubled_csv_is_deduplicated(tmp_path):
    (tmp_path / "results.csv").write_text("name,value\r\na,1.0\r\nb,2.0\r\na,1.5\r\n")  # two runs at once, before
    store = ResultsStore(tmp_path, [TABLE])
    assert store.rows("results") == [{"name": "b", "value": "2.0"}, {"name": "a", "value": "1.5"}]
    store.add({"results": [{"name": "b", "value": 2.5}]})
    assert _rows(tmp_path / "results.csv") == [{"name": "a", "value": "1.5"}, {"name": "b", "value": "2.5"}]
    store.close()


def test_a_damaged_meta_json_is_named(tmp_path):
    (tmp_path / "meta.json").write_text('{"lm": "x", "dt')
    with pytest.raises(ValueError, match=r"meta\.json is damaged .*; delete it if .* or choose another --out"):
        results.claim_out_dir(tmp_path, {"lm": "x"})


def test_a_cut_generations_line_is_reported_and_cut_off(tmp_path):
    from lit_interventions.studies.steer import read_generations

    path = tmp_path / "generations.jsonl"
    whole = '{"concept": "a", "factor": 1.0}\n'
    path.write_text(whole + '{"concept": "a", "fac')
    with pytest.warns(UserWarning, match=r"generations\.jsonl: line 2 is incomplete or damaged"):
        assert read_generations(path) == [{"concept": "a", "factor": 1.0}]
    assert path.read_text() == whole  # the redone cell is appended after a whole line, not glued onto a cut one


def test_runs_started_at_once_on_one_root_reserve_distinct_versions(tmp_path):
    """`reserved_version` makes version_N itself: eight runs asking at once get eight directories,
    after the highest one there (a gap is not reused)."""
    from concurrent.futures import ThreadPoolExecutor

    from lit_interventions.cli.lightning import reserved_version

    (tmp_path / "task" / "version_0").mkdir(parents=True)
    (tmp_path / "task" / "version_2").mkdir()
    with ThreadPoolExecutor(8) as pool:
        versions = sorted(pool.map(lambda _: reserved_version(tmp_path, "task"), range(8)))
    assert versions == list(range(3, 11))
    assert sorted(p.name for p in (tmp_path / "task").iterdir()) == sorted(f"version_{n}" for n in [0, 2, *versions])


def test_two_fits_on_one_root_at_once_each_write_a_run_of_their_own(tmp_path, tiny_lm_dir):
    args = ["train.py", "fit", "--config", "configs/das.yaml", f"--model.lm={tiny_lm_dir('gpt2')}", "--model.layer=1"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--data.train_pairs=12", "--data.eval_pairs=4"]
    args += ["--trainer.enable_progress_bar=false", "--trainer.max_epochs=1"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [
        subprocess.Popen([sys.executable, *args], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    made = sorted(p.name for p in (tmp_path / "agr_sv_num_pp" / "layer1").iterdir())
    assert made == ["version_0", "version_1"]
    for version in made:  # each run whole: its own weights, card and checkpoint
        files = {p.name for p in (tmp_path / "agr_sv_num_pp" / "layer1" / version).iterdir()}
        assert {"intervention.safetensors", "config.json", "checkpoints"} <= files
