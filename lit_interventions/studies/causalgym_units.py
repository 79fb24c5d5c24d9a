"""The CausalGym sweep's units of work: (task, layers), and the place of a result row's unit."""

from __future__ import annotations


def sweep_units(
    tasks: list[str], layers: list[int], layers_per_unit: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep's units of work, (task, layers): per task, its layers in groups of
    `layers_per_unit` (None: all of them; one activation cache and one training loop per trained
    method per unit). Smaller groups spread a few tasks over many ranks."""
    if layers_per_unit is None:
        layers_per_unit = max(len(layers), 1)
    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int) or layers_per_unit < 1:
        raise ValueError(
            f"layers_per_unit={layers_per_unit!r} must be a positive integer (or None: all layers in one unit)"
        )
    groups = [tuple(layers[i : i + layers_per_unit]) for i in range(0, len(layers), layers_per_unit)]
    return [(task, group) for task in tasks for group in groups]


def unit_position(units: list[tuple[str, tuple[int, ...]]]):
    """A row's unit's place in `units` (-1: none of them), to merge the ranks' rows in that order."""
    index = {(task, layer): i for i, (task, group) in enumerate(units) for layer in group}
    first = {}
    for i, (task, _) in enumerate(units):
        first.setdefault(task, i)

    def position(table: str, row: dict) -> int:
        if table == "accuracy":
            return first.get(row["task"], -1)
        return index.get((row["task"], int(row["layer"])), -1)

    return position
