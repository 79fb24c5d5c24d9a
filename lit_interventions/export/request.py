"""What one export is asked for, shared by every writer: the artifact's directory and config.json,
the output directory, the options (`--concept`, `--factor`), and calling a capability with the
options its signature takes."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lit_interventions.core.blocks import ATTENTION_OUTPUT, BLOCK_INPUT, BLOCK_OUTPUT, MLP_OUTPUT, decoder_layers
from lit_interventions.core.files import check_finite, write_atomically
from lit_interventions.core.lm import load_config

OPTIONS = ("concept", "factor")  # the options a capability may take, by the name of its parameter

EXPORTED_COMPONENTS = (BLOCK_OUTPUT, BLOCK_INPUT, ATTENTION_OUTPUT, MLP_OUTPUT)  # sites other tools name alike


@dataclass
class ExportRequest:
    """One export: `directory` holds the artifact (its `config`: config.json, or {} for a directory
    written without one), `out` receives the files. `concept` (a name or row) and `factor` are None
    when not given; `model` is the LM the artifact was trained on."""

    directory: Path
    config: dict
    out: Path
    concept: str | int | None = None
    factor: float | None = None
    model: str | None = None
    _skeleton: Any = field(default=None, repr=False)

    def call(self, artifact: Any, capability: str) -> Any:
        """`artifact.<capability>(...)` with the options given that it takes, and `layer` (the
        site's) when it takes one. An option given that it does not take is a ValueError."""
        method = getattr(artifact, capability)
        parameters = inspect.signature(method).parameters
        kwargs = {}
        for name in OPTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            if name not in parameters:
                raise ValueError(
                    f"--{name} does not apply to {type(artifact).__name__}: its {capability}() takes no {name}"
                )
            kwargs[name] = value
        if "layer" in parameters:
            kwargs["layer"] = self.site()[0]
        return method(**kwargs)

    def site(self) -> tuple[int, str]:
        """(layer, component) of the site config.json records; one that names several sites, or
        none, is a ValueError."""
        site = self.config.get("site")
        site = site if isinstance(site, dict) else {"layer": self.config.get("layer")}
        if "sites" in site:
            raise ValueError(
                f"{self.directory} acts at {len(site['sites'])} sites at once (a composed intervention); "
                "export each part from its own directory"
            )
        layer, component = site.get("layer"), site.get("component") or BLOCK_OUTPUT
        head = site.get("head", self.config.get("head"))
        if component not in EXPORTED_COMPONENTS or head is not None:
            raise ValueError(
                f"{self.directory} acts at {component}" + (f" (head {head})" if head is not None else "")
                + f"; export writes sites at {', '.join(EXPORTED_COMPONENTS)} (apply it with lit_interventions.apply)"
            )  # fmt: skip
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(
                f"{self.directory}: config.json records no site layer (site={site!r}); save the artifact with "
                "save_pretrained, which records it"
            )
        return layer, component

    def skeleton(self) -> torch.nn.Module:
        """The artifact's LM built from its config on the meta device: its module names and sizes,
        without weights (what another tool's hook points are named after)."""
        if self._skeleton is None:
            if not self.model:
                raise ValueError(f"{self.directory} records no model (config.json `model`): its LM is unknown")
            config = load_config(self.model)
            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(config)
        return self._skeleton

    def model_type(self) -> str:
        """The LM's architecture name (`llama`, `gpt2`, ...): config.json's `model_type`, else the
        LM's config's."""
        recorded = self.config.get("model_type")
        if isinstance(recorded, str) and recorded:
            return recorded
        if not self.model:
            raise ValueError(f"{self.directory} records no model (config.json `model`): its LM is unknown")
        return str(load_config(self.model).model_type)


def block_name(model: torch.nn.Module, layer: int) -> str:
    """The name of decoder block `layer` inside `model.base_model` (`layers.3` for Llama, `h.3`
    for GPT-2): the module whose output is the residual stream after block `layer`."""
    block = decoder_layers(model)[layer]
    return next(name for name, module in model.base_model.named_modules() if module is block)


def file_stems(names: list[str]) -> dict[str, str]:
    """{name: a file name stem}: lower case, runs of other characters than letters and digits
    as one `-`, at most 80 characters; a stem two names share gets `-2`, `-3`, ... after the first."""
    stems, taken = {}, set()
    for name in names:
        stem = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")[:80].strip("-") or "concept"
        candidate, n = stem, 1
        while candidate in taken:
            n += 1
            candidate = f"{stem}-{n}"
        stems[name] = candidate
        taken.add(candidate)
    return stems


def only_layer(vectors: dict[int, torch.Tensor], name: str) -> tuple[int, torch.Tensor]:
    """The one (layer, vector) of a steering vector that acts at a single layer."""
    if len(vectors) != 1:
        raise ValueError(f"steering vector {name!r} acts at layers {sorted(vectors)}; this format takes one layer")
    return next(iter(vectors.items()))


def steering_layers(steering, request: ExportRequest, lowest: int, why: str) -> dict[str, tuple[int, torch.Tensor]]:
    """{concept: (layer, α·w)} of `steering`'s `steering_vectors()`, each finite and at a layer
    >= `lowest` (else one ValueError: the vector, its layer and `why`)."""
    vectors = request.call(steering, "steering_vectors")
    layers = {name: only_layer(by_layer, name) for name, by_layer in vectors.items()}
    for name, (layer, vector) in layers.items():
        if layer < lowest:
            where = "acts on the embeddings (layer -1)" if layer < 0 else f"acts after block {layer}"
            raise ValueError(f"steering vector {name!r} {where}; {why}")
        check_finite({name: vector}, request.directory, "export")
    return layers


def write_per_vector(
    request: ExportRequest, layers: dict[str, tuple[int, torch.Tensor]], suffix: str, write
) -> list[Path]:
    """One `<concept><suffix>` file per vector in `request.out`, each written atomically by
    `write(tmp_path, layer, vector)`."""
    request.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, stem in file_stems(list(layers)).items():
        layer, vector = layers[name]
        path = request.out / f"{stem}{suffix}"
        write_atomically(path, lambda tmp, layer=layer, vector=vector: write(tmp, layer, vector))
        written.append(path)
    return written
