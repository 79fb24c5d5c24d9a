"""Download the published datasets the benchmarks read, checked against their sha256.

    lit-interventions data ravel --out data/ravel
    lit-interventions data syntaxgym --out data/syntaxgym

Each dataset is a list of upstream files pinned to one commit of the authors' repository, each
with the sha256 of its bytes. A file already present whose hash matches is skipped. The others are
downloaded into a temporary directory beside the output directory and moved into it only when
every one is fetched and checked, so a failed or interrupted download leaves the output directory
as it was (absent, or the previous copy). A file whose hash is not recorded (None) is downloaded
with a warning that it was not verified. RAVEL ships one archive (`data.tgz`); its JSON files are
extracted flat into the output directory and each is checked.

Standard library only (urllib, hashlib, tarfile).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from lit_interventions.cli.data_registry import DATASETS, Dataset, get_dataset
from lit_interventions.cli.parsing import Parser, fail

__all__ = ["ChecksumError", "download", "main", "sha256_of"]

CHUNK = 1 << 20


# ----------------------------------------------------------------------------- download


class ChecksumError(ValueError):
    """A downloaded file whose sha256 is not the recorded one (the file has been deleted)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, sha256: str | None) -> bool:
    """Present and, when a hash is recorded, matching it (a mismatching file is left in place
    until a verified copy replaces it)."""
    if not path.is_file():
        return False
    if sha256 is None or sha256_of(path) == sha256:
        return True
    warnings.warn(f"{path} does not match its recorded sha256; downloading it again", stacklevel=3)
    return False


def _write_atomic(dest: Path, chunks, expected: str | None) -> None:
    """Write `chunks` to a temporary file beside `dest`, check its sha256, then rename it."""
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
        actual = digest.hexdigest()
        if expected is not None and actual != expected:
            raise ChecksumError(
                f"sha256 mismatch for {dest.name}: expected {expected}, got {actual}; the file was deleted"
            )
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if expected is None:
        warnings.warn(f"no sha256 recorded for {dest.name}: verification skipped", stacklevel=3)


def _fetch(url: str, timeout: float):
    try:
        response = urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 (http(s) URLs from the registry)
    except (urllib.error.URLError, OSError) as err:
        raise OSError(f"could not download {url}: {err}") from None
    with response:
        yield from iter(lambda: response.read(CHUNK), b"")


def _extract(archive: Path, members: dict[str, str | None], dest_dir: Path) -> None:
    """Extract the listed files of a .tar.gz flat into dest_dir (by base name, nothing else)."""
    found = set()
    with tarfile.open(archive, "r:gz") as tar:
        for info in tar:
            name = Path(info.name).name
            if not info.isfile() or name not in members or name in found:
                continue
            data = tar.extractfile(info).read()
            _write_atomic(dest_dir / name, [data], members[name])
            found.add(name)
    missing = sorted(set(members) - found)
    if missing:
        raise ValueError(f"{archive.name} lacks {', '.join(missing)}")


def _fetch_into(dataset: Dataset, base: str, dest_dir: Path, staging: Path, timeout: float) -> list[str]:
    """Download into `staging` every file of `dataset` that `dest_dir` lacks or holds changed
    (a file present and verified there is skipped); the names of all the dataset's files."""
    names = []
    for remote in dataset.files:
        if remote.members:
            names += remote.members
            if all(_verified(dest_dir / member, sha) for member, sha in remote.members.items()):
                print(f"{remote.name}: {len(remote.members)} files present and verified, skipped")
                continue
            archive = staging / remote.name
            _write_atomic(archive, _fetch(base + remote.path, timeout), remote.sha256)
            _extract(archive, remote.members, staging)
            archive.unlink()
            print(f"{remote.name}: extracted and verified {len(remote.members)} files")
            continue
        names.append(remote.name)
        if _verified(dest_dir / remote.name, remote.sha256):
            print(f"{remote.name}: present{' and verified' if remote.sha256 else ''}, skipped")
            continue
        _write_atomic(staging / remote.name, _fetch(base + remote.path, timeout), remote.sha256)
        print(f"{remote.name}: downloaded{', sha256 verified' if remote.sha256 else ''}")
    return names


def _absent_ancestors(path: Path) -> list[Path]:
    """`path` and its parents that do not exist, deepest first."""
    absent = []
    while not path.exists() and path != path.parent:
        absent.append(path)
        path = path.parent
    return absent


def download(name: str, dest_dir: str | Path, base_url: str | None = None, timeout: float = 60.0) -> list[Path]:
    """Fetch dataset `name` into `dest_dir` and return the paths of its files.

    The files are downloaded into a temporary directory beside `dest_dir` and moved into it only
    once every one is fetched and checked: a failure (network error, sha256 mismatch, a signal)
    removes the temporary directory and leaves `dest_dir` as it was, absent or the previous copy.

    base_url: replaces the registry's base URL (a mirror, or a local server in the tests); each
    file is fetched from `base_url + file.path`.
    """
    dataset = get_dataset(name)
    dest_dir = Path(dest_dir)
    if dest_dir.exists() and not dest_dir.is_dir():
        raise ValueError(f"--out {dest_dir} is a file, not a directory; pass a directory for the dataset's files")
    base = base_url if base_url is not None else dataset.base_url
    base = base if base.endswith("/") else base + "/"
    parent = dest_dir.absolute().parent
    created = _absent_ancestors(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest_dir.absolute().name}.", suffix=".partial", dir=parent))
    except OSError as err:
        raise OSError(f"--out {dest_dir}: cannot write beside it ({err.strerror or type(err).__name__})") from None
    try:
        names = _fetch_into(dataset, base, dest_dir, staging, timeout)
        if not dest_dir.exists():
            os.replace(staging, dest_dir)
        else:
            for path in staging.iterdir():
                os.replace(path, dest_dir / path.name)
            staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # the parents this call made, when left empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return [dest_dir / name for name in names]


def main(args: list[str] | None = None) -> list[Path]:
    """`lit-interventions data NAME --out DIR`."""
    listing = "\n".join(f"  {d.name:<20} {d.description}" for d in DATASETS.values())
    parser = Parser(
        prog="lit-interventions data",
        description=f"Download a published dataset, checked against its sha256. Datasets:\n{listing}",
    )
    parser.add_argument("name", type=str, help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--out", type=str, required=True, help="directory to write the files into")
    parser.add_argument("--base_url", type=str, default=None, help="a mirror to fetch from instead of upstream")
    cfg = parser.parse_args(args)
    try:
        dataset = get_dataset(cfg.name)
    except ValueError as err:
        fail(str(err))  # one `error:` line, exit code 2, as every command
    print(f"{dataset.name}: {dataset.source} ({dataset.license}) -> {cfg.out}")
    try:
        paths = download(cfg.name, cfg.out, base_url=cfg.base_url)
    except (ValueError, OSError) as err:
        fail(f"{err} ({cfg.out} left as it was)")
    print(f"{dataset.name}: {len(paths)} files in {cfg.out}")
    return paths
