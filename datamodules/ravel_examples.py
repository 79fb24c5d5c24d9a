"""RAVEL's records: an (entity, template) query, and a Cause or Iso interchange example built from
two of them (batched by `core.batch.collate_pairs`, the site at the entity's last token).
"""

from __future__ import annotations

from dataclasses import dataclass

REGION = "entity"  # the one region of a RAVEL prompt: the entity's last token is the site


@dataclass
class Query:
    """One (entity, template) pair: the prompt, its token ids and the entity's last token."""

    entity: str
    template: str
    attribute: str | None  # None for a Wikipedia prompt (it queries nothing)
    ids: list[int]
    entity_pos: int  # index in ids of the entity's last token


@dataclass
class RavelExample:
    """An interchange example, with the fields `core.batch.collate_pairs` reads (the source's own
    answer is not asked: the intervened model's answer is `target`)."""

    base_ids: list[int]
    source_ids: list[int]
    base_positions: dict[str, int]  # {"entity": last token of the entity}
    source_positions: dict[str, int]
    base_label: int  # A(E): the first token of the base's own answer for the attribute it queries
    target: int  # the first token of the label the intervened model should give
    attribute: int  # index in data.attributes of the attribute the base queries
    kind: int  # CAUSE or ISO
    base_entity: int
    source_entity: int
    base_template: str
    source_template: str
    answers: tuple[tuple[int, ...], tuple[int, ...]] = (
        (),
        (),
    )  # (the label's tokens, the base's own answer's), ≤ n each
    group: int = 0  # the base's prompt template (index into the data module's `templates`)
