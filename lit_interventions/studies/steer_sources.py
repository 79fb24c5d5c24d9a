"""What the steering evaluation steers with and on: the artifacts, read (their tensors, never the
LM) and checked to edit the LM alone, their methods and concepts, the concepts picked among
theirs, and the instruction pool. The evaluation itself: `lit_interventions/studies/steer_eval.py`.

An artifact is anything `lit-interventions generate --artifact` takes (`inference.apply.load_artifact`:
an intervention's or a steering module's directory, a run directory, a hub id, a concept
dictionary, a steering module's `.ckpt`). It is applied with `inference.apply.apply`. An
interchange intervention (DAS: it needs a source state, `capabilities.is_source_free` False) is
refused: the steering evaluation has no source text.
"""

from __future__ import annotations

import json
from pathlib import Path

from lit_interventions.datamodules.axbench_files import load_instructions as builtin_instructions
from lit_interventions.inference.apply import LoadedArtifact, load_artifact
from lit_interventions.interventions.capabilities import is_source_free


def load_instructions(path: str | None) -> list[str]:
    """Steering instructions: a JSON list / text file (one per line), or the AxBench data module's
    (`data/axbench/instructions.json`)."""
    if path:
        text = Path(path).read_text()
        items = json.loads(text) if path.endswith(".json") else [line.strip() for line in text.splitlines()]
        return [str(i) for i in items if str(i).strip()]
    return list(builtin_instructions())


def load_artifacts(paths: list[str], trust_remote_code: bool = False) -> list[LoadedArtifact]:
    """Each artifact read (`load_artifact`; a class path a file names is imported only with
    `trust_remote_code`), and refused in one line unless it is applied to an LM on its own and
    edits the LM alone."""
    artifacts = [load_artifact(path, trust_remote_code=trust_remote_code) for path in paths]
    for artifact in artifacts:
        kind = type(artifact.obj).__name__
        if not callable(getattr(artifact.obj, "edits", None)):
            raise ValueError(
                f"{artifact.where} holds a {kind}, which is not applied to an LM on its own; steer takes an "
                "intervention, a concept dictionary or a steering module (LoReFT, LoRA)"
            )
        if not is_source_free(artifact.obj):
            raise ValueError(
                f"{artifact.where} holds a {kind}, an interchange intervention: it needs a source text, and "
                "the steering evaluation has none; steer takes artifacts that edit the LM alone (a concept "
                "dictionary, LoReFT, LoRA, a steering intervention)"
            )
    return artifacts


def artifact_method(artifact: LoadedArtifact) -> str:
    """The method its config (or the object) records, else its class name."""
    return artifact.config.get("method") or getattr(artifact.obj, "method", None) or type(artifact.obj).__name__


def artifact_concepts(artifact: LoadedArtifact) -> tuple[list[str], bool]:
    """(the concepts it steers toward, whether `apply` is told which): a dictionary's names
    (told), or the one concept its config names (its edit is that concept's); [] when it names none."""
    if artifact.concepts:
        return artifact.concepts, True
    concept = artifact.config.get("concept")
    return ([concept] if isinstance(concept, str) and concept else []), False


def pick_concepts(value, valid: list[str]) -> list[str]:
    """The concepts named by `value` (names, ids, or None / "all" for every one), in its order."""
    if value in (None, "all", ["all"]):
        return list(valid)
    chosen = []
    for item in [value] if isinstance(value, (str, int)) else list(value):
        if isinstance(item, int) or (isinstance(item, str) and item.isdigit() and item not in valid):
            index = int(item)
            if not 0 <= index < len(valid):
                raise ValueError(
                    f"concept id {index} is out of range: there are {len(valid)} concepts (0..{len(valid) - 1})"
                )
            chosen.append(valid[index])
        elif item in valid:
            chosen.append(item)
        else:
            raise ValueError(f"Unknown concept {item!r}; valid: {', '.join(valid)} (names or ids, or 'all')")
    return chosen
