"""The tutorial notebook (docs/tutorial.ipynb) runs top to bottom on the embedded models as a user
runs it: every cell in a Jupyter kernel, started from the docs folder, its shell commands through
the console script."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def _text(cell) -> str:
    """What a code cell printed (streams and plain-text results)."""
    parts = []
    for output in cell.get("outputs", []):  # each output on its own lines (stderr's bars end without one)
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(part for part in parts if part)


@pytest.mark.slow
def test_the_tutorial_notebook_runs(tmp_path, monkeypatch):
    # the repository's inputs linked into a scratch root, so the notebook's runs/ are written there
    for name in ("train.py", "configs", "examples", "checkpoints"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "docs").mkdir()
    decoys = tmp_path / "decoys"  # a `python` and a `lit-interventions` on PATH that are not the kernel's
    decoys.mkdir()
    for name in ("python", "python3", "lit-interventions"):
        (decoys / name).write_text("#!/bin/sh\necho 'a command ran from PATH, not the kernel' >&2\nexit 3\n")
        (decoys / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{decoys}{os.pathsep}{os.environ['PATH']}")
    nb = nbformat.read(ROOT / "docs" / "tutorial.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(tmp_path / "docs")}}
    )
    client.execute()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert _text(code[0]).strip() == "working in the repository root: True"
    assert _text(code[1]).startswith("48 pairs")
    fit = _text(code[2])
    assert "val/iia" in fit and "val/odds" in fit and "runs/tutorial/das/layer9/version_0" in fit
    assert (tmp_path / "runs/tutorial/sweep/heatmaps/pairs_diffmean.png").is_file()
    results = pd.read_csv(tmp_path / "runs/tutorial/sweep/results.csv")
    assert len(results) == 18 * 2 and set(results.region) == {"site", "last"}
    best = results.loc[results.groupby("region").odds.idxmax()].set_index("region").layer
    assert best["last"] > best["site"]  # number is read at the subject low, at the last token high
    for cell in code[-2:]:  # the DAS run on a new sentence, the dictionary on the chat model
        lines = dict(
            line.split(":", 1) for line in _text(cell).splitlines() if line.startswith(("unsteered", "steered"))
        )
        assert set(lines) == {"unsteered", "steered"} and lines["unsteered"].strip() != lines["steered"].strip()
