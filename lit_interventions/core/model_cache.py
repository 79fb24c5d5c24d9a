"""The on-disk cache of converted models, under `$LIT_INTERVENTIONS_CACHE` (default
`~/.cache/lit_interventions`): where a GGUF file's safetensors copy lives, the manifest that
records each of its files (size, mtime, sha256), the integrity check against it, and the removal
of damaged copies and of staging directories left by killed conversions. The conversion itself
is `lm.convert_gguf`.

Hub ids live in Hugging Face's own cache: `hub_offline_reason` says whether the hub can be used
now (offline mode, or an endpoint that does not answer one quick request) and `cached_snapshot`
finds a hub id's cached copy, so that a run without network loads from the cache or fails at
once instead of waiting on download retries.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from functools import lru_cache
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import get_session, snapshot_download

MANIFEST = "manifest.json"  # in a converted directory: size, mtime and sha256 of every file written
STAGING = ".converting-"  # prefix of a conversion in progress (renamed to its target when complete)
LOCK = ".lock"  # inside a staging directory: flock-ed by the converting process while it lives
STALE_UNLOCKED_S = 3600  # a staging directory without a lock file (older versions) is stale after this
_VERIFIED: set[tuple[str, int, int]] = set()  # (file, size, mtime) whose sha256 this process has checked


def cache_dir() -> Path:
    """The cache's root: `$LIT_INTERVENTIONS_CACHE`, default `~/.cache/lit_interventions`."""
    return Path(os.environ.get("LIT_INTERVENTIONS_CACHE", Path.home() / ".cache" / "lit_interventions"))


def converted_dir(gguf: Path) -> Path:
    """Where the safetensors copy of a GGUF file lives: `<stem>-<the first 12 hex of its sha256>`.
    Keyed by content, so a copy of the file in another venv or folder finds the same conversion."""
    return cache_dir() / f"{gguf.stem}-{gguf_sha256(gguf)[:12]}"


_GGUF_SHA256: dict[tuple[str, int, int], str] = {}  # (file, size, mtime) -> sha256, hashed once a process


def gguf_sha256(path: Path, known: str | None = None) -> str:
    """The file's sha256, hashed once per process while its size and mtime stay; `known` records a
    digest its caller has just verified (the embedded gemma package checks its own)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if known is not None:
        _GGUF_SHA256[key] = known
    if key not in _GGUF_SHA256:
        _GGUF_SHA256[key] = _sha256(path)
    return _GGUF_SHA256[key]


def _sha256(path: Path) -> str:
    """The file's sha256, hex, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_record(path: Path) -> dict:
    """What the manifest records of one file: its size, mtime and sha256."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}


def write_manifest(directory: Path) -> Path:
    """Record size, mtime and sha256 of every file in `directory` (its manifest.json)."""
    files = {
        p.name: _file_record(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name not in (MANIFEST, LOCK)
    }
    path = directory / MANIFEST
    tmp = directory / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"format": "lit-interventions/model-cache/v1", "files": files}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _safetensors_intact(path: Path) -> str | None:
    """Why a .safetensors file is unreadable (its header does not parse, or its data is shorter
    than the header says), or None. Reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} declares a {n}-byte header but is {size} bytes"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            return f"{path.name} is {size} bytes but its header describes {8 + n + end}"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        return f"{path.name} is unreadable ({type(err).__name__}: {err})"
    return None


def check_converted(directory: Path) -> str | None:
    """Why a converted directory is damaged, or None when it is whole. Against its manifest:
    every file present with its size and sha256 (each file is hashed once per process, and again
    when its size or mtime changes; a file rewritten in place with its size and mtime kept is
    caught). A directory without a manifest (made by an older version) has its safetensors
    headers checked and then gets one."""
    if not (directory / "config.json").is_file():
        return "config.json is missing"
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        weights = sorted(directory.glob("*.safetensors"))
        if not weights:
            return "it holds no .safetensors weights"
        for path in weights:
            reason = _safetensors_intact(path)
            if reason:
                return reason
        try:
            write_manifest(directory)  # trust on first use: from now on, changes are caught
        except OSError:
            pass
        return None
    try:
        files = json.loads(manifest_path.read_text())["files"]
        assert isinstance(files, dict) and files
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{MANIFEST} is unreadable"
    touched = False
    for name, record in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != record.get("size"):
            return f"{name} is {stat.st_size} bytes, not the {record.get('size')} written"
        seen = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if seen not in _VERIFIED:
            if _sha256(path) != record.get("sha256"):
                return f"{name} was modified after conversion (its sha256 differs)"
            _VERIFIED.add(seen)
        if stat.st_mtime_ns != record.get("mtime_ns"):
            touched = True  # same content (copied, touched): record the new mtime below
    if touched:
        try:
            write_manifest(directory)
        except OSError:
            pass
    return None


def _lock_is_held(lock: Path) -> bool:
    """Whether a live process holds the flock on `lock`."""
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases the lock we may have taken
    return False


def clean_stale_staging(parent: Path) -> list[Path]:
    """Remove `.converting-*` directories left by killed conversions: those whose lock no live
    process holds (or, without a lock file, older than an hour). Returns what was removed."""
    removed = []
    if not parent.is_dir():
        return removed
    for staging in parent.glob(f"{STAGING}*"):
        if not staging.is_dir():
            continue
        lock = staging / LOCK
        try:
            if lock.exists():
                stale = not _lock_is_held(lock)
            else:
                stale = time.time() - staging.stat().st_mtime > STALE_UNLOCKED_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(staging, ignore_errors=True)
            if not staging.exists():
                removed.append(staging)
                warnings.warn(f"removed {staging}: a model conversion that did not finish", stacklevel=3)
    return removed


def discard(directory: Path) -> None:
    """Move a damaged directory aside (atomic, so concurrent processes agree) and delete it."""
    trash = directory.with_name(f".damaged-{directory.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        directory.rename(trash)
    except OSError:
        return  # another process moved it first (or it is gone)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- hub ids

HUB_PROBE_TIMEOUT_S = 5.0  # one request to the hub's endpoint: no answer in this time is offline


def hub_offline_reason() -> str | None:
    """Why the Hugging Face hub cannot be used now, or None when it answers: offline mode
    (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), or an endpoint (HF_ENDPOINT) that does not answer one
    request within HUB_PROBE_TIMEOUT_S (asked once per process)."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if hf_constants.HF_HUB_OFFLINE or str(env).upper() in hf_constants.ENV_VARS_TRUE_VALUES:
        return "HF_HUB_OFFLINE is set"
    return _unreachable(hf_constants.ENDPOINT)


@lru_cache(maxsize=4)
def _unreachable(endpoint: str) -> str | None:
    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as err:  # connection refused, DNS, timeout, a proxy refusing: no answer from the hub
        return f"{endpoint} cannot be reached ({type(err).__name__})"
    return None  # any HTTP answer: reachable


def cached_snapshot(repo_id: str, **options) -> str | None:
    """The directory of `repo_id`'s cached snapshot (`options`: revision, cache_dir), or None
    when the cache has none. Touches no network."""
    try:
        return snapshot_download(repo_id, local_files_only=True, **options)
    except Exception:  # LocalEntryNotFoundError, or a name the hub would refuse (HFValidationError)
        return None
