"""The CALM study's task data on RAVEL (Davies et al., adapted): the prompts of each property,
the entity splits, each property's kept classes, the task's answer vocabulary (App. B.2), and the
states at the site, read once. The study itself: `lit_interventions/studies/calm.py`."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from lit_interventions.core.progress import current
from lit_interventions.core.sites import read_layers
from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.core.tokens import pad_batch, token_covering
from lit_interventions.datamodules.ravel import RavelData, _first_token, value_separator

SPLITS = ("train", "val", "test")
POSITION = "entity_last"  # the site's position: the entity's last token


@dataclass
class Prompt:
    """One tokenised prompt: an entity in a template of a queried attribute."""

    entity: str
    attribute: str  # the attribute the template queries
    template: str
    ids: list[int]
    site: int  # the entity's last token
    last: int  # the prediction position


# --- data ---------------------------------------------------------------------------------------
def _check_names(names: list[str] | None, valid: list[str], what: str) -> list[str]:
    """The names (default: every valid one), all of them among `valid` and at least one."""
    names = list(valid) if names is None else list(names)
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"{what} {unknown or names} not in the data; available: {', '.join(valid)}")
    return names


def property_classes(data: RavelData, properties: list[str], max_classes: int) -> dict[str, list[str]]:
    """Each property's `max_classes` most frequent values among train entities (ties: by name)."""
    classes = {}
    for prop in properties:
        counts = Counter(v for e, v in data.values(prop).items() if data.entity_split.get(e) == "train")
        kept = [v for v, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:max_classes]]
        if len(kept) < 2:
            raise ValueError(f"property {prop!r} has {len(kept)} value(s) among train entities; a probe needs >= 2")
        classes[prop] = kept
    return classes


def split_entities(data: RavelData, properties: list[str], sizes: dict[str, int], seed: int) -> dict[str, list[str]]:
    """Entities per split that have a value of every property, at most sizes[split] of each (seeded)."""
    rng = random.Random(seed)
    kept = {s: [] for s in SPLITS}
    for entity, attrs in sorted(data.entities.items()):
        split = data.entity_split.get(entity)
        if split in kept and all(attrs.get(p) for p in properties):
            kept[split].append(entity)
    for split in SPLITS:
        rng.shuffle(kept[split])
        kept[split] = sorted(kept[split][: sizes[split]])
        if not kept[split]:
            raise ValueError(f"no {split} entity has a value of every property {properties}")
    return kept


def choose_templates(data: RavelData, properties: list[str], per_property: int, seed: int) -> dict[str, list[str]]:
    """At most `per_property` prompt templates of each property, sampled (seeded) and sorted."""
    rng = random.Random(seed)
    chosen = {}
    for prop in properties:
        templates = sorted(data.prompts.get(prop, []))
        if not templates:
            raise ValueError(f"property {prop!r} has no prompt templates")
        chosen[prop] = sorted(rng.sample(templates, min(per_property, len(templates))))
    return chosen


def tokenize_prompt(tokenizer, template: str, entity: str, attribute: str) -> Prompt:
    """The prompt with BOS, the entity's last token (offsets) and the last position."""
    prefix = bos_prefix(tokenizer)
    text = prefix + template.replace("%s", entity)
    enc = tokenizer(text, return_offsets_mapping=True)
    site = token_covering(enc["offset_mapping"], len(prefix) + template.index("%s") + len(entity) - 1, text)
    return Prompt(entity, attribute, template, enc["input_ids"], site, len(enc["input_ids"]) - 1)


def tokenize_splits(
    tokenizer, split_of: dict[str, list[str]], properties: list[str], templates: dict[str, list[str]], max_tokens: int
) -> dict[str, list[Prompt]]:
    """Every split's prompts: each entity in each template of each property, those longer than
    `max_tokens` dropped; a split left without one is an error."""
    prompts: dict[str, list[Prompt]] = {}
    for split in SPLITS:
        prompts[split] = [
            p
            for entity in split_of[split]
            for attr in properties
            for t in templates[attr]
            if len((p := tokenize_prompt(tokenizer, t, entity, attr)).ids) <= max_tokens
        ]
        if not prompts[split]:
            raise ValueError(f"every {split} prompt is longer than max_tokens={max_tokens}")
    return prompts


def _pad(prompts: list[Prompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids right-padded with `pad_id`, and their attention mask: (batch, seq) each."""
    ids, mask, _ = pad_batch([p.ids for p in prompts], pad_id)
    return ids, mask


def _batches(items: list, size: int):
    """Consecutive slices of `items`, `size` long (the last one shorter)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def read_states(model, layer: int, prompts: list[Prompt], pad_id: int, batch_size: int, device) -> list[torch.Tensor]:
    """The residual stream at `layer` of each prompt, unpadded, [(seq, d)] on the CPU; each batch
    counted in the study's progress (`core.progress.current`)."""
    out = []
    for batch in _batches(prompts, batch_size):
        ids, mask = _pad(batch, pad_id)
        states = read_layers(model, [layer], ids.to(device), mask.to(device))[layer].float().cpu()
        out.extend(states[i, : len(p.ids)] for i, p in enumerate(batch))
        current().update()
    return out


def site_states(
    model, layer: int, prompts: dict[str, list[Prompt]], pad_id: int, batch_size: int, device
) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Each split's states at `layer` ([(seq, d)] per prompt, `read_states`) and their rows at the
    site, stacked: ({split: states}, {split: (n, d)})."""
    states = {s: read_states(model, layer, prompts[s], pad_id, batch_size, device) for s in SPLITS}
    site = {s: torch.stack([st[p.site] for st, p in zip(states[s], prompts[s])]) for s in SPLITS}  # (n, d)
    return states, site


def _labels(data: RavelData, prompts: list[Prompt], prop: str, classes: list[str]) -> torch.Tensor:
    """Class id of each prompt's entity for `prop`, −1 where its value is not a kept class, (n,)."""
    values = [data.entities[p.entity][prop] for p in prompts]
    return torch.tensor([classes.index(v) if v in classes else -1 for v in values])


def _other_class(label: int, n_classes: int, rng: random.Random) -> int:
    """A target value z′ ≠ z, uniformly among the other kept values."""
    return rng.choice([c for c in range(n_classes) if c != label])


def answer_vocabulary(tokenizer, data: RavelData, task: str, templates: list[str]) -> torch.Tensor:
    """The task's answer vocabulary (CALM App. B.2: predictions are ranked within it): the first
    token of every value of the queried attribute in the data, as it follows each of the task's
    templates (with the space `value_separator` puts before it), sorted token ids."""
    seps = {value_separator(t) for t in templates}
    ids = {_first_token(tokenizer, sep + value) for value in set(data.values(task).values()) for sep in seps}
    return torch.tensor(sorted(ids), dtype=torch.long)


def _first_tokens(tokenizer, value: str) -> set[int]:
    """The first token of the value, with and without a leading space (either counts as the answer)."""
    return {ids[0] for ids in (tokenizer(w, add_special_tokens=False).input_ids for w in (value, " " + value)) if ids}
