"""Lightning checkpoints that are whole or absent on a local disk.

Lightning's own writer stages a checkpoint in the system's temporary directory and moves it into
place; across file systems that move is a copy, so a full disk leaves a truncated checkpoint
under its final name. `AtomicCheckpointIO` writes it beside its target and renames it there
(`write_atomically`): a reader, or a resumed run, sees the previous checkpoint or the new one.

`read_checkpoint` reads one with `weights_only=True` (tensors and plain data: nothing in the file
runs) and turns what can go wrong with a given file into one ValueError naming it. A pickle that
names code (a function or class the weights-only reader refuses: `exec`, `posix.system`, ...) is
named in that error, found by scanning its opcodes (`code_named`), whatever opcode the reader
stopped at.
"""

from __future__ import annotations

import pickle
import pickletools
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
    except Exception as err:  # UnpicklingError (a refused global, an opcode), RuntimeError, EOFError, OSError
        named = code_named(path)
        if named is not None:
            raise ValueError(
                f"{path} holds more than tensors and plain data (it names {named}); it is read with "
                f"weights_only=True and never unpickled further, so nothing in it ran{_FIX}"
            ) from None
        damaged = "damaged: " if isinstance(err, pickle.UnpicklingError) else ""  # an opcode or record unreadable
        raise ValueError(f"{path} is not a readable Lightning checkpoint ({damaged}{_reason(err)}){_FIX}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path} is not a Lightning checkpoint (it holds no state_dict){_FIX}")
    return checkpoint


def code_named(path: Path) -> str | None:
    """The first function or class the pickle of the checkpoint at `path` names that torch's
    weights-only reader does not allow (`builtins.exec`, or Python 2's `__builtin__.exec`, shown
    as `exec`), or None. The pickle is scanned, never run: torch's
    `get_unsafe_globals_in_checkpoint`, or, for a pickle it cannot scan (protocol 0 or 1, which
    no torch.save writes), the `pickle_globals` outside torch's own."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # an opcode it does not read, a damaged record
        unsafe = [name for name in pickle_globals(path) if not name.startswith(_TORCH_OWN)]
    return unsafe[0].removeprefix("builtins.").removeprefix("__builtin__.") if unsafe else None


_TORCH_OWN = ("torch.", "collections.OrderedDict", "_codecs.encode")  # what torch.save's records name
_STRINGS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_MAX_PICKLE = 64 << 20  # a checkpoint's pickle record holds names and plain data; its tensors are other records


def pickle_globals(path: Path) -> list[str]:
    """`module.name` of each global (GLOBAL, INST, STACK_GLOBAL) the checkpoint's pickle record
    (`*/data.pkl` of the zip) names, read with `pickletools.genops` (opcodes parsed, nothing run),
    up to the first opcode it cannot parse."""
    try:
        with zipfile.ZipFile(path) as archive:
            record = next((i for i in archive.infolist() if i.filename.endswith("data.pkl")), None)
            data = archive.read(record) if record is not None and record.file_size <= _MAX_PICKLE else b""
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return []
    names, strings, memo = [], [], {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(".".join(str(arg).split(" ", 1)))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif opcode.name in _STRINGS:
                strings.append(arg if isinstance(arg, str) else bytes(arg).decode("latin-1"))
            elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE") and strings:
                memo[len(memo) if arg is None else arg] = strings[-1]
            elif opcode.name in ("GET", "BINGET", "LONG_BINGET") and arg in memo:
                strings.append(memo[arg])
    except Exception:  # a damaged record: the names read before it
        pass
    return names


def _reason(err: Exception) -> str:
    """The exception's type and the first line of its message that says something."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if not line.startswith(("Weights only load failed", "Please file"))), "")
    return f"{type(err).__name__}: {detail[:200]}" if detail else type(err).__name__
