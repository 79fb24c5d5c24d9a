"""`from_pretrained`: any saved artifact (an intervention or a concept dictionary), from a local
directory or a hub repository, as its config.json (or an older intervention.json /
dictionary.json) says. The layout itself is `lit_interventions.artifacts.hub`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.hub import CONFIG, local_directory, read_config
from lit_interventions.interventions.base import load_pretrained


def from_pretrained(directory_or_hub_id: str | Path, **download: Any):
    """The intervention or dictionary saved in a directory or hub repository (whichever its
    config.json, or an older intervention.json / dictionary.json, says). `download`:
    revision, token, cache_dir, local_files_only (passed to snapshot_download)."""
    directory = local_directory(directory_or_hub_id, **download)
    kind = read_config(directory).get("kind") if (directory / CONFIG).is_file() else None
    if kind == "dictionary" or (kind is None and (directory / "dictionary.safetensors").is_file()):
        return Dictionary.load(directory)
    return load_pretrained(directory)
