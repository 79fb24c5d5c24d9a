"""The files each export format writes, by name: what an output directory may already hold (an
earlier export of the same format, replaced) before an export writes into it; and what another
export at work in it leaves there for a moment (`in_flight`: its temporary files)."""

from __future__ import annotations

import os
from pathlib import Path

from lit_interventions.core.files import being_written

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PYVENE_CONFIG, PYVENE_WEIGHTS_PREFIX = "config.json", "intkey_"


def in_flight(path: Path) -> bool:
    """An entry of another export at work in the same directory: one of its temporary files
    (`write_atomically`'s), or an entry gone (renamed over its final name) since the listing."""
    return being_written(path) or not os.path.lexists(path)


def peft_files(path: Path) -> bool:
    """A PEFT adapter's adapter_config.json or adapter_model.safetensors."""
    return path.is_file() and path.name in (PEFT_CONFIG, PEFT_WEIGHTS)


def gguf_files(path: Path) -> bool:
    """A control vector, `<concept>.gguf`."""
    return path.is_file() and path.suffix == ".gguf"


def torch_files(path: Path) -> bool:
    """An lm-eval steering file, `<concept>.pt`."""
    return path.is_file() and path.suffix == ".pt"


def pyvene_files(path: Path) -> bool:
    """pyvene's config.json (it names `intervention_types`), an `intkey_*.bin`, or a directory (one
    concept's) holding only those."""
    if path.is_dir():
        return all(in_flight(child) or pyvene_files(child) for child in path.iterdir())
    if path.name.startswith(PYVENE_WEIGHTS_PREFIX) and path.suffix == ".bin":
        return path.is_file()
    if path.name != PYVENE_CONFIG or not path.is_file():
        return False
    try:
        return '"intervention_types"' in path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
