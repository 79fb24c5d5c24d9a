"""The files of a concept dictionary (`Dictionary`): their paths, reading and checking them (one
error naming the file), and writing the weights atomically.

    NAME.safetensors   vectors (concepts × d, float32), max_activations (concepts,)
    NAME.json          the card; in a save_pretrained directory, config.json holds it
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lit_interventions.artifacts.intervention_files import weights_path
from lit_interventions.core.files import write_atomically

FORMAT = "lit-interventions/concept-dictionary/v1"
WEIGHTS_NAME = "dictionary.safetensors"  # the weights file of a save_pretrained directory
REDO = "re-export it (rerun the fit that wrote it) or restore a good copy"


def dictionary_paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.is_dir():  # a save_pretrained (or run) directory: dictionary.safetensors + its card
        path = path / WEIGHTS_NAME
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def card_path_of(weights: Path, card_path: Path) -> tuple[Path, bool]:
    """NAME.json, or the directory's config.json (the hub layout) when there is no NAME.json.
    The flag says whether it is config.json."""
    hub = weights.parent / "config.json"
    if not card_path.is_file() and hub.is_file() and card_path.name != "config.json":
        return hub, True
    return card_path, False


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def check_finite_dictionary(vectors, max_activations, concepts, where: Path, doing: str) -> None:
    """Vectors must be finite; max_activations may be NaN (never validated) but not ±inf."""
    vectors = torch.as_tensor(vectors)
    bad = (~torch.isfinite(vectors.float())).reshape(len(vectors), -1).any(-1) if vectors.dim() else torch.zeros(0)
    peaks = torch.as_tensor(max_activations).float().reshape(-1)
    inf = torch.isinf(peaks)
    if bad.any() or inf.any():
        rows = bad.nonzero().flatten().tolist() or inf.nonzero().flatten().tolist()
        names = ", ".join(repr(concepts[r]) if r < len(concepts) else str(r) for r in rows[:3])
        what = "vectors" if bad.any() else "max_activations"
        raise ValueError(
            f"{where}: {doing} a dictionary whose {what} hold NaN/inf ({len(rows)} of "
            f"{len(peaks if what == 'max_activations' else vectors)} concepts, e.g. {names}); the "
            "training diverged: retrain it (NonFiniteGuard stops such runs)"
        )


def write_weights(weights: Path, vectors: torch.Tensor, max_activations: torch.Tensor, concepts: list[str]) -> None:
    """NAME.safetensors, written atomically; NaN/inf vectors are refused."""
    check_finite_dictionary(vectors, max_activations, concepts, weights, "refusing to write")
    weights.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"vectors": vectors.contiguous(), "max_activations": max_activations.contiguous()}
    write_atomically(weights, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))


def read_dictionary(path: str | Path) -> tuple[dict, Path, Path]:
    """(the `Dictionary` fields, the weights path, the card path) of the dictionary at `path`
    (its .safetensors, its .json card, their stem, or a directory); one error naming the file
    that is missing, unreadable or not a dictionary's."""
    weights, card_path = dictionary_paths(path)
    card_path, hub = card_path_of(weights, card_path)
    if Path(path).is_dir():  # an artifact's directory: its weights must lie inside it
        weights_path(Path(path), weights.name, card_path)
    for needed in (weights, card_path):
        if not needed.is_file():
            raise FileNotFoundError(
                f"no dictionary file {needed} (a dictionary is NAME.safetensors + NAME.json, "
                "or a directory of dictionary.safetensors + config.json)"
            )
    try:
        tensors = load_file(weights)
    except Exception as err:  # SafetensorError (truncated, empty, text), OSError
        raise ValueError(
            f"{weights} is not a readable safetensors file ({type(err).__name__}: {first_line(err)}); {REDO}"
        ) from err
    try:
        card = json.loads(card_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(
            f"{card_path} is not a readable JSON card ({type(err).__name__}: {first_line(err)}); {REDO}"
        ) from err
    if not isinstance(card, dict):
        raise ValueError(f"{card_path} is not a dictionary card (a JSON object); {REDO}")
    missing = sorted({"concepts", "model", "layer", "method"} - set(card))
    if missing:
        raise ValueError(f"{card_path} is not a dictionary card: it lacks {missing}; {REDO}")
    missing = {"vectors", "max_activations"} - set(tensors)
    if missing:
        raise ValueError(f"{weights} is not a concept dictionary: it lacks {sorted(missing)}")
    if tensors["vectors"].dim() != 2:
        raise ValueError(
            f"{weights}: vectors must be (concepts, hidden_size); got shape {tuple(tensors['vectors'].shape)}; {REDO}"
        )
    if card.get("hidden_size") not in (None, tensors["vectors"].shape[1]):
        raise ValueError(
            f"{card_path} says hidden_size {card['hidden_size']} but the vectors have {tensors['vectors'].shape[1]}"
        )
    check_finite_dictionary(
        tensors["vectors"], tensors["max_activations"], card["concepts"], weights, "refusing to load"
    )
    known = {
        "format",
        "model",
        "layer",
        "method",
        "latent",
        "hidden_size",
        "num_concepts",
        "concepts",
        "training_data",
        "auroc",
    }
    if hub:  # what config.json adds to the card (rebuilt by save_pretrained); a copied "training" command
        known |= {"library_name", "kind", "weights", "class_path", "base_model", "site", "metrics"}
        if card.get("command") is not None and card.get("command") == card.get("training"):
            known.add("command")
    fields = {
        "vectors": tensors["vectors"],
        "max_activations": tensors["max_activations"],
        "concepts": card["concepts"],
        "model": card["model"],
        "layer": card["layer"],
        "method": card["method"],
        "latent": card.get("latent"),
        "training_data": card.get("training_data"),
        "auroc": card.get("auroc"),
        "card": {k: v for k, v in card.items() if k not in known},
    }
    return fields, weights, card_path
