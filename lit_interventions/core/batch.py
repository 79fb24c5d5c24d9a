"""The batch of an interchange intervention: a base side and a source side, built by one collate.

`collate_pairs` pads each side apart and records, per row, the site (the region's last token), the
last real token (where logits are read) and the label token. Every pair benchmark collates through
it (CausalGym; RAVEL adds its entities and its target). The activation cache reads its keys from
a side (`Side.keys`: each row's unpadded token ids and where they start), computed on the host
once, before the batch moves to a device.

An example given to `collate_pairs` has `base_ids` / `source_ids` (token ids), `base_positions` /
`source_positions` ({region: last token}), `base_label` / `source_label` (token ids; a source
label may be None) and `kind` (CAUSE or ISO); optionally `base_type` / `source_type` (the
sentence's class, e.g. "sg"), `base_entity` / `source_entity`, `attribute` (the queried
attribute's index) and `target` (the token the intervened model should give; default: the
source's label for a Cause example, the base's for an Iso one); and `answers` (the token ids of
the target's answer and of the base's own, each up to n tokens: RAVEL's generated answers) and
`group` (an index the metric averages within, RAVEL's prompt template).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from lit_interventions.core.tokens import pad_batch

CAUSE, ISO = 0, 1  # an example's kind: the answer must change to the source's / must stay the base's
SIDES = ("base", "source")
LABEL_KEYS = ("source_label", "base_label", "label")  # what an objective's `label_key` may name
ROWWISE = ("target", "kind", "attribute", "answers", "group")  # a PairBatch's per-row tensors

Key = tuple[int, ...]


def input_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[Key], list[int]]:
    """Unpadded token ids of each row, and the index of each row's first real token."""
    keys, starts = [], []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        real = [i for i, m in enumerate(mask) if m]
        keys.append(tuple(ids[i] for i in real))
        starts.append(real[0])
    return keys, starts


@dataclass
class Side:
    """One side (base or source) of a pair batch.

    input_ids, attention_mask: (batch, width), padded; pos: each row's site, (batch,); last:
    each row's last real token, (batch,); label: each row's own answer token, (batch,), or None;
    regions: {region: (batch,)} the last token of every region all rows have (composed sites);
    types: each sentence's class, host-side strings, or None; entity: each row's entity index
    (RAVEL), or None."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor
    label: torch.Tensor | None = None
    regions: dict[str, torch.Tensor] = field(default_factory=dict)
    types: list[str] | None = None
    entity: torch.Tensor | None = None
    _host: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos: torch.Tensor | None = None) -> Side:
        """A side from padded ids alone: `last` from the mask, `pos` (default) the last token."""
        last = torch.tensor([max(i for i, m in enumerate(row) if m) for row in attention_mask.tolist()])
        last = last.to(input_ids.device)
        return cls(input_ids, attention_mask, last if pos is None else pos, last)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def keys(self) -> tuple[list[Key], list[int]]:
        """The activation cache's keys: each row's unpadded token ids, and the index of its first
        real token (`input_keys`), read on the host once."""
        return self._read_host()[0]

    @property
    def sites(self) -> list[int]:
        """`pos` on the host, as a list."""
        return self._read_host()[1]

    def _read_host(self) -> tuple:
        if self._host is None:
            self._host = (input_keys(self.input_ids, self.attention_mask), self.pos.tolist())
        return self._host

    def _map(self, fn) -> Side:
        """This side with `fn` applied to each tensor (host-side fields carried over; the keys are
        the caller's to carry)."""
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if f.init and torch.is_tensor(getattr(self, f.name))
            },
            regions={region: fn(positions) for region, positions in self.regions.items()},
        )

    def to(self, device, **kwargs) -> Side:
        """On `device`, keeping the host-side keys (read here first, while the ids are on the host)."""
        host = self._read_host() if self.input_ids.device.type == "cpu" else self._host
        moved = self._map(lambda t: t.to(device, **kwargs))
        moved._host = host
        return moved

    def rows(self, rows: Sequence[int]) -> Side:
        """The rows `rows`, in that order."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.input_ids.device)
        part = self._map(lambda t: t[index])
        part.types = None if self.types is None else [self.types[i] for i in rows]
        if self._host is not None:
            (keys, starts), sites = self._host
            part._host = (([keys[i] for i in rows], [starts[i] for i in rows]), [sites[i] for i in rows])
        return part

    def padded(self, width: int, padding_side: str = "right") -> Side:
        """Padded with zeros to `width` columns on `padding_side` (positions shifted on the left)."""
        pad = width - self.input_ids.shape[1]
        if pad == 0:
            return self
        spec, shift = ((pad, 0), pad) if padding_side == "left" else ((0, pad), 0)
        out = replace(
            self,
            input_ids=F.pad(self.input_ids, spec),
            attention_mask=F.pad(self.attention_mask, spec),
            pos=self.pos + shift,
            last=self.last + shift,
            regions={region: positions + shift for region, positions in self.regions.items()},
        )
        if self._host is not None:
            (keys, starts), sites = self._host
            out._host = ((keys, [start + shift for start in starts]), [site + shift for site in sites])
        return out

    @classmethod
    def cat(cls, sides: Sequence[Side], padding_side: str = "right") -> Side:
        """The rows of `sides` in order, padded to the widest (on `padding_side`). Regions: those
        every side has; types and entities: where every side has them."""
        width = max(side.input_ids.shape[1] for side in sides)
        sides = [side.padded(width, padding_side) for side in sides]

        def joined(name):
            values = [getattr(side, name) for side in sides]
            return None if any(v is None for v in values) else torch.cat(values)

        shared = set.intersection(*(set(side.regions) for side in sides))
        out = cls(
            joined("input_ids"),
            joined("attention_mask"),
            joined("pos"),
            joined("last"),
            joined("label"),
            {region: torch.cat([side.regions[region] for side in sides]) for region in sorted(shared)},
            None if any(side.types is None for side in sides) else [t for side in sides for t in side.types],
            joined("entity"),
        )
        hosts = [side._read_host() for side in sides]
        out._host = (
            ([k for (keys, _), _ in hosts for k in keys], [s for (_, starts), _ in hosts for s in starts]),
            [site for _, sites in hosts for site in sites],
        )
        return out

    def same_inputs(self, other: Side) -> bool:
        """Whether `other` has the same rows but for their labels."""
        return (
            _equal(self.input_ids, other.input_ids)
            and _equal(self.attention_mask, other.attention_mask)
            and _equal(self.pos, other.pos)
            and _equal(self.last, other.last)
            and self.regions.keys() == other.regions.keys()
            and all(_equal(self.regions[r], other.regions[r]) for r in self.regions)
            and self.types == other.types
            and _equal(self.entity, other.entity)
        )


@dataclass
class PairBatch:
    """Interchange pairs: the base and source sides, and per row the token the intervened model
    should give (`target`: the source's answer for a Cause example, the base's own for an Iso
    one), its `kind` (CAUSE or ISO) and the queried `attribute` (RAVEL; 0 elsewhere). RAVEL adds
    `answers`, (batch, 2, n): the target's tokens and the base's own, −100 past a shorter answer,
    and `group`, (batch,): each row's prompt template; None elsewhere."""

    base: Side
    source: Side
    target: torch.Tensor
    kind: torch.Tensor
    attribute: torch.Tensor
    answers: torch.Tensor | None = None
    group: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.base)

    def _rowwise(self, fn) -> dict:
        """target, kind, attribute, answers and group with `fn` applied (None stays None)."""
        return {
            name: getattr(self, name) if getattr(self, name) is None else fn(getattr(self, name)) for name in ROWWISE
        }

    def side(self, name: str) -> Side:
        """The side called `name` ("base" or "source")."""
        if name not in SIDES:
            raise ValueError(f"side={name!r}; choose one of {SIDES}")
        return self.base if name == "base" else self.source

    def labels(self, key: str) -> torch.Tensor:
        """The labels an objective's `label_key` names: "source_label" (y_s), "base_label" (y_b)
        or "label" (the target)."""
        if key not in LABEL_KEYS:
            raise ValueError(f"label_key={key!r}; choose one of {LABEL_KEYS}")
        found = {"source_label": self.source.label, "base_label": self.base.label, "label": self.target}[key]
        if found is None:
            raise ValueError(f"this data has no {key} (RAVEL's batches give `label`, the target)")
        return found

    def to(self, device, **kwargs) -> PairBatch:
        """On `device` (Lightning's batch transfer calls this)."""
        return PairBatch(
            self.base.to(device, **kwargs),
            self.source.to(device, **kwargs),
            **self._rowwise(lambda t: t.to(device, **kwargs)),
        )

    def rows(self, rows: Sequence[int]) -> PairBatch:
        """The rows `rows`, in that order."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.target.device)
        return PairBatch(self.base.rows(rows), self.source.rows(rows), **self._rowwise(lambda t: t[index]))

    @classmethod
    def cat(cls, batches: Sequence[PairBatch], padding_side: str = "right") -> PairBatch:
        """The rows of `batches` in order, each side padded to its widest (on `padding_side`)."""

        def joined(name):
            values = [getattr(batch, name) for batch in batches]
            if any(v is None for v in values):
                return None
            if name == "answers":  # as wide as the widest, −100 past a shorter answer
                width = max(v.shape[-1] for v in values)
                values = [F.pad(v, (0, width - v.shape[-1]), value=-100) for v in values]
            return torch.cat(values)

        return cls(
            Side.cat([batch.base for batch in batches], padding_side),
            Side.cat([batch.source for batch in batches], padding_side),
            **{name: joined(name) for name in ROWWISE},
        )

    def same_inputs(self, other: PairBatch) -> bool:
        """Whether `other` has the same pairs but for their labels (a control task's batch)."""
        return (
            self.base.same_inputs(other.base)
            and self.source.same_inputs(other.source)
            and _equal(self.kind, other.kind)
            and _equal(self.attribute, other.attribute)
        )


def _equal(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    if x is None or y is None:
        return x is y
    return x.shape == y.shape and torch.equal(x, y)


def collate_pairs(examples: Sequence, region: str, pad_id: int, padding_side: str = "right") -> PairBatch:
    """One `PairBatch` of `examples` (see the module doc), the site at `region`'s last token:
    base and source padded apart on `padding_side`, positions shifted by the padding."""
    sides = []
    for name in SIDES:
        seqs = [getattr(e, f"{name}_ids") for e in examples]
        ids, mask, shift = pad_batch(seqs, pad_id, padding_side)
        positions = [getattr(e, f"{name}_positions") for e in examples]
        shared = set.intersection(*(set(p) for p in positions))
        labels = [getattr(e, f"{name}_label", None) for e in examples]
        types = [getattr(e, f"{name}_type", None) for e in examples]
        entities = [getattr(e, f"{name}_entity", None) for e in examples]
        sides.append(
            Side(
                ids,
                mask,
                torch.tensor([p[region] for p in positions]) + shift,
                torch.tensor([len(s) - 1 for s in seqs]) + shift,
                None if None in labels else torch.tensor(labels),
                {r: torch.tensor([p[r] for p in positions]) + shift for r in sorted(shared)},
                None if None in types else types,
                None if None in entities else torch.tensor(entities),
            )
        )
    base, source = sides
    kind = torch.tensor([e.kind for e in examples])
    targets = [getattr(e, "target", None) for e in examples]
    if None in targets:
        if base.label is None or source.label is None:
            raise ValueError("examples without a `target` need both a base_label and a source_label")
        target = torch.where(kind == ISO, base.label, source.label)
    else:
        target = torch.tensor(targets)
    attributes = [getattr(e, "attribute", 0) for e in examples]
    return PairBatch(base, source, target, kind, torch.tensor(attributes), _answers(examples), _group(examples))


def _answers(examples: Sequence) -> torch.Tensor | None:
    """(batch, 2, n): each example's `answers` (target tokens, base tokens), −100 past a shorter
    one; None unless every example has them."""
    answers = [getattr(e, "answers", None) for e in examples]
    if any(a is None for a in answers):
        return None
    width = max(len(tokens) for pair in answers for tokens in pair)
    return torch.tensor([[list(tokens) + [-100] * (width - len(tokens)) for tokens in pair] for pair in answers])


def _group(examples: Sequence) -> torch.Tensor | None:
    groups = [getattr(e, "group", None) for e in examples]
    return None if None in groups else torch.tensor(groups)
