"""RAVEL's published files: entities, attribute prompts and splits, and how a prompt is encoded.

Files of one entity type `<type>` in a directory (RAVEL, Huang et al. 2024, §3):
- `ravel_<type>_entity_attributes.json`: {entity: {attribute: value}}
- `ravel_<type>_attribute_to_prompts.json`: {attribute: [templates with %s]}
- `ravel_<type>_entity_to_split.json`: {entity: train|val|test}
- `ravel_<type>_prompt_to_split.json`: {template: train|val|test}
- `wikipedia_<type>_entity_prompts.json`: {prompt with %s: {"split": ..., "entity": ...}}

`ravel_dir=None` reads our own built-in files in `datamodules/data/ravel/` (city, physical_object).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from lit_interventions.core.files import read_utf8
from lit_interventions.core.tokens import token_covering

BUILTIN_RAVEL = Path(__file__).parent / "data" / "ravel"
SPLITS = ("train", "val", "test")
FILES = {
    "entities": "ravel_{}_entity_attributes.json",
    "prompts": "ravel_{}_attribute_to_prompts.json",
    "entity_split": "ravel_{}_entity_to_split.json",
    "prompt_split": "ravel_{}_prompt_to_split.json",
    "wikipedia": "wikipedia_{}_entity_prompts.json",
}


@dataclass
class RavelData:
    """One entity type of RAVEL, as read from its five files."""

    entity_type: str
    attributes: list[str]  # in the order of the attribute_to_prompts file
    entities: dict[str, dict[str, str]]  # entity -> attribute -> value
    prompts: dict[str, list[str]]  # attribute -> templates with %s
    entity_split: dict[str, str]  # entity -> train|val|test
    prompt_split: dict[str, str]  # template -> train|val|test
    wikipedia: list[tuple[str, str, str]]  # (prompt with %s, entity, split)

    def check_attribute(self, attribute: str) -> str:
        if attribute not in self.attributes:
            raise ValueError(
                f"Unknown attribute {attribute!r} for entity type {self.entity_type!r}; "
                f"attributes: {', '.join(self.attributes)}"
            )
        return attribute

    def values(self, attribute: str) -> dict[str, str]:
        """entity -> value of `attribute` (entities without a value are left out)."""
        self.check_attribute(attribute)
        return {e: attrs[attribute] for e, attrs in self.entities.items() if attrs.get(attribute)}


def entity_types(ravel_dir: str | Path | None = None) -> list[str]:
    """The entity types with an entity_attributes file in `ravel_dir`."""
    directory = Path(ravel_dir) if ravel_dir is not None else BUILTIN_RAVEL
    prefix, suffix = "ravel_", "_entity_attributes.json"
    return sorted(p.name[len(prefix) : -len(suffix)] for p in directory.glob(f"{prefix}*{suffix}"))


def fetch_command(directory: Path) -> str:
    """The command that downloads the published RAVEL files into `directory`."""
    return f"`lit-interventions data ravel --out {shlex.quote(str(directory))}`"


def check_ravel_dir(directory: Path) -> list[str]:
    """The entity types in `directory`; a ValueError naming the command that fetches RAVEL when
    the directory does not exist or holds no RAVEL files."""
    if not directory.is_dir():
        raise ValueError(f"RAVEL directory {directory} does not exist; fetch RAVEL with {fetch_command(directory)}")
    types = entity_types(directory)
    if not types:
        nested = sorted({p.parent for p in directory.glob(f"*/{FILES['entities'].format('*')}")})
        where = (
            f"; {nested[0]} does: pass that directory" if nested else f"; fetch RAVEL with {fetch_command(directory)}"
        )
        raise ValueError(
            f"RAVEL directory {directory} holds no RAVEL files ({FILES['entities'].format('<type>')}){where}"
        )
    return types


def load_ravel(ravel_dir: str | Path | None, entity_type: str) -> RavelData:
    """Read the five files of `entity_type` from `ravel_dir` (None: our built-in data)."""
    directory = Path(ravel_dir) if ravel_dir is not None else BUILTIN_RAVEL
    types = check_ravel_dir(directory)
    if entity_type not in types:
        raise ValueError(f"Unknown entity type {entity_type!r} in {directory}; types present: {', '.join(types)}")
    raw = {}
    for key, pattern in FILES.items():
        path = directory / pattern.format(entity_type)
        if not path.is_file():
            raise ValueError(f"RAVEL directory {directory} lacks the file {path.name} for entity type {entity_type!r}")
        raw[key] = read_json_object(path)
    for key in ("entity_split", "prompt_split"):
        bad = sorted({s for s in raw[key].values() if s not in SPLITS})
        if bad:
            raise ValueError(f"{FILES[key].format(entity_type)} has splits {bad}; allowed: {', '.join(SPLITS)}")
    prompts = {a: list(ts) for a, ts in raw["prompts"].items()}
    for attribute, templates in prompts.items():
        for t in templates:
            if t.count("%s") != 1:
                raise ValueError(f"Template {t!r} of attribute {attribute!r} must contain exactly one %s")
    wikipedia = [
        (prompt, info["entity"], info["split"])
        for prompt, info in raw["wikipedia"].items()
        if info.get("entity") in raw["entities"] and prompt.count("%s") == 1
    ]
    return RavelData(
        entity_type=entity_type,
        attributes=list(prompts),
        entities={e: {a: str(v) for a, v in attrs.items()} for e, attrs in raw["entities"].items()},
        prompts=prompts,
        entity_split=dict(raw["entity_split"]),
        prompt_split=dict(raw["prompt_split"]),
        wikipedia=wikipedia,
    )


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ValueError naming the file (and the line of a JSON error)
    when it is not UTF-8 text, not JSON or not an object."""
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{path} is empty; restore the file or fetch RAVEL again with {fetch_command(path.parent)}")
    try:
        data = json.loads(read_utf8(path))
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or type(err).__name__})") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg}); "
            "restore the file or download RAVEL again"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; RAVEL's files hold a JSON object")
    return data


_NO_SPACE_BEFORE_VALUE = tuple(" \t\n\"'([{")  # a prompt ending in one of these is followed directly by the value


def value_separator(prompt: str) -> str:
    """' ' when the value follows the prompt as a new word ("... country of" -> " France"), ''
    when the prompt ends in whitespace or an opening quote / bracket ('"country": "' -> "France")."""
    return "" if prompt.endswith(_NO_SPACE_BEFORE_VALUE) else " "


def encode_prompt(tokenizer, prefix: str, template: str, entity: str) -> tuple[list[int], int]:
    """Token ids of prefix + template % entity, and the site: the index of the token holding the
    entity's last character (prefix: the BOS text, or '' when the tokenizer adds BOS)."""
    start = len(prefix) + template.index("%s")
    text = prefix + template.replace("%s", entity, 1)
    enc = tokenizer(text, return_offsets_mapping=True)
    return enc["input_ids"], token_covering(enc["offset_mapping"], start + len(entity) - 1, text)
