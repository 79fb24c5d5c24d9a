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

from lit_interventions.cli import data
from lit_interventions.cli.data import ChecksumError, Dataset, Remote, download, main

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
    monkeypatch.setitem(data.DATASETS, "tiny", dataset)
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
    good = data.DATASETS["tiny"]
    members = {k: _sha(v) for k, v in MEMBERS.items()}
    files = (*good.files[:2], Remote("data.tgz", "data.tgz", _sha(archive), members=members))
    monkeypatch.setitem(data.DATASETS, "tiny", Dataset(**{**good.__dict__, "files": files}))
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
    good = data.DATASETS["tiny"]
    files = (Remote("suites/tiny.json", "tiny.json", None),)
    monkeypatch.setitem(data.DATASETS, "tiny", Dataset(**{**good.__dict__, "files": files}))
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
    assert result.stderr.strip().splitlines() == [f"error: unknown dataset 'nope'; valid: {', '.join(data.DATASETS)}"]


def test_registry_is_well_formed():
    assert set(data.DATASETS) == {"causalgym", "syntaxgym", "ravel", "axbench-concept10", "axbench-concept500"}
    for dataset in data.DATASETS.values():
        assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/", dataset.base_url)
        names = [r.name for r in dataset.files] + [m for r in dataset.files for m in r.members]
        assert len(names) == len(set(names)), dataset.name
        for remote in dataset.files:
            for sha in [remote.sha256, *remote.members.values()]:
                assert sha is None or re.fullmatch(r"[0-9a-f]{64}", sha)
    assert len(data.DATASETS["syntaxgym"].files) == 34 + 2
    assert len(data.DATASETS["ravel"].files[0].members) == 25


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
    dataset = data.DATASETS[name]
    expected = {r.name: r.sha256 for r in dataset.files if not r.members}
    expected |= {m: sha for r in dataset.files for m, sha in r.members.items()}
    expected.pop("LICENSE", None)  # the AxBench licence sits one level up in the local copy
    for file_name, sha in expected.items():
        assert data.sha256_of(folder / file_name) == sha, file_name
