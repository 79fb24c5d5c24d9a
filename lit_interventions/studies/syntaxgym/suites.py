"""SyntaxGym test suites: read and check the JSON (`meta`, `predictions`, `items`).

A suite has items; an item has conditions; a condition is a list of regions with `content`.
Every prediction is parsed (`formulas.parse_formula`) and every region it reads must exist in
every item, so a bad suite is refused before any model is loaded.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from lit_interventions.core.files import read_utf8
from lit_interventions.core.surprisal import METRICS
from lit_interventions.studies.syntaxgym.formulas import Node, RegionValues, parse_formula, region_refs


@dataclass(frozen=True)
class Prediction:
    formula: str
    tree: Node

    def holds(self, values: RegionValues) -> bool:
        return bool(self.tree.evaluate(values))


@dataclass(frozen=True)
class Suite:
    name: str
    metric: str
    predictions: list[Prediction]
    items: list[dict]


def _check_regions_exist(name: str, prediction: Prediction, items: list[dict]) -> None:
    """Every (region;%condition%) a formula reads must exist in every item."""
    for item in items:
        regions = {
            condition["condition_name"]: {region["region_number"] for region in condition["regions"]}
            for condition in item["conditions"]
        }
        for ref in region_refs(prediction.tree):
            if ref.condition not in regions:
                raise ValueError(
                    f"suite {name!r}: formula {prediction.formula!r} reads condition {ref.condition!r}, which item "
                    f"{item.get('item_number')} lacks; its conditions are {sorted(regions)}"
                )
            if ref.region is not None and ref.region not in regions[ref.condition]:
                raise ValueError(
                    f"suite {name!r}: formula {prediction.formula!r} reads region {ref.region} of condition "
                    f"{ref.condition!r}, which item {item.get('item_number')} lacks; its regions are "
                    f"{sorted(regions[ref.condition])}"
                )


def _check_item(where: str, item) -> None:
    """An item is {"conditions": [{"condition_name", "regions": [{"region_number", "content"}]}]}."""
    conditions = item.get("conditions") if isinstance(item, dict) else None
    if not isinstance(conditions, list) or not conditions:
        raise ValueError(f"{where}: item {item!r:.80} has no 'conditions' list")
    for condition in conditions:
        regions = condition.get("regions") if isinstance(condition, dict) else None
        if not isinstance(regions, list) or "condition_name" not in condition:
            raise ValueError(f"{where}: condition {condition!r:.80} needs a 'condition_name' and a 'regions' list")
        for region in regions:
            if (
                not isinstance(region, dict)
                or not isinstance(region.get("region_number"), int)
                or not isinstance(region.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: region {region!r:.80} needs an integer 'region_number' and a string 'content'"
                )


def suite_from_json(data: dict, source: str) -> Suite:
    """A checked Suite from SyntaxGym JSON; `source` (a path) names it in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a SyntaxGym suite is a JSON object with meta, predictions and items")
    meta = data.get("meta") or {}
    name = meta.get("name") or Path(source).stem
    metric = meta.get("metric", "sum")
    if metric not in METRICS:
        raise ValueError(
            f"suite {name!r} ({source}): meta.metric={metric!r} is not supported; choose one of {list(METRICS)}"
        )
    items = data.get("items")
    if not isinstance(items, list) or not items:
        raise ValueError(f"suite {name!r} ({source}) has no items; a suite needs a non-empty 'items' list")
    for item in items:
        _check_item(f"suite {name!r} ({source})", item)
    raw = data.get("predictions")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"suite {name!r} ({source}) has no predictions; a suite needs a non-empty 'predictions' list")
    predictions = []
    for entry in raw:
        if not isinstance(entry, dict) or entry.get("type", "formula") != "formula" or "formula" not in entry:
            raise ValueError(f"suite {name!r} ({source}): prediction {entry!r} is not of type 'formula'")
        predictions.append(Prediction(entry["formula"], parse_formula(entry["formula"], suite=name)))
    for prediction in predictions:
        _check_regions_exist(name, prediction, items)
    return Suite(name, metric, predictions, items)


def load_suite(path: str | Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suite file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"suite file {path} is empty; fetch the SyntaxGym suites with {fetch_command(path)}")
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    return suite_from_json(data, str(path))


def fetch_command(path: Path) -> str:
    """The command that downloads the published SyntaxGym suites into `path` (a directory; a
    path ending in .json stands for the directory it is in)."""
    directory = path.parent if path.suffix == ".json" else path
    return f"`lit-interventions data syntaxgym --out {shlex.quote(str(directory))}`"


def suite_paths(paths: list[str]) -> list[Path]:
    """A directory stands for every *.json in it (sorted); files are taken as given."""
    found = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            if not files:
                raise FileNotFoundError(
                    f"no *.json suite files in directory {path}; fetch the SyntaxGym suites with {fetch_command(path)}"
                )
            found.extend(files)
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(
                f"--suites path not found: {path} (give a directory of *.json or suite files); "
                f"fetch the SyntaxGym suites with {fetch_command(path)}"
            )
    return found
