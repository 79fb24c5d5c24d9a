"""The command line of the study scripts (sweeps, CALM, steering evaluation): a function's
arguments as options plus `--config FILE` (jsonargparse), bad input as one `error:` line with
exit code 2, and the returned summary rows printed one per line."""

from __future__ import annotations

import logging
from typing import Callable

from jsonargparse import ActionConfigFile, ArgumentParser


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def run_cli(function: Callable[..., list[dict]], description: str, args=None, customize=None, ignore=(),
            errors=(ValueError, FileNotFoundError)) -> list[dict]:  # fmt: skip
    """Parse `args` for `function`, call it and print its rows. `customize(parser)` adds or
    replaces options; keys in `ignore` are parsed but not passed on."""
    for name in ("lightning.pytorch", "lightning.fabric"):  # one Trainer per cell: keep its banner quiet
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = ArgumentParser(description=description.split("\n\n")[0], default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    if customize is not None:
        customize(parser)
    else:
        parser.add_function_arguments(function, as_positional=False)
    config = parser.parse_args(args)
    skip = {"config", *ignore}
    kwargs = {k: v for k, v in config.as_dict().items() if k not in skip and not k.startswith("__")}
    try:
        rows = function(**kwargs)
    except errors as err:
        parser.exit(2, f"error: {err}\n")
    print_rows(rows)
    return rows
