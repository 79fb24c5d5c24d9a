"""`apply`: any saved artifact on a loaded LM, as a context manager, for interchange and steering.

    from lit_interventions import apply, load_lm, load_tokenizer

    lm, tok = load_lm("gemma-3-270m"), load_tokenizer("gemma-3-270m")
    ids = tok("The author near the keys", return_tensors="pt").input_ids
    with apply(lm, "runs/das/.../version_0", tokenizer=tok, source="The authors near the keys"):
        out = lm.generate(ids, max_new_tokens=8)          # DAS: the source's state swapped in
    with apply(lm, "checkpoints/axbench/builtin-diffmean", concept=0, factor=2.0):
        out = lm.generate(ids, max_new_tokens=8)          # a dictionary concept, steering

An artifact is a run directory, a `save_pretrained` directory, a hub id (`from_pretrained`), a
steering module's Lightning `.ckpt`, a concept dictionary's file, or an object already loaded.
What it edits is its own `edits(config, request, where)` (`lit_interventions.core.edits`):
nothing here depends on its kind. Several artifacts given as a list edit the LM together, with
the same options; nested `apply` blocks compose too.

Positions (`positions`): the artifact's own rule by default ("site": every position for
steering, the prompt's last token for an interchange); or "all", "prompt", "generated", "last",
or prompt token indices. `span_position` finds a piece of text's last token. An interchange takes
`source` (a text, read at `source_positions`, by default its last token; or a state tensor).
Steering takes `concept` (a name or index) and `factor`; each may be one value or one per batch
row, and `enabled` switches rows off. `gate` makes a concept dictionary's edit conditional, at a
token only where the concept's own latent crosses a threshold, h + α·w_c·1[z_c(h) > τ_c]
(`inference.gate`: None, a number τ, True for τ_c chosen on the eval split, or one per batch row). The factor is a concept dictionary's own (h + factor·m_c·w_c)
and scales any other edit f*: h + factor·(f*(h) − h), f* itself at factor 1
(`lit_interventions.core.edits`).

An artifact is checked against the LM before any hook is placed: another hidden size, or a site
layer the LM does not have, is one ValueError naming both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.hub import CONFIG, local_directory, read_config
from lit_interventions.artifacts.intervention_files import CARD
from lit_interventions.artifacts.pretrained import artifact_kind, from_pretrained
from lit_interventions.artifacts.steering_files import names_known_steering
from lit_interventions.core.edits import ApplyRequest, Edit, install
from lit_interventions.core.positions import Positions
from lit_interventions.core.sites import Site
from lit_interventions.inference.gate import ThresholdCache, gate_edits
from lit_interventions.interventions.base import trusting_remote_code
from lit_interventions.modules.steering_registry import load_steering_checkpoint


class LoadedArtifact:
    """A loaded artifact (`obj`), its config.json (or older card) and a name for messages;
    `gate_cache` keeps the eval split's gate thresholds once computed for an LM (`inference.gate`)."""

    def __init__(self, obj: Any, config: dict, where: str):
        self.obj, self.config, self.where = obj, config, where
        self.gate_cache = ThresholdCache()

    @property
    def model(self) -> str | None:
        """The LM it was trained on, as its config (or the object) records it."""
        return self.config.get("model") or getattr(self.obj, "model", None)

    @property
    def concepts(self) -> list[str] | None:
        names = self.config.get("concepts") or getattr(self.obj, "concepts", None)
        return list(names) if names else None

    def edits(self, request: ApplyRequest) -> list[Edit]:
        method = getattr(self.obj, "edits", None)
        if not callable(method):
            raise ValueError(
                f"{self.where} holds a {type(self.obj).__name__}, which is not applied to an LM on its own "
                "(an intervention, a concept dictionary or a steering adapter is)"
            )
        return method(self.config, request, self.where)


def artifact_config(directory: Path) -> dict:
    """config.json of a saved artifact, or the intervention.json card of an older directory."""
    if (directory / CONFIG).is_file():
        return read_config(directory)
    card = directory / CARD
    if card.is_file():
        try:
            loaded = json.loads(card.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"{card} is unreadable ({type(err).__name__})") from None
        return loaded if isinstance(loaded, dict) else {}
    return {}


def _load_path(artifact: str | Path, trust_remote_code: bool, download: dict) -> tuple[Any, dict]:
    """(the object, its config) of a path: a steering module's Lightning `.ckpt`
    (`load_steering_checkpoint`; its config is the card it exports), a concept dictionary's
    NAME.safetensors / NAME.json or their stem (`Dictionary.load`), else a directory or hub id
    (`from_pretrained`; a steering run of a module of the user's own, `load_steering_checkpoint`)."""
    path = Path(artifact).expanduser()
    if path.suffix == ".ckpt":
        module = load_steering_checkpoint(path)
        return module, module.export()[1]
    if path.is_file() or path.with_name(path.name + ".safetensors").is_file():
        return Dictionary.load(path), {}
    directory = local_directory(artifact, **download)
    if artifact_kind(directory) == "steering" and not names_known_steering(directory):
        module = load_steering_checkpoint(directory)  # a steering module of the user's own: registered or trusted
        return module, module.export()[1]
    return from_pretrained(directory, trust_remote_code=trust_remote_code), artifact_config(directory)


def load_artifact(
    artifact: str | Path | LoadedArtifact | Any,
    *,
    site: Site | dict | None = None,
    trust_remote_code: bool = False,
    **download: Any,
) -> LoadedArtifact:
    """A directory or hub id, loaded with `from_pretrained` (class paths registered, or
    `trust_remote_code`), with its config; a steering module's Lightning `.ckpt` or a concept
    dictionary's file (`_load_path`); an object already loaded, with `site` (a `Site` or
    {"layer": ..., "component": ...}) when it does not carry its own."""
    if isinstance(artifact, LoadedArtifact):
        return artifact
    if isinstance(artifact, (str, Path)):
        with trusting_remote_code(trust_remote_code):
            obj, config = _load_path(artifact, trust_remote_code, download)
        return LoadedArtifact(obj, config, str(artifact))
    if isinstance(site, Site):
        site = {"layer": site.layer, "component": site.component}
    config = {"site": dict(site)} if site else {}
    return LoadedArtifact(artifact, config, f"the {type(artifact).__name__} given")


def request_for(
    lm: nn.Module,
    *,
    tokenizer=None,
    positions: str | int | Sequence[int] | Positions | None = None,
    source: str | torch.Tensor | None = None,
    source_positions: str | int | Sequence[int] | Positions | None = "last",
    concept: str | int | Sequence | None = None,
    factor: float | Sequence[float] = 1.0,
    enabled: Sequence[bool] | None = None,
) -> ApplyRequest:
    """The `ApplyRequest` of `apply`'s options, each checked."""
    if not isinstance(lm, nn.Module) or not hasattr(lm, "config"):
        raise ValueError(f"lm must be a loaded transformers model (load_lm(...)); got {type(lm).__name__}")
    factors = factor if isinstance(factor, (list, tuple)) else [factor]
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and abs(f) < float("inf") for f in factors):
        raise ValueError(f"factor={factor!r} must be a finite number (or one per batch row)")
    if source is not None and not (isinstance(source, str) or torch.is_tensor(source)):
        raise ValueError(f"source must be a text or a state tensor; got {type(source).__name__}")
    return ApplyRequest(
        lm=lm,
        tokenizer=tokenizer,
        positions=Positions.parse(positions),
        source=source,
        source_positions=Positions.parse(source_positions),
        concept=concept,
        factor=factor,
        enabled=enabled,
    )


@contextmanager
def apply(
    lm: nn.Module,
    artifacts: Any,
    *,
    tokenizer=None,
    positions: str | int | Sequence[int] | Positions | None = None,
    source: str | torch.Tensor | None = None,
    source_positions: str | int | Sequence[int] | Positions | None = "last",
    concept: str | int | Sequence | None = None,
    factor: float | Sequence[float] = 1.0,
    enabled: Sequence[bool] | None = None,
    site: Site | dict | None = None,
    trust_remote_code: bool = False,
    gate: Any = None,
) -> Iterator[nn.Module]:
    """Inside the block, `lm` runs with `artifacts` applied (one, or a list); yields `lm`. See
    the module doc for the options. Everything is checked, and source states are read (and the
    eval split's gate thresholds computed, `gate=True`), before the first hook is placed; the
    hooks are removed when the block ends."""
    request = request_for(
        lm,
        tokenizer=tokenizer,
        positions=positions,
        source=source,
        source_positions=source_positions,
        concept=concept,
        factor=factor,
        enabled=enabled,
    )
    items = list(artifacts) if isinstance(artifacts, (list, tuple)) else [artifacts]
    if not items:
        raise ValueError("artifacts is empty: give at least one artifact")
    loaded = [load_artifact(item, site=site, trust_remote_code=trust_remote_code) for item in items]
    edits = [
        edit
        for artifact in loaded
        for edit in gate_edits(artifact, artifact.edits(request), request, gate, artifact.gate_cache)
    ]
    with install(lm, edits, request):
        yield lm
