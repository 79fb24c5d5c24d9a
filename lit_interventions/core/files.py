"""Files that are whole or absent, and numbers that are finite: the one place for each check.

- `write_atomically`: every file the package writes (artifacts, results, figures, caches,
  downloads) goes through a temporary file beside it and `os.replace`, so a reader sees the old
  file or the new one, never half of one; the file gets the permissions `open` would give it.
  `being_written` tells such a temporary file (another writer's, at work in the same directory).
- `read_utf8`: a data file's text (without the byte-order mark spreadsheets and Windows editors
  write first), or one error naming the file and the first byte that is not UTF-8.
- `read_weights`: the tensors of a safetensors file (never a pickle), or one error naming it.
- `disk_full`: whether a write failed because the disk is full, whichever writer raised it.
- `unchanged_files`: the sha256 of a run's data files, a resume refused in one line when one of
  them changed in place since the run's meta.json recorded it.
- `check_finite` refuses tensors with NaN or infinite values before they are written or used;
  `finite_values` keeps the finite numbers of a metrics dict (a model card's, a config's).
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

_UMASK = os.umask(0o022)  # read once, at import (it can only be read by setting it)
os.umask(_UMASK)
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # write_atomically's: .NAME.<mkstemp's 8 random characters>.tmp


def read_utf8(path: str | Path) -> str:
    """The text of `path` decoded as UTF-8 with `utf-8-sig`: a byte-order mark first (what
    spreadsheets write in a "CSV UTF-8" file) is not part of the text. A ValueError naming the
    file and the first bad byte (counted from the file's start) when it is in another encoding
    (Latin-1, cp1252)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        start = err.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise ValueError(f"{path}: not UTF-8 text (byte {start}); save it as UTF-8") from None


def write_atomically(path: str | Path, content: str | bytes | Callable[[Path], object]) -> Path:
    """Write `content` to `path` through a temporary file beside it, then `os.replace` it over
    `path`. `content`: text, bytes, or a function that writes the file at the path it is given
    (`safetensors.torch.save_file`, a streamed download). The temporary file is removed when
    anything fails, the exception is raised as it is, and `path` keeps what it held. The file's
    mode is what `open` gives a new file (0o666 less the umask), not the temporary file's 0o600."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        if callable(content):
            os.close(fd)
            content(tmp)
        else:
            with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w", **_text_mode(content)) as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # a writer given the path may have made a file of its own
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def being_written(path: str | Path) -> bool:
    """Whether `path` is named as `write_atomically`'s temporary files are (`.NAME.XXXXXXXX.tmp`):
    a file another writer is writing now, renamed over NAME once whole (or left by a killed one)."""
    return _TEMPORARY.fullmatch(Path(path).name) is not None


FILE_DIGESTS = "data_sha256"  # the key of a meta.json under which `unchanged_files` records them


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def unchanged_files(
    meta: str | Path, files: Mapping[str, str | Path], digest: Callable[[str], str] = file_sha256
) -> dict:
    """{key: sha256} of the data `files` ({key: path}), each by `digest(path)`; a ValueError, one
    line naming the file and what to do, when `meta` (the meta.json of the output directory a run
    resumes) records under FILE_DIGESTS another sha256 for the same key: the file changed in place,
    and results computed on its old content would be mixed with results on its new one. A
    meta.json that is absent, damaged (claiming the directory reports that) or records no digest
    of a key refuses nothing."""
    meta = Path(meta)
    digests = {key: digest(str(path)) for key, path in files.items()}
    try:
        recorded = json.loads(meta.read_text())
    except (OSError, ValueError):
        return digests
    recorded = recorded.get(FILE_DIGESTS) if isinstance(recorded, dict) else None
    if not isinstance(recorded, dict):
        return digests
    for key, path in files.items():
        if recorded.get(key, digests[key]) != digests[key]:
            raise ValueError(
                f"{path} changed since {meta.parent} was written (its sha256 is not the one {meta.name} records); "
                f"restore the file to resume, or give a new --out to start over on it"
            )
    return digests


def disk_full(err: BaseException, path: str | Path) -> bool:
    """Whether the failed write `err` into `path` (a file or directory) is a full disk: ENOSPC or
    EDQUOT, the same named in a message (safetensors' `os error 28`), or, for a writer that says
    only that its bytes did not all land (torch's `unexpected pos`, numpy's `N requested and M
    written`), less than 1 MiB left on the file system that holds `path`."""
    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(err):
        return True
    folder = next((p for p in (Path(path), *Path(path).absolute().parents) if p.is_dir()), None)
    try:
        return folder is not None and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def first_reason(err: BaseException) -> str:
    """An error's first line (an OSError's strerror), or its type's name when it has no text."""
    text = (getattr(err, "strerror", None) or str(err)).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _text_mode(content) -> dict:
    return {} if isinstance(content, bytes) else {"newline": "", "encoding": "utf-8"}


def check_finite(tensors: Mapping[str, torch.Tensor], where: str | Path, doing: str) -> None:
    """A one-line ValueError naming the first floating-point tensor with NaN or infinite values,
    how many it has, and what is refused (`doing`: "write", "load", ...)."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{where}: tensor {name!r} has {bad} NaN or infinite value(s); refusing to {doing} it")


def finite_values(values: Mapping | None) -> dict[str, float]:
    """The entries of `values` that are finite numbers (Python, NumPy or one-element tensors), as
    floats under string keys, in their order; NaN, ±inf and non-numbers are left out."""
    out = {}
    for name, value in (values or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            continue
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[str(name)] = value
    return out


def read_weights(weights: Path, named_in: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `weights` (that the config `named_in` names); one clear
    error naming the file when it is missing, unreadable (truncated, empty, another kind of file:
    a pickle is never unpickled) or holds non-finite values."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except FileNotFoundError:
        named = f" ({named_in} names it as the weights)" if named_in is not None else ""
        raise FileNotFoundError(f"{weights}: no such file{named}") from None
    except Exception as err:  # truncated, empty, not safetensors
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ValueError(
            f"{weights} is unreadable ({type(err).__name__}{': ' + detail if detail else ''}); "
            "restore the file or save it again"
        ) from None
    check_finite(tensors, weights, "load")
    return tensors
