"""Files that are whole or absent, and numbers that are finite: the one place for each check.

- `write_atomically`: every file the package writes (artifacts, results, figures, caches,
  downloads) goes through a temporary file beside it and `os.replace`, so a reader sees the old
  file or the new one, never half of one; the file gets the permissions `open` would give it.
- `read_utf8`: a data file's text, or one error naming the file and the first byte that is not
  UTF-8.
- `read_weights`: the tensors of a safetensors file (never a pickle), or one error naming it.
- `check_finite` refuses tensors with NaN or infinite values before they are written or used;
  `finite_values` keeps the finite numbers of a metrics dict (a model card's, a config's).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

_UMASK = os.umask(0o022)  # read once, at import (it can only be read by setting it)
os.umask(_UMASK)


def read_utf8(path: str | Path) -> str:
    """The text of `path` decoded as UTF-8; a ValueError naming the file and the first bad byte
    when it is in another encoding (Latin-1, cp1252)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None


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
