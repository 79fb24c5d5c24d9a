"""Counterfactual pairs files: one row per pair, read and checked before any model loads.

A row has `base`, `source` (the two sentences), `base_label`, `source_label` (the word each
sentence's own continuation is), and optionally `base_position` / `source_position` (a piece of
the sentence whose last token is the site; default: the sentence's last token), `split`
(train / val / test; rows without one are split by a seed) and `type` (`cause`, the default: the
intervened model should give `source_label`; `iso`: it should still give `base_label`, the
multi-task loss of MDAS / MDBM).

Read from a `.jsonl` file (one JSON object a line), a `.csv` file (a header row), a dataset
directory written by `datasets.save_to_disk`, a directory of data files, or a Hugging Face dataset
id (the last three through the `datasets` package). A bad row is one ValueError naming the file,
the row (a `.jsonl` file's line, a `.csv` file's row after the header, a dataset's index + 1)
and the field.
"""

from __future__ import annotations

import csv
import inspect
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

from lit_interventions.core.files import read_utf8

REQUIRED = ("base", "source", "base_label", "source_label")
OPTIONAL = ("base_position", "source_position", "split", "type")
SPLITS = ("train", "val", "test")
TYPES = ("cause", "iso")
FILE_SUFFIXES = (".jsonl", ".csv")
SAVED_DATASET = ("dataset_dict.json", "dataset_info.json", "state.json")  # what `save_to_disk` writes
DATASET_SPLITS = {"train": "train", "validation": "val", "val": "val", "test": "test"}  # a DatasetDict's names
INSTALL = "pip install datasets"


@dataclass(frozen=True)
class PairRow:
    """One checked row: `where` names it in messages ("pairs.jsonl row 7"); `split` is None until
    `assign_splits`; `kind` is "cause" or "iso"."""

    where: str
    base: str
    source: str
    base_label: str
    source_label: str
    base_position: str | None = None
    source_position: str | None = None
    split: str | None = None
    kind: str = "cause"


def read_pairs(path: str) -> list[PairRow]:
    """Every row of `path` (see the module doc), checked (`check_row`)."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"path={path!r}: give a .jsonl or .csv file, a dataset directory or a Hugging Face dataset id")
    return [check_row(where, raw) for where, raw in raw_rows(path)]


def raw_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row as read) of each row of `path`."""
    file = Path(path)
    if file.is_file():
        if file.suffix not in FILE_SUFFIXES:
            raise ValueError(f"{path}: a pairs file is .jsonl or .csv, not {file.suffix or 'no suffix'!r}")
        text = read_utf8(file)
        return _jsonl_rows(file.name, text) if file.suffix == ".jsonl" else _csv_rows(file.name, text)
    if not file.is_dir() and (file.suffix in FILE_SUFFIXES or path.startswith((".", "/", "~"))):
        raise ValueError(f"{path}: no such file")
    return _dataset_rows(path)


def _jsonl_rows(name: str, text: str) -> list[tuple[str, dict]]:
    rows = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} row {line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}, column {err.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a JSON object is needed, not {type(row).__name__}")
        rows.append((where, row))
    return rows


def _csv_rows(name: str, text: str) -> list[tuple[str, dict]]:
    rows = []
    for number, row in enumerate(csv.DictReader(io.StringIO(text, newline="")), 1):
        if None in row:
            raise ValueError(f"{name} row {number}: more values than the header has columns")
        rows.append((f"{name} row {number}", {k: v for k, v in row.items() if v is not None}))
    return rows


def _dataset_rows(path: str) -> list[tuple[str, dict]]:
    """A `save_to_disk` directory (`load_from_disk`), or a data directory or hub id
    (`load_dataset`). A DatasetDict of several splits gives each row its split's name (train,
    validation or val, test) unless the row names its own; one of a single split is unsplit."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"reading {path!r} (a dataset directory or a hub id) needs the datasets package: {INSTALL}"
        ) from None
    saved = Path(path).is_dir() and any((Path(path) / name).is_file() for name in SAVED_DATASET)
    # a hub dataset's loading script is code: never run (datasets < 3 would ask to run it)
    no_code = (
        {"trust_remote_code": False}
        if "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters
        else {}
    )
    loaded = datasets.load_from_disk(path) if saved else datasets.load_dataset(path, **no_code)
    if not isinstance(loaded, datasets.DatasetDict):
        return [(f"{path} row {i}", dict(row)) for i, row in enumerate(loaded, 1)]
    if len(loaded) == 1:
        ((name, part),) = loaded.items()
        return [(f"{path}[{name}] row {i}", dict(row)) for i, row in enumerate(part, 1)]
    rows = []
    for name, part in loaded.items():
        if name not in DATASET_SPLITS:
            raise ValueError(f"{path}: split {name!r} is not one of {', '.join(DATASET_SPLITS)}")
        for i, row in enumerate(part, 1):
            own = {k: v for k, v in dict(row).items() if v is not None}
            rows.append((f"{path}[{name}] row {i}", {"split": DATASET_SPLITS[name], **own}))
    return rows


def _text(where: str, row: dict, field: str, required: bool) -> str | None:
    """The field's string; None for an absent optional field (absent, null, or an empty CSV cell)."""
    value = row.get(field)
    if value is None or value == "":
        if required:
            raise ValueError(f"{where}: {field!r} is missing")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field!r} is {value!r}; a string is needed")
    if not value.strip():
        raise ValueError(f"{where}: {field!r} is empty")
    return value


def check_row(where: str, row: dict) -> PairRow:
    """A `PairRow` of one row as read, or a ValueError naming `where` and the field: a missing
    or empty required field, an unknown field, a position that does not occur in its sentence, a
    split or type not allowed, a Cause pair whose labels are equal, a pair whose sentences are."""
    unknown = [field for field in row if field not in REQUIRED + OPTIONAL]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(REQUIRED + OPTIONAL)}")
    values = {field: _text(where, row, field, True) for field in REQUIRED}
    values |= {field: _text(where, row, field, False) for field in OPTIONAL}
    for side in ("base", "source"):
        position = values[f"{side}_position"]
        if position is not None and position not in values[side]:
            raise ValueError(f"{where}: '{side}_position' {position!r} does not occur in {side} {values[side]!r}")
    split, kind = values.pop("split"), values.pop("type") or "cause"
    if split is not None and split not in SPLITS:
        raise ValueError(f"{where}: 'split' is {split!r}; choose one of {', '.join(SPLITS)}")
    if kind not in TYPES:
        raise ValueError(f"{where}: 'type' is {kind!r}; choose one of {', '.join(TYPES)}")
    if kind == "iso" and split not in (None, "train"):
        raise ValueError(f"{where}: 'split' is {split!r}, but an iso pair trains only; give it split train")
    if values["base"] == values["source"]:
        raise ValueError(
            f"{where}: 'source' is the same sentence as 'base'; an interchange between them changes nothing"
        )
    if kind == "cause" and values["base_label"] == values["source_label"]:
        raise ValueError(
            f"{where}: 'source_label' equals 'base_label' ({values['base_label']!r}); a cause pair's label "
            "must change (type iso: a pair whose label must not)"
        )
    return PairRow(where, **values, split=split, kind=kind)


def check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name}={value!r} must be a number in [0, 1)")


def assign_splits(rows: list[PairRow], val_fraction: float, test_fraction: float, seed: int) -> dict[str, list]:
    """{train, val, test: rows}: a row that names its split keeps it; the cause rows that do not
    are shuffled by `seed` and divided: round(n·val_fraction) to val, round(n·test_fraction) to
    test (at least 1 each when the fraction is above 0), the rest to train; iso rows to train."""
    check_fraction("val_fraction", val_fraction)
    check_fraction("test_fraction", test_fraction)
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction = {val_fraction + test_fraction}; it must stay below 1")
    splits = {split: [row for row in rows if row.split == split] for split in SPLITS}
    unsplit = [row for row in rows if row.split is None and row.kind == "cause"]
    splits["train"] += [row for row in rows if row.split is None and row.kind == "iso"]
    random.Random(seed).shuffle(unsplit)
    counts = [max(1, round(len(unsplit) * f)) if f > 0 and unsplit else 0 for f in (val_fraction, test_fraction)]
    splits["val"] += unsplit[: counts[0]]
    splits["test"] += unsplit[counts[0] : counts[0] + counts[1]]
    splits["train"] += unsplit[counts[0] + counts[1] :]
    return splits
