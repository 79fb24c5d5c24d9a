"""Build a LightningModule from a config's `model:` section (`class_path` + `init_args`), as
train.py does, so a study script runs a method from the same YAML a user trains it with."""

from __future__ import annotations

from pathlib import Path

import yaml
from jsonargparse import ArgumentParser
from lightning import LightningModule


def model_section(path: str | Path) -> dict:
    """The `model:` section of a config file ({class_path, init_args})."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No config file {path}")
    section = (yaml.safe_load(path.read_text()) or {}).get("model")
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(f"{path}: no `model:` section with a class_path")
    return section


def build_module(section: dict, **overrides) -> LightningModule:
    """Instantiate a `model:` section, with `overrides` replacing init args."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=LightningModule)
    section = {"class_path": section["class_path"], "init_args": {**section.get("init_args", {}), **overrides}}
    config = parser.parse_object({"model": section})
    return parser.instantiate(config).model
