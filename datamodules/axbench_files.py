"""Reading AxBench concept data: a concept directory in the published layout (parquet, or our
JSONL), its metadata, the per-concept row counts a run needs, and the steering instructions.

A concept directory holds `train_data.*` (72 positives per concept and a shared negative pool with
concept_id -1), `latent_eval_data.*` (per concept: positives, negatives and hard negatives, each
row carrying the concept id it is evaluated for) and `metadata.jsonl` ({concept_id, concept, ref,
concept_genres_map}). The built-in set in `datamodules/data/axbench/` is ours (see its README).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lit_interventions.core.files import read_utf8
from lit_interventions.metrics.detection import UNSCORED

BUILTIN_DIR = Path(__file__).parent / "data" / "axbench"
COLUMNS = ["input", "output", "output_concept", "concept_genre", "category", "dataset_category", "concept_id"]
CATEGORIES = {"negative": 0, "positive": 1, "hard negative": 2}  # the batch's `category` codes
NEGATIVE_POOL = -1  # concept_id of the shared negative pool in train
# The eval label of each category, by `hard_negatives`: "drop" leaves hard negatives out of the
# AUROC (AxBench's AUCROCEvaluator has no label for them), "negative" scores them as negatives.
EVAL_LABELS = {
    "drop": {"positive": 1, "negative": 0, "hard negative": UNSCORED},
    "negative": {"positive": 1, "negative": 0, "hard negative": 0},
}


@dataclass
class ConceptData:
    """Train and eval rows; `concepts[i]` is the concept whose rows carry concept_id i."""

    train: pd.DataFrame
    eval: pd.DataFrame
    concepts: list[str]
    genres: list[str]
    train_path: Path | None = None
    eval_path: Path | None = None


def _read_table(directory: Path, stem: str) -> tuple[pd.DataFrame, Path]:
    """The table `stem` of a concept directory (parquet, else JSONL) and its path."""
    for suffix in (".parquet", ".jsonl"):
        path = directory / f"{stem}{suffix}"
        if path.exists():
            return (_read_parquet(path) if suffix == ".parquet" else _read_jsonl_table(path)), path
    raise FileNotFoundError(f"Missing {directory / stem}.parquet (or .jsonl) in concept directory {directory}")


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as err:  # ArrowInvalid (truncated, not parquet), OSError: name the file
        raise ValueError(f"{path} is not a readable parquet file ({_first_line(err)}); download it again") from None


def _read_jsonl_table(path: Path) -> pd.DataFrame:
    """A JSONL table; a line that is not a JSON object is named by its number."""
    try:
        return pd.read_json(path, lines=True, dtype=False, encoding="utf-8-sig")
    except ValueError as err:
        json_lines(path)  # names the first bad line
        raise ValueError(f"{path} is not a readable JSONL table ({_first_line(err)})") from None


def json_lines(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped); a ValueError naming the
    file and the line when a line is not a JSON object or the file is not UTF-8 text."""
    text = read_utf8(path)
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # JSONL lines end at \n only
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}, line {number}: not valid JSON at column {err.colno} ({err.msg}); "
                "fix the line or download the data again"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}: a JSON {type(row).__name__}, not an object")
        rows.append(row)
    return rows


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def _check_columns(table: pd.DataFrame, path: Path, columns: list[str]) -> None:
    """A ValueError naming the file unless `table` has every one of `columns`."""
    for column in columns:
        if column not in table.columns:
            raise ValueError(f"{path} has no column {column!r}; columns: {', '.join(map(str, table.columns))}")


def _read_metadata(path: Path) -> list[dict]:
    """The rows of metadata.jsonl, each checked to have a concept_id and a concept."""
    if not path.exists():
        raise FileNotFoundError(
            f"Missing {path} (one JSON object per concept: concept_id, concept, concept_genres_map)"
        )
    rows = json_lines(path)
    for row in rows:
        for key in ("concept_id", "concept"):
            if key not in row:
                raise ValueError(f"{path}: a row has no field {key!r}: {row}")
        try:
            int(row["concept_id"])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: concept_id={row['concept_id']!r} is not an integer") from None
    return rows


FILES = (
    "metadata.jsonl",
    "train_data.parquet",
    "train_data.jsonl",
    "latent_eval_data.parquet",
    "latent_eval_data.jsonl",
)


def fetch_command(directory: Path) -> str:
    """The command that downloads AxBench's Concept10 into `directory` (and its larger set)."""
    return f"`lit-interventions data axbench-concept10 --out {shlex.quote(str(directory))}` (or axbench-concept500)"


def check_concept_dir(directory: Path) -> None:
    """A FileNotFoundError naming the command that fetches AxBench when `directory` does not exist
    or holds none of a concept directory's files."""
    if not directory.is_dir():
        raise FileNotFoundError(
            f"Concept directory {directory} does not exist; fetch AxBench with {fetch_command(directory)}"
        )
    if not any((directory / name).is_file() for name in FILES):
        raise FileNotFoundError(
            f"Concept directory {directory} holds no AxBench files (metadata.jsonl, train_data.parquet, "
            f"latent_eval_data.parquet); fetch them with {fetch_command(directory)}"
        )


def load_concepts(concept_dir: str | Path | None = None) -> ConceptData:
    """Read a concept directory (None: our built-in set); concept ids become 0..C-1 in metadata order
    (sorted by the published id), -1 stays the shared negative pool."""
    directory = BUILTIN_DIR if concept_dir is None else Path(concept_dir)
    check_concept_dir(directory)
    metadata = sorted(_read_metadata(directory / "metadata.jsonl"), key=lambda row: int(row["concept_id"]))
    train, train_path = _read_table(directory, "train_data")
    evaluation, eval_path = _read_table(directory, "latent_eval_data")
    for table, path in ((train, train_path), (evaluation, eval_path)):
        _check_columns(table, path, COLUMNS)
        unknown = sorted(set(table["category"]) - set(CATEGORIES))
        if unknown:
            raise ValueError(f"{path}: unknown category {unknown}; allowed: {sorted(CATEGORIES)}")
    remap = {int(row["concept_id"]): i for i, row in enumerate(metadata)}
    remap[NEGATIVE_POOL] = NEGATIVE_POOL
    for table, path in ((train, train_path), (evaluation, eval_path)):
        unknown = sorted(set(table["concept_id"].astype(int)) - set(remap))
        if unknown:
            raise ValueError(f"{path}: concept ids {unknown} are not in {directory / 'metadata.jsonl'}")
        table["concept_id"] = table["concept_id"].astype(int).map(remap).astype("int64")
    if (evaluation["concept_id"] == NEGATIVE_POOL).any():
        raise ValueError(f"{eval_path}: every eval row needs the concept id it is evaluated for; found concept_id -1")
    concepts = [str(row["concept"]) for row in metadata]
    genres = []
    for i, row in enumerate(metadata):
        genre = (row.get("concept_genres_map") or {}).get(row["concept"])
        if not genre:  # fall back to the genre written on the concept's positives
            genre = train.loc[train["concept_id"] == i, "concept_genre"].head(1).tolist() or ["text"]
        genres.append(genre[0] if isinstance(genre, (list, tuple)) else str(genre))
    return ConceptData(
        train.reset_index(drop=True), evaluation.reset_index(drop=True), concepts, genres, train_path, eval_path
    )


def check_counts(data: ConceptData, concept_ids: list[int], hard_negatives: str = "drop") -> None:
    """Every selected concept needs training positives and, in the eval split, positives and
    negatives (AUROC and the max activation need both; hard negatives count as negatives only with
    `hard_negatives="negative"`); else a ValueError naming the file, the split, the concept and
    the count. Called before any model is loaded."""
    train, evaluation = data.train, data.eval
    where = {"train": data.train_path or "train_data", "eval": data.eval_path or "latent_eval_data"}
    chosen = f"{len(concept_ids)} selected concept(s)"
    train_rows = train[train["concept_id"].isin(concept_ids)]
    if len(train_rows) == 0:
        raise ValueError(
            f"{where['train']}: the train split has 0 rows for the {chosen} "
            f"(of {len(train)} rows in the file); a dictionary needs training data"
        )
    eval_rows = evaluation[evaluation["concept_id"].isin(concept_ids)]
    if len(eval_rows) == 0:
        raise ValueError(
            f"{where['eval']}: the eval split has 0 rows for the {chosen} (of {len(evaluation)} rows in "
            "the file); detection (AUROC) and the max activations need eval data"
        )
    for c in concept_ids:
        name = data.concepts[c]
        positives = int(((train["concept_id"] == c) & (train["category"] == "positive")).sum())
        if positives == 0:
            raise ValueError(
                f"{where['train']}: concept {c} ({name!r}) has 0 positive rows in the train split; "
                "each concept needs at least 1"
            )
        labels = evaluation.loc[evaluation["concept_id"] == c, "category"].map(EVAL_LABELS[hard_negatives])
        n_pos, n_neg = int((labels == 1).sum()), int((labels == 0).sum())
        if n_pos == 0 or n_neg == 0:
            counted = "negative" if hard_negatives == "drop" else "negative or hard negative"
            raise ValueError(
                f"{where['eval']}: concept {c} ({name!r}) has {n_pos} positive and {n_neg} {counted} rows "
                f"in the eval split (hard_negatives={hard_negatives!r}); its AUROC needs at least 1 of each"
            )


def load_instructions(path: str | Path | None = None) -> list[str]:
    """Steering-evaluation instructions (default: our own, `data/axbench/instructions.json`)."""
    path = BUILTIN_DIR / "instructions.json" if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Missing instruction file {path}")
    try:
        instructions = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})") from None
    if not isinstance(instructions, list) or not all(isinstance(x, str) for x in instructions):
        raise ValueError(f"{path} must hold a JSON list of strings")
    return instructions
