"""RAVEL's records: an (entity, template) query, a Cause or Iso interchange example built from
two of them, and the collate function that batches examples (CausalGym's, plus RAVEL's fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lit_interventions.datamodules.causalgym import collate as causalgym_collate

CAUSE, ISO = 0, 1


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
    """Fields named as `lit_interventions.datamodules.causalgym.Example`, so its collate function applies."""

    base_ids: list[int]
    source_ids: list[int]
    base_positions: dict[str, int]  # {"entity": last token of the entity}
    source_positions: dict[str, int]
    base_label: int  # A(E): the base's own answer for the attribute it queries
    source_label: int  # the label the intervened model should predict (collated as `label`)
    attribute: int  # index in data.attributes of the attribute the base queries
    kind: int  # CAUSE or ISO
    base_entity: int
    source_entity: int
    base_template: str
    source_template: str


def collate(examples: list[RavelExample], pad_id: int, padding_side: str = "right") -> dict:
    """CausalGym's collate (base/source padded apart, `*_pos`, `*_last`, `*_keys`), plus the
    RAVEL fields: label, attribute, kind, base_entity, source_entity."""
    batch = causalgym_collate(examples, region="entity", pad_id=pad_id, padding_side=padding_side)
    batch["label"] = batch.pop("source_label")
    for field in ("attribute", "kind", "base_entity", "source_entity"):
        batch[field] = torch.tensor([getattr(e, field) for e in examples])
    return batch
