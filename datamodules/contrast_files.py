"""Contrast-pair files: texts that express a concept beside matched texts that do not, one pair
a row, read and checked before any model loads.

A row has `positive` (a text that expresses the concept) and `negative` (one that does not), and
optionally `prompt` (the user's turn both texts answer; without one each text is read alone),
`concept` (the concept's name; default: the data module's `concept`, else the file's stem) and
`split` (`train`, or `val` / `test`: held out for the AUROC; the rows without one are split by a
seed, `assign_splits`).

Read as counterfactual pairs files are (`pairs_files.raw_rows`): a `.jsonl` file (one JSON object
a line), a `.csv` file (a header row), a dataset directory written by `datasets.save_to_disk`, a
directory of data files, or a Hugging Face dataset id (the last three through the `datasets`
package, never running a dataset's code). A bad row is one ValueError naming the file, the row (a
`.jsonl` file's line, a `.csv` file's row after the header, a dataset's index + 1) and the field.

`concept_data` turns the split rows into AxBench's `ConceptData`: each pair gives a positive row
(instruction: the prompt, response: the positive text) and a negative row (the prompt and the
negative text), both carrying the pair's concept id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from lit_interventions.datamodules.axbench_files import COLUMNS, ConceptData
from lit_interventions.datamodules.pairs_files import FILE_SUFFIXES, check_fraction, raw_rows

REQUIRED = ("positive", "negative")
OPTIONAL = ("prompt", "concept", "split")
SPLITS = {"train": "train", "val": "eval", "test": "eval"}  # a row's split -> the served split
GENRE = "text"  # every contrast concept's genre (AxBench's `concept_genre`)


@dataclass(frozen=True)
class ContrastRow:
    """One checked row: `where` names it in messages ("contrast.jsonl row 7"); `prompt` is None
    for texts read alone; `split` is None until `assign_splits`."""

    where: str
    concept: str
    positive: str
    negative: str
    prompt: str | None = None
    split: str | None = None


def default_concept(path: str) -> str:
    """The name of a file's concept when its rows and the data module name none: the file's stem
    (`contrast.jsonl` -> `contrast`), or a directory's or a dataset id's last part."""
    name = Path(path.rstrip("/"))
    return name.stem if name.suffix in FILE_SUFFIXES else name.name


def read_contrast(path: str, concept: str | None = None) -> list[ContrastRow]:
    """Every row of `path` (see the module doc), checked (`check_row`); `concept` names the rows
    that give no concept (None: `default_concept`)."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"path={path!r}: give a .jsonl or .csv file, a dataset directory or a Hugging Face dataset id")
    if concept is not None and (not isinstance(concept, str) or not concept.strip()):
        raise ValueError(f"concept={concept!r}: give the concept's name, a non-empty string (or null: the file's stem)")
    file = Path(path)
    if file.is_file() and file.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{path}: a contrast file is .jsonl or .csv, not {file.suffix or 'no suffix'!r}")
    name = default_concept(path) if concept is None else concept
    rows = [check_row(where, raw, name) for where, raw in raw_rows(path)]
    if not rows:
        raise ValueError(f"{path} has no rows; each row needs 'positive' and 'negative'")
    return rows


def _field(where: str, row: dict, field: str, required: bool) -> str | None:
    """The field's string; None for an absent optional field (absent, null, or an empty CSV cell)."""
    value = row.get(field)
    if value is None or (value == "" and not required):
        if required:
            raise ValueError(f"{where}: {field!r} is missing")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field!r} is {repr(value)[:60]}; a string is needed")
    if not value.strip():
        raise ValueError(f"{where}: {field!r} is empty")
    return value


def check_row(where: str, row: dict, concept: str) -> ContrastRow:
    """A `ContrastRow` of one row as read (`concept`: the name of a row that gives none), or a
    ValueError naming `where` and the field: a missing, empty or non-string field, an unknown
    field, a split not allowed, a pair whose two texts are the same."""
    unknown = [field for field in row if field not in REQUIRED + OPTIONAL]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(REQUIRED + OPTIONAL)}")
    values = {field: _field(where, row, field, True) for field in REQUIRED}
    values |= {field: _field(where, row, field, False) for field in OPTIONAL}
    if values["split"] is not None and values["split"] not in SPLITS:
        raise ValueError(f"{where}: 'split' is {values['split']!r}; choose one of {', '.join(SPLITS)}")
    if values["positive"] == values["negative"]:
        raise ValueError(
            f"{where}: 'negative' is the same text as 'positive'; a contrast pair needs two different texts"
        )
    values["concept"] = values["concept"] or concept
    return ContrastRow(where, **values)


def assign_splits(rows: list[ContrastRow], eval_fraction: float, seed: int, name: str) -> dict[str, list]:
    """{train, eval: rows}, concept by concept: a row that names its split keeps it (`val` and
    `test` are the eval split); a concept's rows that do not are shuffled by `seed` and divided:
    round(n·eval_fraction) to eval (at least 1 when eval_fraction is above 0), the rest to train.
    A concept left without train or eval rows is a ValueError naming it (`name`: the file)."""
    check_fraction("eval_fraction", eval_fraction)
    splits = {"train": [], "eval": []}
    for concept in dict.fromkeys(row.concept for row in rows):
        own = [row for row in rows if row.concept == concept]
        unsplit = [row for row in own if row.split is None]
        random.Random(seed).shuffle(unsplit)
        held_out = max(1, round(len(unsplit) * eval_fraction)) if eval_fraction > 0 and unsplit else 0
        found = {
            "train": [row for row in own if row.split == "train"] + unsplit[held_out:],
            "eval": [row for row in own if row.split in ("val", "test")] + unsplit[:held_out],
        }
        for split, chosen in found.items():
            if not chosen:
                need = "a dictionary needs training rows" if split == "train" else "its AUROC needs held-out rows"
                fill = "more rows without a split" if split == "train" else "eval_fraction above 0"
                raise ValueError(
                    f"{name}: concept {concept!r} has 0 {split} rows of its {len(own)} ({need}); give rows "
                    f"split {'train' if split == 'train' else 'test'!r}, or {fill}"
                )
            splits[split] += chosen
    return splits


def _table(rows: list[ContrastRow], index: dict[str, int]) -> pd.DataFrame:
    """The AxBench rows of contrast pairs: a positive and a negative row per pair (`COLUMNS`)."""
    records = [
        {
            "input": row.prompt or "",
            "output": text,
            "output_concept": row.concept,
            "concept_genre": GENRE,
            "category": category,
            "dataset_category": "contrast",
            "concept_id": index[row.concept],
        }
        for row in rows
        for category, text in (("positive", row.positive), ("negative", row.negative))
    ]
    return pd.DataFrame(records, columns=COLUMNS).astype({"concept_id": "int64"})


def concept_data(splits: dict[str, list[ContrastRow]], path: str) -> ConceptData:
    """AxBench's `ConceptData` of split contrast rows: concepts numbered in the order they first
    appear, each pair's positive and negative rows carrying its concept's id, an empty `input` for
    texts read alone."""
    concepts = list(dict.fromkeys(row.concept for rows in splits.values() for row in rows))
    index = {concept: i for i, concept in enumerate(concepts)}
    train, evaluation = _table(splits["train"], index), _table(splits["eval"], index)
    return ConceptData(train, evaluation, concepts, [GENRE] * len(concepts), Path(path), Path(path))
