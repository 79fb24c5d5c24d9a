"""`from_pretrained`: any saved artifact, from a local directory or a hub repository.

What a directory holds is read from its files, never from a class path they name: config.json's
`kind`, or for a directory written without one, the files it has. Each kind has one loader:

    kind          files                                        loads as
    intervention  intervention.safetensors + intervention.json  the intervention (DAS, DBM, LoReFT, ...)
    dictionary    dictionary.safetensors + dictionary.json      `Dictionary` (AxBench concepts)
    steering      intervention.safetensors + intervention.json  `LoRAAdapter` or `LoReFTSteering` (its
                  of a LoRA or LoReFT run                        weights and edits, without the LM)
    sae           sae.safetensors + sae.json                    `SAEFeaturizer` (encode / decode)

A steering artifact is read by `lit_interventions.artifacts.steering_files`. A directory without
config.json is an intervention when its intervention.json names a class path, and a steering
artifact when it names none and its `method` is a steering method (`STEERING_METHODS`).

The layout itself (config.json, the model card, downloads and uploads) is
`lit_interventions.artifacts.hub`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.hub import CONFIG, local_directory, read_config
from lit_interventions.artifacts.intervention_files import CARD, load_pretrained, weights_path
from lit_interventions.artifacts.steering_files import STEERING_METHODS, load_steering
from lit_interventions.interventions.featurizers import SAEFeaturizer

SAE_WEIGHTS, SAE_CARD = "sae.safetensors", "sae.json"


def _load_sae(directory: Path) -> SAEFeaturizer:
    return SAEFeaturizer.load(weights_path(directory, SAE_WEIGHTS, directory))


LOADERS: dict[str, Callable[[Path], Any]] = {
    "intervention": load_pretrained,
    "dictionary": Dictionary.load,
    "steering": load_steering,
    "sae": _load_sae,
}


def artifact_kind(directory: str | Path) -> str:
    """The kind of artifact `directory` holds (a key of `LOADERS`): config.json's `kind`, or, in
    a directory without config.json, the kind its files are; FileNotFoundError when it holds
    none, ValueError for a kind this version does not know."""
    directory = Path(directory)
    if (directory / CONFIG).is_file():
        kind = read_config(directory).get("kind")
        if kind is not None:
            if kind not in LOADERS:
                raise ValueError(f"{directory / CONFIG}: kind={kind!r} is not one of {sorted(LOADERS)}")
            return kind
    if (directory / "dictionary.safetensors").is_file() or (directory / "dictionary.json").is_file():
        return "dictionary"
    if (directory / SAE_WEIGHTS).is_file():
        return "sae"
    if (directory / CARD).is_file():
        card = _card(directory / CARD)
        steering = "class_path" not in card and card.get("method") in STEERING_METHODS
        return "steering" if steering else "intervention"
    if (directory / CONFIG).is_file():
        return "intervention"  # a config.json of ours without a kind: load_pretrained says what is wrong
    raise FileNotFoundError(
        f"{directory} holds no lit-interventions artifact (config.json, intervention.json, dictionary.json "
        f"or {SAE_WEIGHTS})"
    )


def _card(path: Path) -> dict:
    try:
        card = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}  # unreadable: the intervention loader reports it
    return card if isinstance(card, dict) else {}


def from_pretrained(directory_or_hub_id: str | Path, *, trust_remote_code: bool = False, **download: Any):
    """The artifact saved in a directory or hub repository, loaded by its kind (see the module
    doc). A class path it names must be registered (`register_intervention`); one that is not is
    refused before it is imported, unless `trust_remote_code`. `download`: revision, token,
    cache_dir, local_files_only (passed to snapshot_download)."""
    directory = local_directory(directory_or_hub_id, **download)
    kind = artifact_kind(directory)
    if kind == "intervention":
        return load_pretrained(directory, trust_remote_code=trust_remote_code)
    return LOADERS[kind](directory)
