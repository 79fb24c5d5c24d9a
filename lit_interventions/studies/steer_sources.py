"""What the steering evaluation steers with and on: a released dictionary or trained LoReFT /
LoRA checkpoints as steerers, the concepts picked among theirs, and the instruction pool. The
evaluation itself: `lit_interventions/studies/steer_eval.py`."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import lit_interventions.datamodules.axbench as axbench
from lit_interventions.artifacts.dictionary import Dictionary


def load_dictionary(path: str):
    """A released dictionary (`Dictionary.load`)."""
    return Dictionary.load(path)


def load_instructions(path: str | None, lm: str) -> list[str]:
    """Steering instructions: a JSON list / text file (one per line), or the AxBench data module's."""
    if path:
        text = Path(path).read_text()
        items = json.loads(text) if path.endswith(".json") else [line.strip() for line in text.splitlines()]
        return [str(i) for i in items if str(i).strip()]
    if hasattr(axbench, "load_instructions"):
        return list(axbench.load_instructions())
    return list(axbench.AxBenchDataModule(lm=lm).instructions)


class DictionarySteerer:
    """Steering with a released dictionary: h + factor·max_act·w at every position (`Dictionary.steer`)."""

    def __init__(self, dictionary):
        self.dictionary = dictionary
        card = getattr(dictionary, "card", None) or {}
        self.method = getattr(dictionary, "method", None) or card.get("method", "dictionary")
        self.model = getattr(dictionary, "model", None) or card.get("model")
        self.concepts = list(dictionary.concepts)
        self.hidden_size = int(dictionary.vectors.shape[-1])
        self.uses_factor = True

    @contextmanager
    def steer(self, lm, concept: str, factor: float):
        """The LM steered toward `concept` at `factor` while the context is open."""
        with self.dictionary.steer(lm, concept, factor):
            yield lm


class CheckpointSteerer:
    """A trained LoReFT / LoRA module (one concept; the factor is ignored)."""

    def __init__(self, module):
        self.module = module
        self.method = module.method
        self.model = module.hparams.lm
        concept = module.hparams.concept
        self.concepts = [concept] if concept else []
        self.hidden_size = None
        self.uses_factor = False

    @contextmanager
    def steer(self, lm, concept: str, factor: float):
        """The LM with the module's intervention while the context is open (concept and factor unused)."""
        with self.module.steer(lm) as model:
            yield model


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
