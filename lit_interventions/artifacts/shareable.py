"""What a card may carry off this machine: no absolute local path.

A card (config.json, the README.md model card, an older intervention.json / dictionary.json /
sae.json) is written to be shared, e.g. by `push_to_hub`. Before it is written, `shareable`
replaces every absolute local path in its `data`, `training_data` and `command` fields:

    a file that exists          its name and the sha256 of its bytes: "tense.jsonl (sha256 3f2a…)"
    anything else (a directory) its name: "/home/me/ravel" -> "ravel"
    a path inside `command`     its name: "--data.path /home/me/tense.jsonl" -> "--data.path tense.jsonl"

The run's resolved `config.yaml`, uploaded beside the card, gets every absolute path replaced by
its name (`shareable_yaml`), so that it still runs with the files put beside it.

Relative paths (`configs/das.yaml`, `examples/data/pairs.jsonl`) are kept as they are: they name
a file of the project, not of the machine. The LM (`model`) is kept: `apply` checks an LM
against it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import yaml

from lit_interventions.core.files import file_sha256

FIELDS = ("data", "training_data", "command")  # the card fields that may name the user's files
# an absolute path inside a command line: /… or C:\… up to a quote, space or '=' (after --x=)
_IN_COMMAND = re.compile(r"(?<![\w./\\-])(/[^\s'\"=]+|[A-Za-z]:\\[^\s'\"=]+)")


def shareable(card: dict) -> dict:
    """`card` with the absolute local paths of its `FIELDS` replaced (see the module doc)."""
    shared = dict(card)
    for key in FIELDS:
        if key in shared:
            shared[key] = _mapped(shared[key], _in_command if key == "command" else _in_card)
    return shared


def _mapped(value: Any, replace: Callable[[str], str]) -> Any:
    """`value` with `replace` applied to every string inside it (dicts and lists walked)."""
    if isinstance(value, dict):
        return {k: _mapped(v, replace) for k, v in value.items()}
    if isinstance(value, list):
        return [_mapped(v, replace) for v in value]
    return replace(value) if isinstance(value, str) else value


def _in_command(text: str) -> str:
    return _IN_COMMAND.sub(lambda m: Path(m.group(0)).name or m.group(0), text)


def _in_card(text: str) -> str:
    return _path_text(text) if _is_absolute(text) else text


def _as_name(text: str) -> str:
    return (Path(text).name or text) if _is_absolute(text) else text


def _is_absolute(text: str) -> bool:
    return PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute()


def _path_text(text: str) -> str:
    """An absolute path as a card shows it: a file's name and sha256, anything else its name."""
    path = Path(text)
    name = path.name or text
    try:
        if path.is_file():
            digest = file_sha256(path)
            return f"{name} (sha256 {digest})"
    except OSError:
        pass
    return name


def shareable_yaml(text: str) -> str:
    """A YAML config (Lightning's resolved config.yaml) with every absolute path replaced by its name."""
    return yaml.safe_dump(_mapped(yaml.safe_load(text), _as_name), sort_keys=False, allow_unicode=True)
