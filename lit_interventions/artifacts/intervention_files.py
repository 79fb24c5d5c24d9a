"""An intervention's files, through its protocol (`export`, `config`, `from_tensors`).

    save_pretrained(directory, intervention, card)   intervention.safetensors + config.json + README.md
    load_pretrained(directory)                       the intervention again (registered classes only)
    pretrained_intervention(cls, directory_or_hub_id)  the same from a directory or a hub id, checked to be a `cls`
    push_intervention(intervention, repo_id, card)   save_pretrained to a temporary directory, then upload

A run's log directory holds `save_run_intervention`'s files: the weights and one card,
config.json. `save_intervention` / `load_intervention` write and read the layout without
config.json: ``intervention.safetensors`` plus an ``intervention.json`` card holding
``class_path`` and ``config`` (older run directories; a run whose directory holds someone
else's config.json). A class path read from a file is resolved by
`lit_interventions.interventions.base.loadable_class`: refused before it is imported unless it is
registered or the caller passes `trust_remote_code=True`; a refusal happens before any weights
are read. Weights are safetensors only (never a pickle), checked to be finite.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from lit_interventions.artifacts.hub import (
    CONFIG,
    intervention_config,
    local_directory,
    push_to_hub,
    read_config,
    write_hub_files,
    write_run_card,
)
from lit_interventions.artifacts.shareable import shareable
from lit_interventions.core.files import check_finite, read_weights, write_atomically
from lit_interventions.interventions.base import InterventionProtocol, class_path, loadable_class, trusting_remote_code

WEIGHTS, CARD = "intervention.safetensors", "intervention.json"
HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")  # huggingface_hub's cache folders: models--OWNER--NAME


def weights_path(directory: Path, name: object, where: str | Path) -> Path:
    """The weights file `name` (from a saved config) inside `directory`: a plain file name only,
    never a path that leaves the artifact's directory, and, followed through symbolic links, a
    file inside the directory. A hub snapshot's files are links into its repository's blob store
    (huggingface_hub's cache: REPO/snapshots/REVISION/FILE -> ../../blobs/HASH): a link into that
    repository's `blobs` is inside. The one check every loader of an artifact's weights makes."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or ":" in name:
        raise ValueError(f"{where}: weights={name!r} must be a file name inside {directory} (no path separators)")
    path = Path(directory) / name
    real, home = path.resolve(), Path(directory).resolve()
    if real.is_relative_to(home) or real.parent == _snapshot_blobs(home):
        return path
    raise ValueError(
        f"{path} is a link to {real}, outside {directory}; an artifact's weights are read only from inside "
        "its directory (copy the file in)"
    )


def _snapshot_blobs(directory: Path) -> Path | None:
    """The blob store of the hub cache repository whose snapshot holds `directory` (resolved):
    REPO/blobs for REPO/snapshots/REVISION[/SUBFOLDER] with REPO named models--OWNER--NAME (or
    datasets--, spaces--), else None."""
    for folder in (directory, *directory.parents):
        repo = folder.parent.parent
        if folder.parent.name == "snapshots" and repo.name.startswith(HUB_REPO_PREFIXES):
            return repo / "blobs"
    return None


def write_weights(directory: str | Path, tensors: dict[str, torch.Tensor], name: str = WEIGHTS) -> Path:
    """`name` (intervention.safetensors) in `directory`: the tensors as float32 on the CPU, written
    atomically. Refuses non-finite tensors. Returns its path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / name
    tensors = {k: v.detach().cpu().contiguous().float() for k, v in tensors.items()}
    check_finite(tensors, weights, "write")
    write_atomically(weights, lambda tmp: save_file(tensors, tmp))
    return weights


def write_tensors(directory: str | Path, tensors: dict[str, torch.Tensor], card: dict) -> Path:
    """`intervention.safetensors` plus `intervention.json` (the layout without config.json), each
    written atomically. Refuses non-finite tensors. Returns the safetensors path."""
    text = json.dumps(shareable(card), indent=2) + "\n"  # no absolute local path; not JSON-able: nothing written
    weights = write_weights(directory, tensors)
    write_atomically(Path(directory) / CARD, text)
    return weights


def read_tensors(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the card `write_tensors` wrote; refuses non-finite tensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    fix = "re-export it (fit again) or restore the file"
    weights = weights_path(directory, WEIGHTS, directory / CARD)
    try:
        tensors = load_file(weights)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{directory / WEIGHTS}: no such file (is {directory} an intervention's directory?)"
        ) from None
    except Exception as err:  # truncated, empty, not safetensors: SafetensorError and others
        raise ValueError(
            f"{directory / WEIGHTS} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); {fix}"
        ) from None
    check_finite(tensors, directory / WEIGHTS, "load")
    try:
        card = json.loads((directory / CARD).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{directory / CARD} is unreadable ({type(err).__name__}); {fix}") from None
    return tensors, card


def save_intervention(directory: str | Path, intervention: InterventionProtocol, card: dict) -> Path:
    """Write `intervention.export()` and the card, with `class_path` and `config` added, in the
    layout without config.json (intervention.json)."""
    return write_tensors(directory, intervention.export(), intervention_card(intervention, card))


def intervention_card(intervention: InterventionProtocol, card: dict) -> dict:
    """`card` with the intervention's `class_path` and `config` added: what intervention.json holds."""
    return {**card, "class_path": class_path(intervention), "config": intervention.config()}


def save_run_intervention(directory: str | Path, intervention: InterventionProtocol, card: dict) -> Path:
    """A run's artifact: `intervention.safetensors` and one card, config.json with the README.md
    model card (`hub.write_run_card`; intervention.json where a foreign config.json is in the
    way). Returns the card's path."""
    config = intervention_config(intervention, card)
    json.dumps(config)  # not JSON-able: fails before anything is written
    write_weights(directory, intervention.export())
    return write_run_card(directory, config, CARD, intervention_card(intervention, card))


def _rebuild(cls_path: object, tensors: dict[str, torch.Tensor], config: object, where: Path, trust: bool):
    """`cls.from_tensors(tensors, **config)` for the class `cls_path` names (see `loadable_class`)."""
    with trusting_remote_code(trust):
        cls = loadable_class(cls_path, where)
        if not callable(getattr(cls, "from_tensors", None)):
            raise ValueError(f"{where}: class_path={cls_path!r} is not an intervention class (no from_tensors)")
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config={config!r} must be a JSON object")
        return cls.from_tensors(tensors, **config)


def load_intervention(directory: str | Path, *, trust_remote_code: bool = False) -> tuple[InterventionProtocol, dict]:
    """(the rebuilt intervention, its card) from what `save_intervention` wrote. The card's class
    path is resolved by `loadable_class`."""
    where = Path(directory) / CARD
    card = read_card(where)
    if "class_path" not in card:
        raise ValueError(f"{where} has no class_path (an older export?); read it with read_tensors")
    loadable_class_or_trusted(card["class_path"], where, trust_remote_code)  # refused before the weights are read
    tensors, card = read_tensors(directory)
    return _rebuild(card["class_path"], tensors, card.get("config", {}), where, trust_remote_code), card


# --- the Hugging Face layout (config.json + README.md card; see lit_interventions.artifacts.hub) ---------------


def save_pretrained(directory: str | Path, intervention: InterventionProtocol, card: dict | None = None) -> Path:
    """`directory` as a hub model repository: `intervention.safetensors`, `config.json` (class path,
    config, and the card's model, layer/site, data, metrics, command) and a `README.md` model card.
    Returns the directory."""
    directory = Path(directory)
    config = intervention_config(intervention, card or {})
    json.dumps(config)  # not JSON-able: fails before anything is written
    write_weights(directory, intervention.export())
    write_hub_files(directory, config)
    return directory


def load_pretrained(directory: str | Path, *, trust_remote_code: bool = False) -> InterventionProtocol:
    """The intervention `save_pretrained` (config.json) or `save_intervention` (intervention.json,
    older directories) wrote to the local `directory`. Its class path (and those of its nested
    parts) must be registered (`register_intervention`) unless `trust_remote_code`; a refusal
    happens before any weights are read."""

    directory = Path(directory)
    config = read_config(directory) if (directory / CONFIG).is_file() else {}
    if "class_path" not in config:  # an older directory (intervention.json only), or config.json not ours
        if not (directory / CARD).is_file():
            raise FileNotFoundError(f"{directory} holds neither a lit-interventions config.json nor {CARD}")
        return load_intervention(directory, trust_remote_code=trust_remote_code)[0]
    where = directory / CONFIG
    loadable_class_or_trusted(config["class_path"], where, trust_remote_code)
    tensors = read_weights(weights_path(directory, config.get("weights", WEIGHTS), where), where)
    return _rebuild(config["class_path"], tensors, config.get("config", {}), where, trust_remote_code)


def loadable_class_or_trusted(path: object, where: Path, trust: bool) -> type:
    """`loadable_class(path, where)`, importing an unregistered class path only when `trust`."""
    with trusting_remote_code(trust):
        return loadable_class(path, where)


def read_card(where: Path) -> dict:
    """The JSON card at `where` (intervention.json)."""
    try:
        card = json.loads(where.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file (is {where.parent} an intervention's directory?)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{where} is unreadable ({type(err).__name__}); re-export it or restore the file") from None
    if not isinstance(card, dict):
        raise ValueError(f"{where} is not a JSON object")
    return card


def pretrained_intervention(
    cls: type, directory_or_hub_id: str | Path, *, trust_remote_code: bool = False, **download: Any
) -> InterventionProtocol:
    """The intervention saved in a local directory or a hub repository (`snapshot_download`;
    `download`: revision, token, cache_dir, local_files_only), which must be a `cls`: one of
    another class is refused, and an unregistered class path unless `trust_remote_code`."""
    directory = local_directory(directory_or_hub_id, **download)
    intervention = load_pretrained(directory, trust_remote_code=trust_remote_code)
    if not isinstance(intervention, cls):
        raise TypeError(
            f"{directory_or_hub_id} holds a {class_path(intervention)}, not a {class_path(cls)}; "
            "load it with lit_interventions.from_pretrained"
        )
    return intervention


def push_intervention(intervention: InterventionProtocol, repo_id: str, card: dict | None = None, **kwargs: Any):
    """`save_pretrained` to a temporary directory, then upload it to `repo_id` (`push_to_hub`;
    kwargs: private, token, commit_message, revision, create_pr)."""
    with tempfile.TemporaryDirectory(prefix="lit-interventions-push-") as tmp:
        save_pretrained(tmp, intervention, card)
        return push_to_hub(tmp, repo_id, **kwargs)
