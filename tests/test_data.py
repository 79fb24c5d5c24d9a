"""The `data` command against a local HTTP server on 127.0.0.1 (never the real upstream URLs)."""

from __future__ import annotations

import hashlib
import http.server
import io
import re
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from lit_interventions.cli import data, data_registry
from lit_interventions.cli.data import ChecksumError, download, main
from lit_interventions.cli.data_registry import Dataset, Remote
from tests.helpers import free_port, run_command

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@pytest.fixture
def server(tmp_path):
    """Serves tmp_path/www on 127.0.0.1 (port 0); yields (base_url, root, paths requested)."""
    root = tmp_path / "www"
    root.mkdir()
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", root, requested
    httpd.shutdown()
    httpd.server_close()


SUITE = b'{"meta": {"name": "tiny"}, "items": []}\n'
NOTES = b"upstream notes\n"
MEMBERS = {"ravel_city_entity_attributes.json": b'{"Paris": {"Country": "France"}}', "ravel_city_x.json": b"{}"}


def _tgz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, payload in files.items():
            info = tarfile.TarInfo(f"data/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


@pytest.fixture
def tiny(server, monkeypatch):
    """A registered dataset 'tiny': a file, a renamed file, and an archive of two members."""
    base_url, root, requested = server
    (root / "suites").mkdir()
    (root / "suites" / "tiny.json").write_bytes(SUITE)
    (root / "README.md").write_bytes(NOTES)
    archive = _tgz(MEMBERS)
    (root / "data.tgz").write_bytes(archive)
    dataset = Dataset(
        name="tiny",
        description="fixture",
        base_url="http://upstream.invalid/never-used/",
        source="fixture",
        license="MIT",
        files=(
            Remote("suites/tiny.json", "tiny.json", _sha(SUITE)),
            Remote("README.md", "README.upstream.md", _sha(NOTES)),
            Remote("data.tgz", "data.tgz", _sha(archive), members={k: _sha(v) for k, v in MEMBERS.items()}),
        ),
    )
    monkeypatch.setitem(data_registry.DATASETS, "tiny", dataset)
    return base_url, root, requested


def test_download_verifies_and_writes_every_file(tiny, tmp_path):
    base_url, _, _ = tiny
    out = tmp_path / "out"
    paths = download("tiny", out, base_url=base_url)
    assert sorted(p.name for p in paths) == sorted(["tiny.json", "README.upstream.md", *MEMBERS])
    assert (out / "tiny.json").read_bytes() == SUITE
    assert (out / "README.upstream.md").read_bytes() == NOTES
    for name, payload in MEMBERS.items():
        assert (out / name).read_bytes() == payload  # extracted flat, not under data/
    assert not (out / "data.tgz").exists()  # the archive is removed once its members are checked
    assert not list(out.glob(".*.part"))  # no temporary file left


def test_corrupted_file_is_refused_with_both_hashes(tiny, tmp_path):
    base_url, root, _ = tiny
    (root / "suites" / "tiny.json").write_bytes(SUITE + b"tampered")
    out = tmp_path / "out"
    with pytest.raises(ChecksumError) as err:
        download("tiny", out, base_url=base_url)
    message = str(err.value)
    assert "tiny.json" in message
    assert _sha(SUITE) in message and _sha(SUITE + b"tampered") in message
    assert not (out / "tiny.json").exists() and not list(out.glob(".*.part"))


def test_corrupted_archive_member_is_refused(tiny, tmp_path, monkeypatch):
    base_url, root, _ = tiny
    bad = dict(MEMBERS, **{"ravel_city_x.json": b"[]"})
    archive = _tgz(bad)
    (root / "data.tgz").write_bytes(archive)
    good = data_registry.DATASETS["tiny"]
    members = {k: _sha(v) for k, v in MEMBERS.items()}
    files = (*good.files[:2], Remote("data.tgz", "data.tgz", _sha(archive), members=members))
    monkeypatch.setitem(data_registry.DATASETS, "tiny", Dataset(**{**good.__dict__, "files": files}))
    with pytest.raises(ChecksumError, match=r"ravel_city_x\.json: expected " + members["ravel_city_x.json"]):
        download("tiny", tmp_path / "out", base_url=base_url)
    assert not (tmp_path / "out" / "ravel_city_x.json").exists()


def test_rerun_skips_verified_files_and_replaces_a_changed_one(tiny, tmp_path):
    base_url, _, requested = tiny
    out = tmp_path / "out"
    download("tiny", out, base_url=base_url)
    assert len(requested) == 3
    requested.clear()
    download("tiny", out, base_url=base_url)
    assert requested == []  # everything present and verified: nothing fetched
    (out / "tiny.json").write_bytes(b"edited by hand")
    with pytest.warns(UserWarning, match="does not match its recorded sha256"):
        download("tiny", out, base_url=base_url)
    assert requested == ["/suites/tiny.json"]
    assert (out / "tiny.json").read_bytes() == SUITE


def test_file_without_hash_is_downloaded_with_a_warning(tiny, tmp_path, monkeypatch):
    base_url, _, _ = tiny
    good = data_registry.DATASETS["tiny"]
    files = (Remote("suites/tiny.json", "tiny.json", None),)
    monkeypatch.setitem(data_registry.DATASETS, "tiny", Dataset(**{**good.__dict__, "files": files}))
    with pytest.warns(UserWarning, match="no sha256 recorded for tiny.json: verification skipped"):
        download("tiny", tmp_path / "out", base_url=base_url)
    assert (tmp_path / "out" / "tiny.json").read_bytes() == SUITE


def test_missing_upstream_file_names_the_url(tiny, tmp_path):
    base_url, root, _ = tiny
    (root / "README.md").unlink()
    with pytest.raises(OSError, match=re.escape(f"could not download {base_url}README.md")):
        download("tiny", tmp_path / "out", base_url=base_url)
    assert not (tmp_path / "out" / "README.upstream.md").exists()


def test_unknown_dataset_is_a_one_line_error_listing_the_valid_ones(tmp_path, capsys):
    with pytest.raises(ValueError) as err:
        download("ravle", tmp_path)
    message = str(err.value)
    assert "\n" not in message and "'ravle'" in message
    assert all(name in message for name in ("causalgym", "syntaxgym", "ravel", "axbench-concept10"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["ravle", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_main_downloads(tiny, tmp_path, capsys):
    base_url, _, _ = tiny
    paths = main(["tiny", "--out", str(tmp_path / "out"), "--base_url", base_url])
    assert len(paths) == 4 and all(p.is_file() for p in paths)
    assert "tiny: 4 files in" in capsys.readouterr().out


def test_python_dash_m_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lit_interventions", "data", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: unknown dataset 'nope'; valid: {', '.join(data_registry.DATASETS)}"
    ]


def test_registry_is_well_formed():
    assert set(data_registry.DATASETS) == {"causalgym", "syntaxgym", "ravel", "axbench-concept10", "axbench-concept500"}
    for dataset in data_registry.DATASETS.values():
        assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/", dataset.base_url)
        names = [r.name for r in dataset.files] + [m for r in dataset.files for m in r.members]
        assert len(names) == len(set(names)), dataset.name
        for remote in dataset.files:
            for sha in [remote.sha256, *remote.members.values()]:
                assert sha is None or re.fullmatch(r"[0-9a-f]{64}", sha)
    assert len(data_registry.DATASETS["syntaxgym"].files) == 34 + 2
    assert len(data_registry.DATASETS["ravel"].files[0].members) == 25


LOCAL_COPIES = {
    "syntaxgym": SHARED / "syntaxgym",
    "ravel": SHARED / "ravel",
    "axbench-concept10": SHARED / "axbench" / "concept10_2b_l20",
}


@pytest.mark.parametrize("name", sorted(LOCAL_COPIES))
def test_registry_hashes_match_the_local_copies(name):
    folder = LOCAL_COPIES[name]
    if not folder.is_dir():
        pytest.skip(f"no local copy at {folder}; get it with: lit-interventions data {name} --out {folder}")
    dataset = data_registry.DATASETS[name]
    expected = {r.name: r.sha256 for r in dataset.files if not r.members}
    expected |= {m: sha for r in dataset.files for m, sha in r.members.items()}
    expected.pop("LICENSE", None)  # the AxBench licence sits one level up in the local copy
    for file_name, sha in expected.items():
        assert data.sha256_of(folder / file_name) == sha, file_name


# ----------------------------------------------------------------------------- a failed download leaves nothing


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failure_after_some_files_leaves_no_output_directory(tiny, tmp_path):
    """tiny.json and README arrive, the archive does not: nothing of the three is left."""
    base_url, root, requested = tiny
    (root / "data.tgz").unlink()
    out = tmp_path / "new" / "out"
    with pytest.raises(OSError, match=re.escape(f"could not download {base_url}data.tgz")):
        download("tiny", out, base_url=base_url)
    assert requested == ["/suites/tiny.json", "/README.md", "/data.tgz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["www"]  # neither out, its parent nor a .partial


def test_a_failure_leaves_the_previous_copy_as_it_was(tiny, tmp_path):
    base_url, root, _ = tiny
    out = tmp_path / "out"
    download("tiny", out, base_url=base_url)
    (out / "tiny.json").write_bytes(b"edited by hand")
    (out / "notes.txt").write_bytes(b"the user's own file")
    before = _tree(out)
    (root / "suites" / "tiny.json").write_bytes(SUITE + b"tampered")
    with pytest.warns(UserWarning, match="does not match its recorded sha256"), pytest.raises(ChecksumError):
        download("tiny", out, base_url=base_url)
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "www"]


def test_an_interrupted_download_leaves_nothing(tiny, tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) while the second file downloads."""
    base_url, _, _ = tiny
    fetch = data._fetch
    calls = []

    def interrupted(url, timeout):
        calls.append(url)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fetch(url, timeout)

    monkeypatch.setattr(data, "_fetch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        download("tiny", tmp_path / "out", base_url=base_url)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["www"]


def test_a_complete_rerun_adds_the_missing_files_beside_the_verified_ones(tiny, tmp_path):
    base_url, _, requested = tiny
    out = tmp_path / "out"
    download("tiny", out, base_url=base_url)
    (out / "README.upstream.md").unlink()
    (out / "notes.txt").write_bytes(b"the user's own file")
    requested.clear()
    download("tiny", out, base_url=base_url)
    assert requested == ["/README.md"]
    assert _tree(out) == {
        "README.upstream.md": NOTES,
        "notes.txt": b"the user's own file",
        "tiny.json": SUITE,
        **MEMBERS,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "www"]


@pytest.mark.parametrize("failure", ["missing", "tampered", "refused"])
def test_console_script_a_failed_download_is_one_line_and_leaves_no_folder(server, tmp_path, failure):
    """`lit-interventions data causalgym --out DIR` against a mirror that lacks the file, serves
    other bytes, or does not answer: exit 2, one error line, and DIR (and its parent) absent."""
    base_url, root, _ = server
    if failure == "tampered":
        (root / "data" / "templates").mkdir(parents=True)
        (root / "data" / "templates" / "syntaxgym.json").write_bytes(b'{"not": "the templates"}')
    if failure == "refused":
        base_url = f"http://127.0.0.1:{free_port()}/"
    out = tmp_path / "data" / "causalgym"
    done = run_command("data", "causalgym", "--out", str(out), "--base_url", base_url, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    url = f"{base_url}data/templates/syntaxgym.json"
    expected = {
        "missing": f"error: could not download {url}: HTTP Error 404: File not found",
        "tampered": f"error: sha256 mismatch for templates.json: expected {data_registry.DATASETS['causalgym'].files[0].sha256}",
        "refused": f"error: could not download {url}: <urlopen error [Errno ",  # 111 (Linux), 61 (macOS)
    }[failure]
    assert failure != "refused" or "Connection refused>" in line
    assert line.startswith(expected) and line.endswith(f"({out} left as it was)"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["www"]
