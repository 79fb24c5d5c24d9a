"""The files each export format writes, by name: what an output directory may already hold (an
earlier export of the same format, replaced) before an export writes into it."""

from __future__ import annotations

from pathlib import Path

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PYVENE_CONFIG, PYVENE_WEIGHTS_PREFIX = "config.json", "intkey_"


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
        return all(pyvene_files(child) for child in path.iterdir())
    if path.name.startswith(PYVENE_WEIGHTS_PREFIX) and path.suffix == ".bin":
        return path.is_file()
    if path.name != PYVENE_CONFIG or not path.is_file():
        return False
    try:
        return '"intervention_types"' in path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
