"""The CausalGym sweep's report: summary.csv (Acc, overall odds, selectivity), then the heatmaps."""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from lit_interventions.artifacts.plots import DPI, heatmap_figure, save_figures
from lit_interventions.core.files import write_atomically

SUMMARY_COLUMNS = ["task", "method", "accuracy", "overall_odds", "selectivity"]


def overall(cells: dict[tuple[int, str], float], regions=None) -> float:
    """CausalGym eq. 19: the mean over layers of the best region's AvgOdds, the regions limited
    to `regions` if given (the task's `scored_regions`: from the first label-variable region on)."""
    best = defaultdict(lambda: -math.inf)
    for (layer, region), value in cells.items():
        if regions is None or region in regions:
            best[layer] = max(best[layer], value)
    return float(np.mean(list(best.values()))) if best else math.nan


def summarise(
    results: list[dict],
    accuracy: dict[str, float],
    regions: dict[str, list[str]],
    out: Path,
    scored: dict[str, list[str]] | None = None,
) -> list[dict]:
    """summary.csv (`write_summary`), then one heatmap per task and method (`write_heatmaps`):
    the summary rows. `scored` ({task: regions}, default: all of them) limits the overall odds and
    the selectivity to the regions from the first label-variable region on, as the paper's code
    does; the heatmaps show every region."""
    summary = write_summary(results, accuracy, out, scored)
    write_heatmaps(results, regions, summary, out)
    return summary


def store_rows(store, tasks: list[str], names: list[str], layers: list[int]) -> list[dict]:
    """The results rows of a sweep's store (`artifacts.results.ResultsStore`) of these tasks,
    methods and layers."""
    return [
        r for r in store.rows("results") if r["task"] in tasks and r["method"] in names and int(r["layer"]) in layers
    ]


def store_summary(store, scored: dict[str, list[str]], names, layers, out: Path) -> list[dict]:
    """summary.csv of a sweep's store rows of these tasks (`scored`: {task: its scored regions}),
    methods and layers (`write_summary`), the overall odds over each task's scored regions."""
    accuracy = {r["task"]: float(r["accuracy"]) for r in store.rows("accuracy")}
    return write_summary(store_rows(store, list(scored), names, layers), accuracy, out, scored)


def _cells(results: list[dict]) -> dict[tuple[str, str], dict[tuple[int, str], dict]]:
    """{(task, method): {(layer, region): row}}, in the rows' order."""
    grouped = defaultdict(dict)
    for row in results:
        grouped[(row["task"], row["method"])][(int(row["layer"]), row["region"])] = row
    return grouped


def summary_rows(
    results: list[dict], accuracy: dict[str, float], scored: dict[str, list[str]] | None = None
) -> list[dict]:
    """One row per (task, method): its Acc, overall odds and, where every site has the control,
    selectivity (see `summarise`)."""
    summary = []
    for (task, method), cells in _cells(results).items():
        odds = {site: float(r["odds"]) for site, r in cells.items()}
        kept = None if scored is None else scored[task]
        line = {
            "task": task,
            "method": method,
            "accuracy": accuracy.get(task, math.nan),
            "overall_odds": overall(odds, kept),
        }
        if all(r.get("control_odds") not in (None, "") for r in cells.values()):
            line["selectivity"] = overall(
                {s: float(r["odds"]) - float(r["control_odds"]) for s, r in cells.items()}, kept
            )
        summary.append(line)
    return summary


def write_summary(
    results: list[dict], accuracy: dict[str, float], out: Path, scored: dict[str, list[str]] | None = None
) -> list[dict]:
    """DIR/summary.csv (`summary_rows`), written whole; its rows."""
    return write_summary_csv(summary_rows(results, accuracy, scored), out)


def write_summary_csv(summary: list[dict], out: Path, columns: list[str] = SUMMARY_COLUMNS) -> list[dict]:
    """DIR/summary.csv of `summary` with `columns`, written whole; `summary`."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(summary)
    write_atomically(Path(out) / "summary.csv", text.getvalue())
    return summary


def write_heatmaps(results: list[dict], regions: dict[str, list[str]], summary: list[dict], out: Path) -> list[Path]:
    """DIR/heatmaps/TASK_METHOD.png, the layer × region odds of each (task, method) of `summary`,
    its overall odds in the title; every one tried, the first not written raised
    (`plots.FigureNotWritten`)."""
    return save_figures(_heatmaps(_cells(results), regions, summary, Path(out)), dpi=DPI)


def _heatmaps(grouped, regions, summary, out: Path):
    for line in summary:
        task, method = line["task"], line["method"]
        cells = grouped[(task, method)]
        layers = sorted({layer for layer, _ in cells})
        names = [r for r in regions[task] if any((layer, r) in cells for layer in layers)]
        matrix = np.full((len(layers), len(names)), np.nan)
        for (layer, region), row in cells.items():
            matrix[layers.index(layer), names.index(region)] = float(row["odds"])
        title = f"{task} · {method} · overall odds {line['overall_odds']:.2f}"
        yield heatmap_figure(matrix, layers, names, title)[0], out / "heatmaps" / f"{task}_{method}.png"
