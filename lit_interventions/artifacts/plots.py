"""Figures: the CausalGym layer × region heatmap of the log odds-ratio, RAVEL's attribute heatmap,
and how every figure is written.

`save_figure` writes a figure whole or not at all (`core.files.write_atomically`). The studies
write their results first and their figures last; a figure that cannot be written (a full disk:
an `OSError`) is `FigureNotWritten`, which `report_figures` turns into one `error:` line and exit
status 1 at the command line, the results already on disk.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lit_interventions.core.files import write_atomically  # noqa: E402

DPI = 120
FAILED = 1  # the exit status of a command whose results are written but a figure is not


class FigureNotWritten(OSError):
    """Figure `path` could not be written (`reason`: the `OSError`, e.g. no space left on the
    device); `others`: how many more of the same run's figures were not written either. The
    results it was drawn from are on disk."""

    def __init__(self, path: str | Path, reason: OSError, others: int = 0):
        self.path, self.reason, self.others = Path(path), reason, others
        more = f" (nor {others} more)" if others else ""
        super().__init__(
            reason.errno,
            f"figure {self.path} could not be written ({reason.strerror or reason}){more}; the results are "
            "written: rerun the same command to draw the figures once there is room (nothing is recomputed)",
        )

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return type(self), (self.path, self.reason, self.others)


def save_figure(fig, path: str | Path, **savefig) -> Path:
    """`fig` saved to `path` whole or not at all (a temporary file beside it, then renamed; its
    format from the suffix), and closed either way. An `OSError` is `FigureNotWritten`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:], **savefig))
    except FigureNotWritten:
        raise
    except OSError as err:
        raise FigureNotWritten(path, err) from err
    finally:
        plt.close(fig)
    return path


def save_figures(figures: Iterator[tuple[object, Path]], **savefig) -> list[Path]:
    """Each (figure, path) of `figures` saved (`save_figure`), every one tried; the first that
    could not be written is raised once all were tried, as `FigureNotWritten` counting the others."""
    written, failed = [], []
    for fig, path in figures:
        try:
            written.append(save_figure(fig, path, **savefig))
        except FigureNotWritten as err:
            failed.append(err)
    if failed:
        raise FigureNotWritten(failed[0].path, failed[0].reason, len(failed) - 1)
    return written


@contextmanager
def report_figures() -> Iterator[None]:
    """A command's block: `FigureNotWritten` inside it is one `error:` line on stderr and exit
    status 1 (`FAILED`); the results are already written."""
    try:
        yield
    except FigureNotWritten as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(FAILED) from None


def _grid_size(n_rows: int, n_cols: int, col_labels: list[str]) -> tuple[float, float, float, float, float]:
    """(figure width, figure height, cell width, cell height, x-label rotation), inches and degrees:
    cells sized from the grid (larger when there are few, never below a readable size), room for
    the region labels, the title and the colour bar."""
    cell_w = float(np.clip(7.0 / max(n_cols, 1), 0.6, 1.2))
    cell_h = float(np.clip(6.0 / max(n_rows, 1), 0.22, 0.6))
    longest = max((len(str(label)) for label in col_labels), default=1)
    rotation = 0.0 if longest * 0.075 < 0.9 * cell_w else 40.0  # labels that fit their cell stay flat
    label_h = 0.3 if rotation == 0 else 0.2 + 0.075 * longest * np.sin(np.radians(rotation))
    axes_h = max(n_rows * cell_h, 1.0)  # room for a readable colour bar beside a short grid
    width = 0.9 + n_cols * cell_w + 1.3  # y labels | cells | colour bar and its label
    height = 0.6 + axes_h + label_h + 0.45  # title | cells | region labels | x label
    return width, height, cell_w, axes_h / max(n_rows, 1), rotation


def heatmap_figure(odds: np.ndarray, layers: list[int], regions: list, title: str, xlabel: str = "region (last token)"):
    """The layer × region figure of `odds_heatmap`: (fig, ax). Cells are sized from the grid, so
    1 layer or 40, 1 region or 12, each cell stays visible and its labels apart; values are
    written in the cells when they fit; NaN (not run) cells are grey. `xlabel`: what the columns
    are (the head sweep's: attention heads)."""
    odds = np.asarray(odds, dtype=float).reshape(len(layers), len(regions))
    width, height, cell_w, cell_h, rotation = _grid_size(len(layers), len(regions), regions)
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI, layout="constrained")
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="#d9d9d9")  # not run: grey, not "lowest"
    finite = odds[np.isfinite(odds)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    image = ax.imshow(
        np.ma.masked_invalid(odds),
        origin="lower",
        aspect="auto",
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        interpolation="nearest",
    )
    ax.set_xticks(
        range(len(regions)),
        [str(r) for r in regions],
        rotation=rotation,
        ha="right" if rotation else "center",
        rotation_mode="anchor" if rotation else "default",
        fontsize=8,
    )
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=8 if len(layers) <= 24 else 7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    # minor ticks between cells: a thin white grid separates them
    ax.set_xticks(np.arange(-0.5, len(regions), 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(layers), 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    chars = max(20, int(width * 12))  # about 12 characters of 9 pt per inch
    ax.set_title(textwrap.fill(title, chars), fontsize=9)
    if cell_h >= 0.22 and cell_w >= 0.45 and odds.size <= 200:  # values in the cells when they fit
        for i, j in zip(*np.nonzero(np.isfinite(odds))):
            value = odds[i, j]
            dark = (value - vmin) / (vmax - vmin) < 0.55  # magma is dark at the bottom
            ax.text(
                j,
                i,
                f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}",
                ha="center",
                va="center",
                fontsize=7 if cell_h < 0.3 else 8,
                color="white" if dark else "black",
            )
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, aspect=max(8, min(25, 10 * cell_h * len(layers))))
    bar.set_label("log odds-ratio")
    bar.ax.tick_params(labelsize=8)
    return fig, ax


def odds_heatmap(odds: np.ndarray, layers: list[int], regions: list[str], title: str, path: str | Path) -> Path:
    """odds: (layers, regions) AvgOdds, NaN where a site was not run. Layer 0 at the bottom.
    Readable for 1..40 layers and 1..12 regions (see `heatmap_figure`)."""
    fig, _ = heatmap_figure(odds, layers, regions, title)
    return save_figure(fig, path, dpi=DPI)


def attribute_figure(rates: np.ndarray, rows: list[str], columns: list[str], title: str):
    """RAVEL's attribute heatmap (Fig. 3a): rates, (intervened attribute, queried attribute) in
    [0, 1], NaN where not run."""
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
    return fig
