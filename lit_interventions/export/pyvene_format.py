"""Interventions saved as pyvene saves them, so that `pyvene.IntervenableModel.load(DIR, model)`
restores them on the LM (pyvene 0.1.8, `pyvene/models/intervenable_base.py` save / load).

    lit-interventions export --artifact RUN_DIR --to pyvene --out DIR
    intervenable = pyvene.IntervenableModel.load(DIR, model)

What each artifact becomes (its `to_pyvene()`, or its `steering_vectors()`):

- DAS, a closed-form direction (`RotatedSpaceIntervention`, `FixedSubspaceIntervention`): pyvene's
  `LowRankRotatedSpaceIntervention` with rotate_layer weight Wᵀ (d, k), the same interchange
  f* = f(b) + Wᵀ(W f(s) − W f(b)) at the one position of the site;
- LoReFT (`LoReFTIntervention`): `lit_interventions.export.pyvene_interventions.LoreftIntervention`,
  Φ(h) = h + Rᵀ(W h + b − R h) at the positions it is given; LoReFT at several layers
  (`LoReFTModule.to_pyvene_layers`) is one such intervention per layer in one directory, in the
  order of its layers. pyvene's config records no positions: pass them as `unit_locations`
  (for `f5+l5`, the prompt's first 5 and last 5 tokens, the same list for every layer);
- a concept dictionary (ReFT-r1, SSV, DiffMean, ...): one directory per concept, each pyvene's
  `AdditionIntervention` with the constant source α·w, so Φ(h_i) = h_i + α·w at the positions it is
  given (`steer` adds it at every position: pass them all).

The site maps to pyvene's representation config as `layer`, `component` (`block_output`,
`attention_output` and `mlp_output` are pyvene's names too), `unit="pos"`; our layer -1 (the
embeddings, before block 0) is pyvene's `block_input` of layer 0. The files are pyvene's own
`IntervenableModel.save` output (config.json and one `intkey_<key>.bin` per intervention), built on
the LM's module tree without its weights (the meta device) and moved into place atomically.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from lit_interventions.core.blocks import BLOCK_OUTPUT
from lit_interventions.core.files import check_finite, write_atomically
from lit_interventions.export import pyvene_interventions
from lit_interventions.export.pyvene_interventions import pyvene  # imported there, quietly
from lit_interventions.export.request import ExportRequest, file_stems, only_layer


def write_pyvene_intervention(intervention, request: ExportRequest) -> list[Path]:
    """`request.out` as a pyvene directory holding `intervention.to_pyvene()` at the artifact's site."""
    spec = request.call(intervention, "to_pyvene")
    layer, component = request.site()
    return save_pyvene(request, request.out, spec, layer, component)


def write_pyvene_additions(steering, request: ExportRequest) -> list[Path]:
    """One pyvene directory per steering vector of `steering` (its `steering_vectors()`), under
    `request.out/<concept>/`: `AdditionIntervention` with the constant source α·w at its layer."""
    vectors = request.call(steering, "steering_vectors")
    layers = {name: only_layer(by_layer, name) for name, by_layer in vectors.items()}
    written = []
    for name, stem in file_stems(list(layers)).items():
        layer, vector = layers[name]
        spec = {"intervention_type": "AdditionIntervention", "source_representation": vector.detach().float()}
        written += save_pyvene(request, request.out / stem, spec, layer, BLOCK_OUTPUT)
    return written


def write_pyvene_layers(steering, request: ExportRequest) -> list[Path]:
    """`request.out` as one pyvene directory holding `steering.to_pyvene_layers()`: one
    intervention per layer at block_output, in that order (LoReFT at several layers)."""
    specs = request.call(steering, "to_pyvene_layers")
    return save_pyvene_parts(request, request.out, [(spec, layer, BLOCK_OUTPUT) for layer, spec in specs.items()])


def save_pyvene(request: ExportRequest, out: Path, spec: dict, layer: int, component: str) -> list[Path]:
    """`out` as `IntervenableModel.save` writes it, for one intervention `spec` (see `to_pyvene`:
    intervention_type, low_rank_dimension, source_representation, weights) at (layer, component)."""
    return save_pyvene_parts(request, out, [(spec, layer, component)])


def save_pyvene_parts(request: ExportRequest, out: Path, parts: list[tuple[dict, int, str]]) -> list[Path]:
    """`out` as `IntervenableModel.save` writes it, for the interventions `parts`, each (spec,
    layer, component), in that order (pyvene's representations and intervention keys)."""
    representations = []
    for spec, layer, component in parts:
        tensors = {**spec.get("weights", {}), "source_representation": spec.get("source_representation")}
        check_finite({k: v for k, v in tensors.items() if v is not None}, request.directory, "export")
        representations.append(
            pyvene.RepresentationConfig(
                layer=0 if layer == -1 else layer,
                component="block_input" if layer == -1 else component,
                unit="pos",
                low_rank_dimension=spec.get("low_rank_dimension"),
                intervention_type=intervention_class(spec["intervention_type"]),
                source_representation=spec.get("source_representation"),
            )
        )
    intervenable = pyvene.IntervenableModel(
        pyvene.IntervenableConfig(representations=representations), request.skeleton()
    )
    with torch.no_grad():
        for (spec, _, _), intervention in zip(parts, intervenable.interventions.values()):
            for name, tensor in spec.get("weights", {}).items():  # orthogonal parametrizations: their right_inverse
                owner, _, attribute = name.rpartition(".")
                module = intervention.get_submodule(owner)
                setattr(module, attribute, _weight(module, attribute, tensor))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with (
        tempfile.TemporaryDirectory(prefix="lit-interventions-pyvene-") as tmp,
        contextlib.redirect_stdout(io.StringIO()),
    ):
        intervenable.save(tmp)  # pyvene prints where it saves
        for file in sorted(Path(tmp).iterdir()):
            written.append(write_atomically(out / file.name, file.read_bytes()))
    return written


def _weight(module: torch.nn.Module, attribute: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as `setattr(module, attribute, ...)` takes it: a plain tensor for a parametrized
    weight (its right_inverse runs: an orthogonal one keeps it), an nn.Parameter otherwise."""
    tensor = tensor.detach().float().clone()
    return tensor if parametrize.is_parametrized(module, attribute) else torch.nn.Parameter(tensor)


def intervention_class(name: str) -> type:
    """The pyvene intervention class `name` names: pyvene's own, or one of `pyvene_interventions`."""
    cls = getattr(pyvene, name, None) or getattr(pyvene_interventions, name, None)
    if not isinstance(cls, type) or not issubclass(cls, pyvene.Intervention):
        raise ValueError(f"intervention_type={name!r} is not a pyvene intervention class")
    return cls
