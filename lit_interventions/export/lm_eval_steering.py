"""Steering vectors as lm-evaluation-harness's steered model reads them: one `.pt` per concept.

    lit-interventions export --artifact DICT_DIR --to lm-eval --out DIR [--concept C] [--factor F]
    lm_eval --model steered --model_args pretrained=MODEL,steer_path=DIR/<concept>.pt --tasks ...

The layout is the one `lm_eval/models/hf_steered.py` (`SteeredModel`, lm-eval 0.4.13) reads,
checked against its source:

- the docstring of `SteeredModel.__init__` (lines 79-90): a .pt file holding
  `{hookpoint: {"steering_vector": Tensor, "steering_coefficient": float, "action": "add" | "clamp",
  "bias": Tensor | None, "head_index": int | None}}`;
- lines 101-106: a path ending in `.pt` or `.pth` is read with `torch.load`;
- lines 113-131: for each hookpoint, `steering_vector` is moved to the model's device and dtype,
  `steering_coefficient` read with `float(...)` (default 1.0), `head_index` and `bias` with
  `.get` (default None; `add` asserts bias is None), and action "add" steers with
  `vector=steering_vector * steering_coefficient`;
- lines 210-228, `SteeredModel.add`: `acts = acts + vector` on the hooked module's output, at
  every sequence position (prompt and generated tokens);
- lines 36-57, `steer`: a hookpoint is a module name of `model.base_model.named_modules()` whose
  forward output (its first element when a tuple) is edited; an unresolved name is a ValueError.

So each file holds one hookpoint, the decoder block whose output is our layer L (`layers.L` in a
Llama, `h.L` in a GPT-2, found by name on the LM's module tree), with `steering_vector` = α·w
(float32; α = factor × max activation for a dictionary), `steering_coefficient` 1.0 (scale it
there), `action` "add", `bias` and `head_index` None: lm-eval then adds exactly what `steer` adds.
Layer -1 (the embeddings) has no block output to hook and is refused.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from lit_interventions.export.request import ExportRequest, block_name, steering_layers, write_per_vector


def write_lm_eval(steering, request: ExportRequest) -> list[Path]:
    """One `<concept>.pt` per steering vector of `steering` (its `steering_vectors()`) in `request.out`."""
    why = "lm-eval's steered model hooks module outputs, and the embeddings' sum is no one module's output"
    layers = steering_layers(steering, request, 0, why)
    skeleton = request.skeleton()

    def write(tmp: Path, layer: int, vector: torch.Tensor) -> None:
        buffer = io.BytesIO()  # in memory: the bytes name no file (a rerun writes the same), a full disk is ENOSPC
        torch.save({block_name(skeleton, layer): steering_entry(vector)}, buffer)
        tmp.write_bytes(buffer.getvalue())

    return write_per_vector(request, layers, ".pt", write)


def steering_entry(vector: torch.Tensor) -> dict:
    """One hookpoint's entry: add `vector` (d,) at every position, unscaled."""
    return {
        "steering_vector": vector.detach().cpu().float().contiguous(),
        "steering_coefficient": 1.0,
        "action": "add",
        "bias": None,
        "head_index": None,
    }
