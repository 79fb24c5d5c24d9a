"""What the study scripts (sweeps, CALM, steering evaluation) share: the command line (a
function's arguments as options plus `--config FILE`, bad input as one `error:` line with exit
code 2, the summary rows printed one per line) and a resumable output directory (a meta.json
that ties it to one configuration; the results store of `lit_interventions.artifacts.results`)."""

from __future__ import annotations

import csv
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from jsonargparse import ActionConfigFile

from lit_interventions.cli.parsing import Parser, fail, resolve_configs
from lit_interventions.core.quiet import quiet_lightning


def print_rows(rows: list[dict], out: str | Path | None = None) -> None:
    """The summary rows as an aligned table (one header line, one line a row), then the
    directory the files are in."""
    if rows:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        cells = [[_cell(row.get(k)) for k in columns] for row in rows]
        widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
        for line in [columns, *cells]:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    if out is not None:
        print(f"files in {out}")
    sys.stdout.flush()


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def run_cli(
    function: Callable[..., list[dict]],
    description: str,
    args=None,
    customize=None,
    ignore=(),
    errors=(ValueError, FileNotFoundError),
) -> list[dict]:
    """Parse `args` for `function`, call it and print its rows. `customize(parser)` adds or
    replaces options; keys in `ignore` are parsed but not passed on. Bad input, found by the
    parser or by `function` (one of `errors`), is one `error:` line on stderr with exit code 2;
    `--config NAME` finds configs/NAME."""
    quiet_lightning()
    for name in ("lightning.pytorch", "lightning.fabric"):  # one Trainer per cell: keep its banner quiet
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = Parser(description=description.split("\n\n")[0], default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    if customize is not None:
        customize(parser)
    else:
        parser.add_function_arguments(function, as_positional=False)
    config = parser.parse_args(resolve_configs(args))
    skip = {"config", *ignore}
    kwargs = {k: v for k, v in config.as_dict().items() if k not in skip and not k.startswith("__")}
    try:
        rows = function(**kwargs)
    except errors as err:
        fail(str(err))
    print_rows(rows, kwargs.get("out"))
    return rows


def choose_names(value: str | list[str], valid: list[str], what: str) -> list[str]:
    """The names asked for (a name, a list, or 'all'), each checked against `valid`."""
    names = valid if value == "all" or value == ["all"] else ([value] if isinstance(value, str) else list(value))
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"Unknown {what} {unknown}; valid: {', '.join(valid)} (or 'all')")
    return names


def choose_layers(value: str | list[int], n_layers: int) -> list[int]:
    """The layers asked for (a list or 'all'), each in -1..n_layers-1 (-1: embeddings)."""
    layers = list(range(n_layers)) if value == "all" else ([value] if isinstance(value, int) else list(value))
    bad = [layer for layer in layers if not isinstance(layer, int) or not -1 <= layer < n_layers]
    if bad:
        raise ValueError(f"layers {bad} are out of range: this model has {n_layers} layers (-1..{n_layers - 1})")
    return layers


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV that the results store exported (always whole), or [] if there is none."""
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))
