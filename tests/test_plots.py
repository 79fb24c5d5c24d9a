"""The sweep's layer × region heatmap stays readable for any grid: 1..40 layers, 1..12 regions."""

from __future__ import annotations

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from lit_interventions.artifacts.plots import DPI, heatmap_figure, odds_heatmap

REGIONS = [
    "subject",
    "verb_phrase",
    "object_noun",
    "attractor_np",
    "prefix",
    "s2",
    "s3",
    "s4",
    "s5",
    "main_verb",
    "object",
    "end",
]
TITLE = "agr_sv_num_pp · das · overall odds 2.31"


def _odds(layers: int, regions: int) -> np.ndarray:
    odds = np.random.default_rng(0).normal(0, 2, (layers, regions))
    odds[0, -1] = np.nan  # a site that was not run
    return odds


def _boxes_apart(boxes) -> bool:
    return all(
        a.x1 <= b.x0 + 1 or b.x1 <= a.x0 + 1 or a.y1 <= b.y0 + 1 or b.y1 <= a.y0 + 1
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )


def test_png_grows_with_the_grid(tmp_path):
    sizes = {}
    for layers, regions in [(1, 5), (2, 5), (18, 12)]:
        path = odds_heatmap(
            _odds(layers, regions), list(range(layers)), REGIONS[:regions], TITLE, tmp_path / f"{layers}x{regions}.png"
        )
        height, width = matplotlib.image.imread(path).shape[:2]
        sizes[layers, regions] = width, height
    assert sizes[1, 5][1] < sizes[2, 5][1] < sizes[18, 12][1]  # taller with more layers
    assert sizes[1, 5][0] == sizes[2, 5][0] < sizes[18, 12][0]  # wider with more regions
    assert sizes[1, 5][1] >= 200  # room for the colour bar even with one layer


@pytest.mark.parametrize("layers,regions", [(1, 1), (1, 5), (2, 5), (18, 12), (40, 12), (40, 1), (3, 12)])
def test_cells_are_visible_and_labels_apart(layers, regions):
    fig, ax = heatmap_figure(_odds(layers, regions), list(range(layers)), REGIONS[:regions], TITLE)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = ax.get_window_extent(renderer)
        cell_w, cell_h = box.width / regions, box.height / layers
        assert cell_w >= 0.5 * DPI and cell_h >= 0.2 * DPI, (cell_w, cell_h)  # at least 60 × 24 px
        figure = fig.bbox
        for artist in (ax.title, ax.xaxis.label, ax.yaxis.label, *fig.axes[1:]):  # nothing clipped (colour bar too)
            extent = artist.get_window_extent(renderer)
            assert figure.x0 - 1 <= extent.x0 and extent.x1 <= figure.x1 + 1, artist
            assert figure.y0 - 1 <= extent.y0 and extent.y1 <= figure.y1 + 1, artist
        assert len(fig.axes) == 2 and fig.axes[1].get_window_extent(renderer).height >= 0.8 * DPI  # a usable bar
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            boxes = [label.get_window_extent(renderer) for label in labels if label.get_text()]
            assert len(boxes) == len(labels) and _boxes_apart(boxes)
            assert all(figure.x0 - 1 <= b.x0 and b.x1 <= figure.x1 + 1 and b.y0 >= figure.y0 - 1 for b in boxes)
        written = [t.get_text() for t in ax.texts]
        if layers * regions <= 60:  # small grids show their values; the NaN cell shows none
            assert len(written) == layers * regions - 1 and all(text for text in written)
    finally:
        plt.close(fig)


def test_all_missing_or_constant_values_still_render(tmp_path):
    odds_heatmap(np.full((2, 3), np.nan), [0, 1], REGIONS[:3], TITLE, tmp_path / "nan.png")
    odds_heatmap(np.ones((2, 3)), [0, 1], REGIONS[:3], TITLE, tmp_path / "flat.png")
    assert (tmp_path / "nan.png").stat().st_size > 1000 and (tmp_path / "flat.png").stat().st_size > 1000
