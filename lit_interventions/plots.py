"""Figures: the CausalGym layer × region heatmap of the log odds-ratio."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def odds_heatmap(odds: np.ndarray, layers: list[int], regions: list[str], title: str, path: str | Path) -> Path:
    """odds: (layers, regions) AvgOdds, NaN where a site was not run. Layer 0 at the bottom."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(regions), 1.2 + 0.32 * len(layers)))
    image = ax.imshow(np.ma.masked_invalid(odds), origin="lower", aspect="auto", cmap="magma")
    ax.set_xticks(range(len(regions)), regions, rotation=45, ha="right")
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("region (last token)")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="log odds-ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def attribute_heatmap(rates: np.ndarray, rows: list[str], columns: list[str], title: str, path: str | Path) -> Path:
    """rates: (intervened attribute, queried attribute) in [0, 1], NaN where not run (RAVEL Fig. 3a)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1.6 + 0.9 * len(columns), 1.2 + 0.6 * len(rows)))
    image = ax.imshow(np.ma.masked_invalid(rates), vmin=0, vmax=1, aspect="auto", cmap="viridis")
    for i in range(len(rows)):
        for j in range(len(columns)):
            if np.isfinite(rates[i, j]):
                ax.text(j, i, f"{rates[i, j]:.2f}", ha="center", va="center", color="w" if rates[i, j] < 0.6 else "k")
    ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("queried attribute")
    ax.set_ylabel("intervened attribute")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="fraction of answers changed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
