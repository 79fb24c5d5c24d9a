"""Lightning checkpoints that are whole or absent on a local disk.

Lightning's own writer stages a checkpoint in the system's temporary directory and moves it into
place; across file systems that move is a copy, so a full disk leaves a truncated checkpoint
under its final name. `AtomicCheckpointIO` writes it beside its target and renames it there
(`write_atomically`): a reader, or a resumed run, sees the previous checkpoint or the new one.

`read_checkpoint` reads one with `weights_only=True` (tensors and plain data: nothing in the file
runs) and turns what can go wrong with a given file into one ValueError naming it.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_interventions.core.files import write_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes go through a temporary file beside the checkpoint
    and `os.replace`; remote paths (s3://, ...) keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        local = str(path).removeprefix("file://")
        if storage_options is not None or "://" in local:
            return super().save_checkpoint(checkpoint, path, storage_options)
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(local, lambda tmp: torch.save(checkpoint, tmp))


_FIX = "; use a .ckpt file a run wrote (RUN/checkpoints/), from a source you trust"


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """The Lightning checkpoint at `path`, read with `weights_only=True`; a ValueError naming the
    file when it is not a readable checkpoint (truncated, damaged, another kind of file) or holds
    more than tensors and plain data (a pickle naming code to run: refused, nothing in it runs).
    `mmap`: tensors mapped from the file, not read (a check of the file before a run loads it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):  # torch.save's format; a truncated file loses its index at the end
        raise ValueError(f"{path} is not a readable Lightning checkpoint (truncated, or another kind of file){_FIX}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if named is None:  # damaged: an opcode or a record the unpickler cannot read
            raise ValueError(f"{path} is not a readable Lightning checkpoint (damaged: {_reason(err)}){_FIX}") from None
        raise ValueError(
            f"{path} holds more than tensors and plain data (it names {named.group(1)}); it is read with "
            f"weights_only=True and never unpickled further, so nothing in it ran{_FIX}"
        ) from None
    except Exception as err:  # RuntimeError (a damaged record), EOFError, OSError, ...
        raise ValueError(f"{path} is not a readable Lightning checkpoint ({_reason(err)}){_FIX}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path} is not a Lightning checkpoint (it holds no state_dict){_FIX}")
    return checkpoint


def _reason(err: Exception) -> str:
    """The exception's type and the first line of its message that says something."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if not line.startswith(("Weights only load failed", "Please file"))), "")
    return f"{type(err).__name__}: {detail[:200]}" if detail else type(err).__name__
