"""The steering evaluation's results: DIR/generations.jsonl read back (to resume), each concept's
factor chosen on the select half and reported on the other, and DIR/factors.csv, DIR/summary.csv
and then DIR/steering.png written, each whole."""

from __future__ import annotations

import csv
import io
import json
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from lit_interventions.artifacts.plots import save_figure
from lit_interventions.core.files import write_atomically

SCORES = ["concept_score", "instruct_score", "fluency_score", "overall"]
SUMMARY_COLUMNS = ["method", "concept", "factor", *SCORES]
FACTOR_COLUMNS = ["method", "concept", "factor", "half", *SCORES, "n"]


def choose_and_report(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(summary rows, factor rows) from judged generations of one method.

    Per concept: mean scores per (factor, half); the factor with the best mean overall on the
    "select" half (ties: the smaller factor) is chosen, and its "report" half is the summary."""
    cells = defaultdict(list)
    for row in rows:
        cells[(row["method"], row["concept"], float(row["factor"]), row["half"])].append(row)
    factor_rows = []
    for (method, concept, factor, half), group in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        means = {s: float(np.mean([float(r[s]) for r in group])) for s in SCORES}
        factor_rows.append(
            {"method": method, "concept": concept, "factor": factor, "half": half, **means, "n": len(group)}
        )
    summary = []
    by_concept = defaultdict(dict)
    for row in factor_rows:
        by_concept[(row["method"], row["concept"])][(row["factor"], row["half"])] = row
    for (method, concept), table in by_concept.items():
        selectable = sorted(f for f, h in table if h == "select")
        if not selectable:
            continue
        best = max(selectable, key=lambda f: (table[(f, "select")]["overall"], -f))
        report = table.get((best, "report"))
        if report is not None:
            summary.append({"method": method, "concept": concept, "factor": best, **{s: report[s] for s in SCORES}})
    return summary, factor_rows


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    """The rows as CSV with these columns (other keys are left out), written whole."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, text.getvalue())


def plot_factors(factor_rows: list[dict], path: Path) -> Path:
    """Mean over concepts of each score against the factor, one line per half; written whole, or
    `plots.FigureNotWritten`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), sharex=True)
    for ax, score in zip(axes, SCORES):
        for half, style in (("select", "o-"), ("report", "s--")):
            by_factor = defaultdict(list)
            for row in factor_rows:
                if row["half"] == half:
                    by_factor[row["factor"]].append(row[score])
            factors = sorted(by_factor)
            ax.plot(factors, [np.mean(by_factor[f]) for f in factors], style, label=half)
        ax.set_title(score)
        ax.set_xlabel("steering factor")
        ax.set_ylim(-0.05, 2.05)
    axes[0].set_ylabel("judge score (0-2), mean over concepts")
    axes[-1].legend()
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def read_generations(path: Path) -> list[dict]:
    """The whole lines of DIR/generations.jsonl. A line cut by an interruption (and whatever follows
    it) is reported and cut off the file, so the redone cell is appended after a whole line."""
    if not path.is_file():
        return []
    rows, kept = [], 0
    data = path.read_bytes()
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            rows.append(json.loads(line))
        except ValueError:
            warnings.warn(
                f"{path}: line {number} is incomplete or damaged; it and what follows are dropped and their "
                "cells redone",
                stacklevel=2,
            )
            with path.open("r+b") as f:
                f.truncate(kept)
            break
        kept += len(line)
    return rows


def keep_whole_cells(path: Path, rows: list[dict], instructions: int) -> list[dict]:
    """The rows of the (concept, factor) cells that have all `instructions` rows. A cell with fewer
    (its last lines cut by an interruption) is redone whole, so its rows are dropped here and the
    file rewritten (atomically) without them: no row is ever written twice."""
    count = Counter((row["concept"], float(row["factor"])) for row in rows)
    kept = [row for row in rows if count[(row["concept"], float(row["factor"]))] >= instructions]
    if len(kept) < len(rows):
        warnings.warn(
            f"{path}: {len(rows) - len(kept)} rows of cells cut short are dropped; those cells are redone",
            stacklevel=2,
        )
        write_atomically(path, "".join(json.dumps(row) + "\n" for row in kept))
    return kept


def write_report(out: Path, rows: list[dict], cells: set[tuple[str, float]]) -> list[dict]:
    """Choose and report from the rows of the (concept, factor) `cells` of this run (others in the
    file are left out): DIR/factors.csv and DIR/summary.csv, then DIR/steering.png (a figure not
    written is `plots.FigureNotWritten`, the CSVs kept); the summary rows."""
    rows = [r for r in rows if (r["concept"], float(r["factor"])) in cells]
    summary, factor_rows = choose_and_report(rows)
    write_csv(out / "factors.csv", factor_rows, FACTOR_COLUMNS)
    write_csv(out / "summary.csv", summary, SUMMARY_COLUMNS)
    plot_factors(factor_rows, out / "steering.png")
    return summary
