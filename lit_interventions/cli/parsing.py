"""One parser style (jsonargparse), one error style (a single `error: ...` line on stderr, exit
code 2) for every command, and `--config` files found by short name (`das.yaml`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]  # the checkout (an editable install): its configs/
PROG = "lit-interventions"
# options the model and the data module share through links: set once, never parsed from a checkpoint
SHARED = ("lm", "region", "multitask")  # model init args the data module also takes
LINKED = {"model": {"hidden_size"}, "data": set(SHARED)}

# ----------------------------------------------------------------------------- configs by short name


def find_config(path: str) -> str:
    """`das.yaml` -> `configs/das.yaml` (and `ravel/mdas.yaml` -> `configs/ravel/mdas.yaml`) when
    the path does not exist as given: under ./configs, then under this checkout's configs/."""
    if Path(path).exists():
        return path
    for base in (Path.cwd() / "configs", ROOT / "configs"):
        for candidate in (base / path, base / f"{path}.yaml"):
            if candidate.is_file():
                return str(candidate)
    return path


def resolve_configs(args: list[str] | None) -> list[str]:
    """`args` with every `--config` value passed through `find_config` and checked to be a YAML
    mapping (`check_config_file`)."""
    args = list(sys.argv[1:] if args is None else args)
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            arg = "--config=" + check_config_file(find_config(arg.split("=", 1)[1]))
        elif i and args[i - 1] in ("--config", "-c"):
            arg = check_config_file(find_config(arg))
        out.append(arg)
    return out


def check_config_file(path: str) -> str:
    """`path` when it is a readable UTF-8 YAML file holding a mapping of settings; otherwise one
    error line naming the file and what is wrong (exit 2). A path that does not exist is left to
    the parser, which names it."""
    file = Path(path)
    if not file.is_file():
        return path
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        fail(f"--config {path}: not UTF-8 text (byte {err.start}); save it as UTF-8")
    except OSError as err:
        fail(f"--config {path}: cannot be read ({type(err).__name__}: {err.strerror or err})")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        fail(f"--config {path}: not valid YAML{where} ({getattr(err, 'problem', None) or type(err).__name__})")
    if data is None:
        fail(f"--config {path}: the file is empty; a config is a YAML mapping such as `model: ...`, `data: ...`")
    if not isinstance(data, dict):
        fail(
            f"--config {path}: holds a YAML {type(data).__name__}, not a mapping of settings "
            "(`model: ...`, `data: ...`, `trainer: ...`)"
        )
    return path


# ----------------------------------------------------------------------------- errors


def first_reason(message: str) -> str:
    """The first specific reason in a jsonargparse error, with the option it is about and the
    value given: `--trainer.max_epochs: Expected a <class 'int'>; got many`."""
    reason = _first_reason(message)
    outer = re.match(r'Parser key "([^"]+)":', message.strip())
    inner = re.search(r'Parser key "([^"]+)":\s*(.*)', reason)
    key = None
    if inner:
        key = f"{outer.group(1)}.{inner.group(1)}" if outer else inner.group(1)
        reason = inner.group(2)
    elif outer:
        key = outer.group(1)
    given = re.search(r"^\s*Given value: (.*)$", message, re.M)
    if given and "Got value" not in reason and not re.match(r"(NestedArg|Namespace)\(", given.group(1)):
        reason += f"; got {given.group(1)}"
    return f"--{key}: {reason}" if key else reason


def _first_reason(message: str) -> str:
    """The first reason in a jsonargparse error (it lists one per type it tried, and the detail of
    a reason on the lines indented below it)."""
    lines = message.strip().splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith("- ") and not text.startswith("- Expected a <class 'NoneType'>"):
            indent = len(line) - len(line.lstrip())
            detail = [d.strip() for d in lines[i + 1 :] if len(d) - len(d.lstrip()) > indent + 2]
            stop = next(
                (j for j, d in enumerate(lines[i + 1 :]) if len(d) - len(d.lstrip()) <= indent + 2), len(detail)
            )
            return " ".join([text[2:], *detail[:stop]])
    return " ".join(line.strip() for line in lines[:2])


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(ArgumentParser):
    """jsonargparse's parser with errors as one `error: ...` line on stderr (exit code 2)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            super().error(message, ex)  # raises
        fail(first_reason(message))
