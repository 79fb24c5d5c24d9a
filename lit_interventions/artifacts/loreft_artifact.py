"""The saved form of LoReFT at several layers or at chosen positions: tensor names and checks.

One LoReFT intervention per layer (R, W, b each), stored flat in one safetensors file:

    layers.<L>.rotation   R, (r, d), orthonormal rows
    layers.<L>.weight     W, (r, d)
    layers.<L>.bias       b, (r,)

The card records `layers` (the block indices, in order), `positions` ("all" or "fN+lM"),
`rank` and `hidden_size`. A card and its tensors are checked before anything is built: each
problem is one ValueError naming the field or tensor and its value. The single-layer form at
every position (`layer`, tensors `rotation`, `weight`, `bias`) is `LoReFTIntervention`'s own.
"""

from __future__ import annotations

import torch

from lit_interventions.core.positions import ENDS, Positions, parse_ends

PARTS = ("rotation", "weight", "bias")
ORTHONORMAL_ATOL = 1e-3  # |R Rᵀ − I| allowed in a saved rotation (float32 round trips stay far below)


def loreft_positions(value: object) -> Positions:
    """`value` as LoReFT's positions: "all" (every position, prompt and generated) or "fN+lM"
    (the prompt's first N and last M tokens); a ValueError naming it otherwise."""
    if value == "all":
        return Positions("all")
    ends = parse_ends(value) if isinstance(value, str) else None
    if ends is None or not any(ends):
        raise ValueError(
            f"positions={value!r}: use 'all' or fN+lM (e.g. f5+l5, the prompt's first 5 and last 5 tokens)"
        )
    return Positions(ENDS, ends)


def check_layers(value: object, n_layers: int) -> list[int]:
    """`value` as a non-empty list of distinct block indices in -1..n_layers−1 (-1: the embeddings)."""
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in value)
    ):
        raise ValueError(f"layers={value!r} must be a non-empty list of block indices")
    if len(set(value)) != len(value):
        raise ValueError(f"layers={list(value)!r} names a layer twice")
    if bad := [layer for layer in value if not -1 <= layer < n_layers]:
        raise ValueError(
            f"layers={list(value)!r}: {bad} out of range; this model has {n_layers} layers (-1..{n_layers - 1})"
        )
    return list(value)


def layer_tensors(by_layer: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{layer: {rotation, weight, bias}} flattened to the saved names."""
    return {f"layers.{layer}.{part}": tensors[part] for layer, tensors in by_layer.items() for part in PARTS}


def check_card(card: dict) -> tuple[list[int], int]:
    """(layers, rank) of a multi-layer card, checked for type (the LM checks the range)."""
    layers, rank = card.get("layers"), card.get("rank")
    if not isinstance(layers, list) or not layers or not all(type(layer) is int for layer in layers):
        raise ValueError(f"a LoReFT card's layers={layers!r} must be a non-empty list of block indices")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"a LoReFT card's rank={rank!r} must be a positive integer")
    loreft_positions(card.get("positions", "all"))
    return layers, rank


def split_tensors(tensors: dict[str, torch.Tensor], layers: list[int], rank: int) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {rotation, weight, bias}} from the saved names, checked: exactly the names of
    `layers`, the shapes of rank `rank` at one width, finite values, R with orthonormal rows."""
    expected = set(layer_tensors({layer: dict.fromkeys(PARTS) for layer in layers}))
    if missing := sorted(expected - set(tensors)):
        raise ValueError(f"LoReFT tensors for layers {layers} miss {missing[:3]}; got {sorted(tensors)[:6]}")
    if unexpected := sorted(set(tensors) - expected):
        raise ValueError(f"LoReFT tensors for layers {layers}: unexpected {unexpected[:3]}")
    width = tensors[f"layers.{layers[0]}.rotation"].shape[-1]
    shapes = {"rotation": (rank, width), "weight": (rank, width), "bias": (rank,)}
    for name in sorted(expected):
        part, tensor = name.rsplit(".", 1)[1], tensors[name]
        if tuple(tensor.shape) != shapes[part]:
            raise ValueError(f"LoReFT tensor {name} has shape {tuple(tensor.shape)}; rank {rank} needs {shapes[part]}")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise ValueError(f"LoReFT tensor {name} must hold finite floating-point values ({tensor.dtype})")
    for layer in layers:
        rotation = tensors[f"layers.{layer}.rotation"].double()
        error = float((rotation @ rotation.T - torch.eye(rank, dtype=torch.double)).abs().max())
        if error > ORTHONORMAL_ATOL:
            raise ValueError(
                f"LoReFT tensor layers.{layer}.rotation: rows are not orthonormal (|R Rᵀ − I| = {error:.3g})"
            )
    return {layer: {part: tensors[f"layers.{layer}.{part}"] for part in PARTS} for layer in layers}
