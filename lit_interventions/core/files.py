"""Files that are whole or absent, and numbers that are finite: the one place for each check.

- `write_atomically`: every file the package writes (artifacts, results, caches, downloads) goes
  through a temporary file beside it and `os.replace`, so a reader sees the old file or the new
  one, never half of one.
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


def write_atomically(path: str | Path, content: str | bytes | Callable[[Path], object]) -> Path:
    """Write `content` to `path` through a temporary file beside it, then `os.replace` it over
    `path`. `content`: text, bytes, or a function that writes the file at the path it is given
    (`safetensors.torch.save_file`, a streamed download). The temporary file is removed when
    anything fails, the exception is raised as it is, and `path` keeps what it held."""
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
