"""Steering vectors as llama.cpp control vectors: one GGUF file per concept.

    lit-interventions export --artifact DICT_DIR --to gguf-control-vector --out DIR [--concept C] [--factor F]
    llama-cli -m model.gguf --control-vector DIR/<concept>.gguf            # the vector as written
    llama-cli -m model.gguf --control-vector-scaled DIR/<concept>.gguf:0.5 # scaled at load time

The file (written with the `gguf` package's GGUFWriter, as repeng's `ControlVector.export_gguf`
does): architecture `controlvector`, `controlvector.model_hint` (the LM's model_type),
`controlvector.layer_count` (how many direction tensors), and one F32 tensor `direction.<N>` of
n_embd values. Its values are what the artifact's steering adds: α·w with α = factor × the
concept's max activation for a dictionary (`Dictionary.steering_vectors`).

The layer index. Our layer L is the residual stream after 0-based decoder block L (the output of
`model.layers[L]`); llama.cpp's N is the same block index, so N = L:

- common/common.cpp, `common_control_vector_load_one`: `direction.N` is parsed from the tensor
  name, N = 0 is refused ("invalid (zero) direction tensor layer index"), and the tensor is added
  at `data + n_embd * (layer_idx - 1)` ("layer 1 at [0]").
- src/llama-adapter.cpp, `llama_adapter_cvec::apply`: `tensors[il]` is filled from offset
  `n_embd * (il - 1)` for il = 1 .. n_layer - 1 ("there's never a tensor for layer 0"), so
  tensors[il] holds direction.il; `apply_to(ctx, cur, il)` adds tensors[il] to `cur`.
- src/models/llama.cpp, the graph's block loop `for (int il = 0; il < n_layer; ++il)`: after the
  FFN's residual add, `cur = build_cvec(cur, il); cb(cur, "l_out", il);` and `inpL = cur` feeds
  block il + 1: the vector is added to the output of 0-based block il, our layer il.
- repeng agrees: `ControlModel` wraps `model.layers[layer_id]` and adds to its output, training
  reads `hidden_states[layer + 1]` (the output of block `layer`), and `export_gguf` names the
  tensors `direction.{layer}` with that same index.

So layer 0 (and -1, the embeddings) cannot be written: llama.cpp refuses direction.0. llama.cpp
applies the vector at every position of the prompt and of the generated text, as `steer` does.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from lit_interventions.export.request import ExportRequest, steering_layers, write_per_vector

ARCH = "controlvector"


def write_control_vectors(steering, request: ExportRequest) -> list[Path]:
    """One `<concept>.gguf` per steering vector of `steering` (its `steering_vectors()`) in
    `request.out`. A vector at layer < 1 is refused (llama.cpp has no direction.0)."""
    why = "llama.cpp's control vectors start at block 1 (it refuses direction.0)"
    layers = steering_layers(steering, request, 1, why)
    hint = request.model_type()
    return write_per_vector(request, layers, ".gguf", lambda tmp, layer, vector: write_gguf(tmp, hint, {layer: vector}))


def write_gguf(path: str | Path, model_hint: str, directions: dict[int, torch.Tensor]) -> None:
    """A llama.cpp control vector file at `path`: `direction.<layer>` (F32, n_embd) for each layer."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_string(f"{ARCH}.model_hint", model_hint)
    writer.add_uint32(f"{ARCH}.layer_count", len(directions))
    for layer, vector in sorted(directions.items()):
        writer.add_tensor(f"direction.{layer}", vector.detach().cpu().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
