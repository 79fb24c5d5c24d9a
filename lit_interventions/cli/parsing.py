"""One parser style (jsonargparse), one error style (a single `error: ...` line on stderr, exit
code 2) for every command, and `--config` files found by short name (`das.yaml`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

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
    """`args` with every `--config` value passed through `find_config`."""
    args = list(sys.argv[1:] if args is None else args)
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            arg = "--config=" + find_config(arg.split("=", 1)[1])
        elif i and args[i - 1] in ("--config", "-c"):
            arg = find_config(arg)
        out.append(arg)
    return out


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
