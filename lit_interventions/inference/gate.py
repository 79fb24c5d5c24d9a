"""Conditional steering: a concept dictionary's edit applied at a token only where the concept's
own latent fires.

    h' = h + α·w_c·1[z_c(h) > τ_c]

z_c(h) is the dictionary's detection latent of concept c at that token (h·w_c, or ReLU(h·w_c):
the card's `latent`), read from the state the edit receives, at the dictionary's site, before
the edit (`interventions.additive.gate_open`); where the gate is shut the state is left as it is,
bit for bit. This is CAST's condition (Lee et al. 2024, arXiv 2409.05907) and AxBench's
conditional ReFT demo, with the detector being the steering matrix itself.

A gate (`apply(..., gate=...)`, `generate --gate`, `serve --gate` and a request's `gate` field,
`steer --gate`) is one of

- None / False: no gate (the edit at every token, as without the option);
- a number τ: the same threshold for every concept; finite, and >= 0 for a ReLU latent (ReLU(h·w)
  >= 0, so a negative τ would never shut the gate);
- True: each concept's τ_c chosen on the eval split the dictionary was validated on
  (`eval_thresholds`): every token that detection max-pools for the AUROC (every token after the
  chat prefix, the end-of-turn token left out) of the concept's positives and negatives (hard
  negatives left out, as the AUROC leaves them), its latent labelled by its row, and τ_c the value
  maximising Youden's J = TPR − FPR (`youden_threshold`);
- a mapping {concept name or index: τ} (the Python API; `eval_thresholds` returns one).

Only an artifact with a concept latent is gated: a released `Dictionary` or a `ConceptDictionary`
intervention; any other (LoReFT, LoRA, an interchange) is refused. `True` needs the eval split: the
card's `training_data` must be "builtin" (the built-in concepts) or a concept directory present here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.edits import ApplyRequest, Edit, concept_rows, site_of
from lit_interventions.core.forward import read_layers
from lit_interventions.core.sharding import input_device
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import load_concepts
from lit_interventions.datamodules.axbench_format import collate
from lit_interventions.interventions.additive import (
    ConceptDictionary,
    concept_latents,
    gate_open,
    gated,
    youden_threshold,
)
from lit_interventions.metrics.detection import detection_mask

BUILTIN = "builtin"  # the card's training_data of a dictionary trained on the built-in concepts


@dataclass(frozen=True)
class ConceptLatent:
    """What the gate reads of an artifact: its rows `vectors` (C, d), how a latent is read
    (`latent`), the concept names (None: indices only), its layer, model and training data."""

    vectors: torch.Tensor
    latent: str
    names: list[str] | None
    layer: int
    model: str | None
    training_data: str | None


def concept_latent(obj: Any, config: dict, where: str) -> ConceptLatent | None:
    """The concept latent of a loaded artifact (a `Dictionary` or a `ConceptDictionary`), None
    for any other."""
    if isinstance(obj, Dictionary):
        return ConceptLatent(obj.vectors, obj.latent, obj.concepts, obj.layer, obj.model, obj.training_data)
    if isinstance(obj, ConceptDictionary):
        layer = site_of(config, where)[0]
        names = config.get("concepts")
        return ConceptLatent(
            obj.weight.detach().float().cpu(),
            obj.latent,
            list(names) if names else None,
            layer,
            config.get("model"),
            config.get("training_data"),
        )
    return None


def parse_gate(value: Any, option: str = "gate") -> bool | float | Mapping | None:
    """A gate as given (see the module doc): None, True, a finite number or a mapping; the strings
    "true", "false", "none" and numbers are read as such. One ValueError line otherwise."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false", "none", "null", ""):
            return True if word == "true" else None
        try:
            value = float(word)
        except ValueError:
            raise ValueError(
                f"{option}={value!r}; give true (τ per concept from the eval split) or a threshold"
            ) from None
    if value is None or value is False:
        return None
    if value is True or isinstance(value, Mapping):
        return value
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{option}={value!r} is not a finite number; give true or a finite threshold")
        return float(value)
    raise ValueError(f"{option}={value!r}; give true (τ per concept from the eval split), a number or false")


def eval_data_dir(latent: ConceptLatent, where: str) -> str | None:
    """The concept directory of the eval split a dictionary was validated on (None: the built-in
    set), from its card's `training_data`; one ValueError line when there is none here."""
    data = latent.training_data
    if data == BUILTIN:
        return None
    if isinstance(data, str) and data and Path(data).is_dir():
        return data
    raise ValueError(
        f"{where} records training data {data!r}, not the built-in concepts nor a concept directory here: "
        "τ per concept from the eval split cannot be chosen; give the gate a number"
    )


def check_gate(gate: Any, artifacts: Sequence[Any], option: str = "gate") -> bool | float | Mapping | None:
    """The parsed gate (`parse_gate`), checked against `artifacts` (each with `obj`, `config`,
    `where`) before any LM loads: each must have a concept latent; a number must be >= 0 for a
    ReLU latent; True needs each one's eval split (its concepts among that split's). One ValueError
    line naming the value and what is allowed."""
    gate = parse_gate(gate, option)
    if gate is None:
        return None
    for artifact in artifacts:
        latent = concept_latent(artifact.obj, artifact.config, artifact.where)
        if latent is None:
            raise ValueError(
                f"{option}: {artifact.where} holds a {type(artifact.obj).__name__}, which has no concept latent to "
                "gate on; the gate takes a concept dictionary (DiffMean, ReFT-r1, SSV, ...)"
            )
        if isinstance(gate, float) and latent.latent == "relu" and gate < 0:
            raise ValueError(
                f"{option}={gate:g} is out of range for {artifact.where}: its latent is ReLU(h·w) >= 0, so the gate "
                "would never shut; give a threshold >= 0"
            )
        if gate is True:
            eval_concept_ids(latent, artifact.where)
    return gate


def eval_concept_ids(latent: ConceptLatent, where: str) -> list[int]:
    """The ids, in the eval split's concept set, of the dictionary's concepts (in its order)."""
    directory = eval_data_dir(latent, where)
    known = load_concepts(directory).concepts
    names = latent.names or []
    if missing := [n for n in names if n not in known] or ([] if names else ["(no concept names)"]):
        raise ValueError(
            f"{where}: concept {missing[0]!r} is not in its eval split ({directory or BUILTIN}); give the gate a number"
        )
    return [known.index(n) for n in names]


@torch.no_grad()
def eval_thresholds(
    latent: ConceptLatent, lm: nn.Module, where: str = "the dictionary", batch_size: int = 16, max_length: int = 256
) -> dict[str, float]:
    """{concept: τ_c} chosen on the eval split (see the module doc): the eval rows of each of the
    dictionary's concepts run through `lm` (as it runs now: unsteered unless an enclosing `apply`
    edits it), the latents z_c of the detection tokens of its positives against those of its
    negatives, τ_c = `youden_threshold`. The data is tokenized with the tokenizer of the model the
    dictionary records."""
    ids = eval_concept_ids(latent, where)
    data = AxBenchDataModule(
        lm=latent.model, concept_dir=eval_data_dir(latent, where), concepts=ids, max_length=max_length
    )
    data.setup()
    examples = data.splits["eval"]
    pad = data.tokenizer.pad_token_id
    tokens: dict[int, dict[int, list[torch.Tensor]]] = {c: {0: [], 1: []} for c in range(len(ids))}
    device = input_device(lm)
    vectors = latent.vectors.float()
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad_id=pad if pad is not None else 0)
        hidden = read_layers(lm, [latent.layer], batch["input_ids"].to(device), batch["attention_mask"].to(device))[
            latent.layer
        ]
        z = concept_latents(hidden.cpu(), vectors[batch["concept_id"]][:, None, :], latent.latent)  # (batch, seq)
        keep = detection_mask(batch)  # its default window: `detect_on: content`
        for row, (concept, label) in enumerate(zip(batch["concept_id"].tolist(), batch["label"].tolist())):
            if label in (0, 1):
                tokens[concept][label].append(z[row][keep[row]])
    return {
        latent.names[c]: youden_threshold(
            torch.cat(tokens[c][1] or [torch.zeros(0)]), torch.cat(tokens[c][0] or [torch.zeros(0)])
        )
        for c in range(len(ids))
    }


class ThresholdCache:
    """τ per concept from the eval split, computed once per (artifact, LM) and kept while the LM lives."""

    def __init__(self):
        self._held: tuple[weakref.ref, dict[str, float]] | None = None

    def get(self, latent: ConceptLatent, lm: nn.Module, where: str) -> dict[str, float]:
        if self._held is None or self._held[0]() is not lm:
            self._held = (weakref.ref(lm), eval_thresholds(latent, lm, where))
        return self._held[1]


def _threshold_of(spec, concept: int, names: list[str] | None, cache, where: str) -> float | None:
    """τ of one row's gate spec for its concept row; None: the row is not gated."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        name = names[concept] if names else None
        for key in (name, concept, str(concept)):
            if key is not None and key in spec:
                return float(spec[key])
        raise ValueError(f"gate: no threshold for concept {name or concept!r} of {where}")
    if spec is True:
        return cache[names[concept]]
    return float(spec)


def gate_edits(
    artifact: Any, edits: list[Edit], request: ApplyRequest, gate: Any, cache: ThresholdCache | None = None
) -> list[Edit]:
    """`edits` of `artifact` (`obj`, `config`, `where`) gated per token on its concept latent:
    each row's edit kept where z_c(h) > τ (its concept's; `gate` one spec, or one per batch row,
    see the module doc), the state itself elsewhere. `cache` keeps the eval split's τ_c."""
    specs = list(gate) if isinstance(gate, (list, tuple)) else [gate]
    specs = [parse_gate(spec) for spec in specs]
    if all(spec is None for spec in specs):
        return edits
    checked = []  # (kind, value): True is not the threshold 1.0
    for spec in specs:
        if spec is not None and (type(spec), spec) not in checked:
            check_gate(spec, [artifact])
            checked.append((type(spec), spec))
    latent = concept_latent(artifact.obj, artifact.config, artifact.where)
    count = latent.vectors.shape[0]
    chosen = concept_rows(request, latent.names, count, artifact.where)
    per_concept = (
        (cache or ThresholdCache()).get(latent, request.lm, artifact.where)
        if any(spec is True for spec in specs)
        else {}
    )
    many = len(specs) > 1

    def thresholds(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each row's concept, whether it is gated, its τ), (n,) each."""
        concept = request.per_row(chosen, rows.cpu(), torch.long)
        taus = [
            _threshold_of(specs[r if many else 0], c, latent.names, per_concept, artifact.where)
            for r, c in zip(rows.tolist(), concept.tolist())
        ]
        on = torch.tensor([t is not None for t in taus])
        return concept, on, torch.tensor([0.0 if t is None else t for t in taus])

    def wrap(edit: Edit) -> Edit:
        def fn(states: torch.Tensor, rows: torch.Tensor, inputs=None) -> torch.Tensor:
            edited = edit.fn(states, rows, inputs)
            concept, on, tau = thresholds(rows)
            open_ = gate_open(states, latent.vectors[concept], latent.latent, tau)
            return gated(states, edited, open_ | ~on.to(open_.device))

        return replace(edit, fn=fn)

    return [wrap(edit) for edit in edits]
