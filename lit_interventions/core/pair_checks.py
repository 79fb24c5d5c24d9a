"""Checks on counterfactual pairs, run by the data modules before any model loads: a split whose
every pair has the same tokens on its base and source sides is refused (an interchange between
identical inputs changes nothing, so a method trained or scored on it gives odds 0 and means
nothing)."""

from __future__ import annotations

from collections.abc import Sequence


class IdenticalPairsError(ValueError):
    """Every pair of a split has its base tokens equal to its source tokens."""


def refuse_identical_pairs(examples: Sequence, split: str, what: str) -> None:
    """Raise `IdenticalPairsError` when `examples` (objects with `base_ids` and `source_ids`, and
    optionally `base_text`) is non-empty and every one has `base_ids == source_ids`; `what` names
    the data (e.g. "task 'agr_sv_num_pp'")."""
    if not examples or any(list(e.base_ids) != list(e.source_ids) for e in examples):
        return
    text = getattr(examples[0], "base_text", None)
    example = f" (e.g. {text!r})" if text is not None else ""
    raise IdenticalPairsError(
        f"every {split} pair of {what} has the same tokens as base and source{example}: an interchange "
        "between identical inputs changes nothing; make the base and source sentences differ (in a "
        "templates file: the label variable's options per type)"
    )
