"""Interventions and concept dictionaries as Hugging Face model repositories.

A saved artifact is one directory, the same on disk and on the hub:

    intervention.safetensors | dictionary.safetensors   the tensors (never the LM)
    config.json                                         what it is: class path, config, model, site,
                                                        data, metrics, the command that made it
    README.md                                           a model card generated from config.json

    d = Dictionary.from_pretrained("checkpoints/axbench/builtin-diffmean")   # a directory ...
    d = Dictionary.from_pretrained("someone/smollm2-diffmean-l15")           # ... or a hub id
    das = pretrained_intervention(RotatedSpaceIntervention, "runs/das/.../version_0")  # artifacts.intervention_files
    x = from_pretrained("someone/repo")              # whichever config.json says (lit_interventions.from_pretrained)
    d.push_to_hub("someone/smollm2-diffmean-l15")    # save_pretrained to a temporary dir + upload

Downloads go through `huggingface_hub.snapshot_download`, uploads through `HfApi.upload_folder`
and the card through `huggingface_hub.ModelCard`; nothing here speaks HTTP. Older directories
holding `intervention.json` / `dictionary.json` (and no config.json) still load.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from lit_interventions.artifacts.card import LIBRARY, model_card
from lit_interventions.artifacts.shareable import shareable, shareable_yaml
from lit_interventions.core.files import finite_values, write_atomically
from lit_interventions.core.model_cache import hub_offline_reason
from lit_interventions.interventions.base import class_path

CONFIG, README = "config.json", "README.md"
INTERVENTION_FORMAT = "lit-interventions/intervention/v1"
# the embedded models' upstream repositories (the embedded copies are GGUF quantisations of these)
BASE_MODELS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma-3-270m": "google/gemma-3-270m",
}
# keys config.json adds to a card (removed again when a Dictionary is read back from it)
HUB_KEYS = ("library_name", "kind", "weights", "class_path", "base_model", "site", "metrics")


# --- what goes into config.json ------------------------------------------------------------------


def base_model(lm: str | None) -> str | None:
    """The hub id of the LM `lm` names, when known: an embedded name's upstream repository, a hub
    id itself, or the `_name_or_path` of a local model directory when that is a hub id."""
    if not isinstance(lm, str) or not lm:
        return None
    if lm in BASE_MODELS:
        return BASE_MODELS[lm]
    if lm.endswith(".gguf"):
        return None
    path = Path(lm).expanduser()
    if path.is_dir():
        try:
            name = json.loads((path / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            return None
        return name if isinstance(name, str) and _looks_like_hub_id(name) and not Path(name).exists() else None
    return lm if _looks_like_hub_id(lm) else None


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and " " not in name


def run_command(argv: list[str] | None = None) -> str:
    """The command line of this process (`python train.py fit ...`, `lit-interventions fit ...`)."""
    argv = list(sys.argv if argv is None else argv)
    program = Path(argv[0]).name if argv else "python"
    head = ["python", argv[0]] if program.endswith(".py") else [program]
    return shlex.join([*head, *argv[1:]])


def export_dir(trainer, log_dir: str | Path | None) -> Path:
    """Where a fit's artifact goes: `trainer.log_dir` (the version directory) for TensorBoard and
    CSV; for other loggers, whose log_dir is their shared save_dir (W&B: "." by default), the run's
    own `save_dir/<name>/<version>`, the directory Lightning's checkpoints go under. `log_dir`:
    `trainer.log_dir`, asked on every rank before (a collective under DDP)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = getattr(trainer, "logger", None)
    directory = log_dir or trainer.default_root_dir
    if logger is None or isinstance(logger, (TensorBoardLogger, CSVLogger)):
        return Path(directory)
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version


def trainer_command(trainer, log_dir: str | Path | None = None) -> str:
    """The command that ran this fit: the process's command line when it is `train.py` or
    `lit-interventions`; otherwise (a fit started from Python) the equivalent command line
    reading the resolved config LightningCLI saved in `log_dir` (`trainer.log_dir`, asked on
    every rank before: a collective under DDP)."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program in ("train.py", "lit-interventions", "lit-interventions.exe"):
        return run_command()
    stage = getattr(getattr(trainer, "state", None), "fn", None)
    stage = getattr(stage, "value", stage) or "fit"
    log_dir = log_dir or getattr(trainer, "default_root_dir", None) or "."
    return shlex.join(["lit-interventions", str(stage), "--config", str(Path(log_dir) / "config.yaml")])


def artifact_config(
    kind: str,
    cls,
    card: dict,
    weights: str,
    *,
    file_format: str | None = None,
    config: dict | None = None,
    site: dict | str | None = None,
) -> dict:
    """config.json of an artifact of `kind` (a key of `artifacts.pretrained.LOADERS`): what it is
    (`cls`'s class path; an intervention's `file_format` and `config`), plus the card's method,
    model, site (the card's, else `site`, else its layer / component / region), data, metrics and
    command (any further card field is kept)."""
    card = dict(card)
    site = card.pop("site", None) or site
    site = site or {k: card[k] for k in ("layer", "component", "region") if card.get(k) is not None}
    return {
        "library_name": LIBRARY,
        "kind": kind,
        **({"format": file_format} if file_format is not None else {}),
        "weights": weights,
        "class_path": class_path(cls),
        **({"config": config} if config is not None else {}),
        "method": card.pop("method", None) or getattr(cls, "__name__", type(cls).__name__),
        "model": card.get("model"),
        "base_model": base_model(card.get("model")),
        "site": site,
        **{k: v for k, v in card.items() if k not in ("class_path", "config")},
        "metrics": finite_values(card.get("metrics")),
        "command": card.get("command"),
    }


def intervention_config(intervention, card: dict, weights: str = "intervention.safetensors") -> dict:
    """config.json of an intervention: its class path and config, plus the card's model, site,
    data, metrics and command (any further card field is kept)."""
    config = artifact_config(
        "intervention", intervention, card, weights, file_format=INTERVENTION_FORMAT, config=intervention.config()
    )
    config["needs_source"] = not getattr(intervention, "edits_base_alone", False)  # an interchange (`apply`)
    return config


def dictionary_config(dictionary, weights: str = "dictionary.safetensors") -> dict:
    """config.json of a concept dictionary: its card (`Dictionary.save` writes the same fields to
    dictionary.json) plus the class path, base model, site, metrics and command."""
    card = dictionary.card_dict()
    auroc = dictionary.auroc or {}
    metrics = {"val/auroc": auroc.get("mean")}
    metrics.update({f"val/auroc/{name}": value for name, value in (auroc.get("per_concept") or {}).items()})
    return {
        "library_name": LIBRARY,
        "kind": "dictionary",
        "weights": weights,
        "class_path": "lit_interventions.artifacts.dictionary.Dictionary",
        "base_model": base_model(dictionary.model),
        "site": {"layer": dictionary.layer, "component": "block_output"},
        **card,
        "metrics": finite_values(metrics),
        "command": card.get("command") or card.get("training"),
    }


# --- files ---------------------------------------------------------------------------------------


def _ours(directory: Path) -> bool:
    try:
        return json.loads((directory / CONFIG).read_text()).get("library_name") == LIBRARY
    except (OSError, ValueError, AttributeError):
        return False


def write_hub_files(directory: str | Path, config: dict) -> Path:
    """config.json and the README.md card into `directory`, each written atomically. A config.json
    or README.md already there that lit-interventions did not write (a project's README, a model's
    config) is never replaced: FileExistsError."""
    directory = Path(directory)
    if not _ours(directory) and any((directory / name).exists() for name in (CONFIG, README)):
        found = [name for name in (CONFIG, README) if (directory / name).exists()]
        raise FileExistsError(
            f"{directory} already holds {' and '.join(found)} not written by lit-interventions; "
            "refusing to replace them (save into a directory of its own)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    config = shareable(config)  # no absolute local path leaves the machine
    text = json.dumps(config, indent=2) + "\n"  # fails before anything is written if not JSON-able
    card = str(model_card(config))
    write_atomically(directory / CONFIG, text)
    write_atomically(directory / README, card)
    return directory / CONFIG


def write_run_card(directory: str | Path, config: dict, card_name: str, card: dict) -> Path:
    """A run's one card: config.json and the README.md model card (`write_hub_files`). Where a
    config.json or README.md that lit-interventions did not write is already in `directory` (a
    log directory inside someone's model repository), they are kept and the card goes to
    `card_name` instead (the layout without config.json, which every loader reads), with a
    warning. Returns the card's path."""
    directory = Path(directory)
    try:
        return write_hub_files(directory, config)
    except FileExistsError as err:
        warnings.warn(f"the run's card is {card_name}, not {CONFIG}: {err}", stacklevel=2)
        write_atomically(directory / card_name, json.dumps(shareable(card), indent=2) + "\n")
        return directory / card_name


def read_config(directory: str | Path) -> dict:
    """config.json of a saved artifact; a directory without one is a FileNotFoundError."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {Path(directory)} is not a saved lit-interventions artifact")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON ({type(err).__name__}: {err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def local_directory(
    directory_or_hub_id: str | Path,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> Path:
    """An existing local directory as it is; otherwise a hub id, downloaded (or taken from the
    cache) with `huggingface_hub.snapshot_download`. When the hub cannot be used (offline mode, no
    network: `hub_offline_reason`) only the cache is read, so nothing waits on download retries."""
    path = Path(directory_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(directory_or_hub_id)
    if not _looks_like_hub_id(name):
        raise FileNotFoundError(f"{name!r} is neither a directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    offline = None if local_files_only else hub_offline_reason()
    try:
        return Path(
            snapshot_download(
                name,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                local_files_only=local_files_only or offline is not None,
                library_name=LIBRARY,
            )
        )
    except Exception as err:  # RepositoryNotFoundError, offline, no cached copy, ...
        if offline is not None:
            raise FileNotFoundError(
                f"{name!r} is not a local directory, and as a hub id it is not in the Hugging Face cache "
                f"({type(err).__name__}) while {offline}; download it where the hub can be reached (`hf download {name}`) or pass its directory"
            ) from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise FileNotFoundError(
            f"{name!r} is not a local directory, and as a hub id it could not be downloaded "
            f"({type(err).__name__}: {first})"
        ) from err


def upload_files(config: dict | None) -> list[str]:
    """The files of an artifact directory that go to the hub (not a run's logs or checkpoints)."""
    weights = (config or {}).get("weights")
    names = [CONFIG, README, "*.safetensors"] if not weights else [CONFIG, README, weights]
    return [*names, "intervention.json", "dictionary.json", "config.yaml"]


def push_to_hub(
    directory: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool | None = None,
):
    """Upload a saved artifact directory (a `save_pretrained` directory or a run's log directory:
    only the weights, config.json, README.md, the old JSON card and config.yaml, its absolute
    paths replaced by their names, go) to the model repository `repo_id`, created if missing. Returns huggingface_hub's CommitInfo."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    config = read_config(directory)
    api = HfApi(token=token, library_name=LIBRARY)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory(prefix="lit-interventions-upload-") as staged:
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=_staged(directory, Path(staged), upload_files(config)),
            repo_type="model",
            revision=revision,
            commit_message=commit_message
            or f"Upload {config.get('method') or 'artifact'} ({config.get('kind', 'intervention')}) with lit-interventions",
            allow_patterns=upload_files(config),
            create_pr=create_pr,
        )


def _staged(directory: Path, staged: Path, patterns: list[str]) -> Path:
    """The files of `directory` that match `patterns`, as they are uploaded, in `staged`:
    config.yaml with its absolute paths replaced by their names (`shareable_yaml`), every other
    file linked (or copied) as it is."""
    for path in directory.iterdir():
        if not path.is_file() or not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
            continue
        if path.name == "config.yaml":
            (staged / path.name).write_text(shareable_yaml(path.read_text(encoding="utf-8")), encoding="utf-8")
            continue
        try:
            os.link(path, staged / path.name)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(path, staged / path.name)
    return staged


def push_object(obj, repo_id: str, **kwargs: Any):
    """`obj.save_pretrained(tmp)` then `push_to_hub(tmp, repo_id, **kwargs)`."""
    with tempfile.TemporaryDirectory(prefix="lit-interventions-push-") as tmp:
        obj.save_pretrained(tmp)
        return push_to_hub(tmp, repo_id, **kwargs)
