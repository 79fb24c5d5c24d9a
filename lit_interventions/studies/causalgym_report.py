"""The CausalGym sweep's report: summary.csv (Acc, overall odds, selectivity) and the heatmaps."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from lit_interventions.artifacts.plots import odds_heatmap


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
    """summary.csv and one heatmap per task and method. `scored` ({task: regions}, default: all
    of them) limits the overall odds and the selectivity to the regions from the first
    label-variable region on, as the paper's code does; the heatmaps show every region."""
    grouped = defaultdict(dict)
    for row in results:
        grouped[(row["task"], row["method"])][(int(row["layer"]), row["region"])] = row
    summary = []
    for (task, method), cells in grouped.items():
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
        layers = sorted({layer for layer, _ in cells})
        names = [r for r in regions[task] if any((layer, r) in cells for layer in layers)]
        matrix = np.full((len(layers), len(names)), np.nan)
        for (layer, region), value in odds.items():
            matrix[layers.index(layer), names.index(region)] = value
        odds_heatmap(
            matrix,
            layers,
            names,
            f"{task} · {method} · overall odds {line['overall_odds']:.2f}",
            out / "heatmaps" / f"{task}_{method}.png",
        )
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "method", "accuracy", "overall_odds", "selectivity"])
        writer.writeheader()
        writer.writerows(summary)
    return summary
