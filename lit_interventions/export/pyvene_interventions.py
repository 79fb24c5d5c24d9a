"""pyvene interventions for the methods pyvene itself has no class of, so that an export loads with
`pyvene.IntervenableModel.load`: pyvene imports the class its saved config.json names, which is
this module's for a LoReFT export (the package must be installed where the export is loaded)."""

from __future__ import annotations

import contextlib
import io

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

with contextlib.redirect_stdout(io.StringIO()):  # pyvene prints a note about nnsight when imported
    import pyvene
    from pyvene.models.layers import LowRankRotateLayer


class LoreftIntervention(
    pyvene.SourcelessIntervention, pyvene.TrainableIntervention, pyvene.DistributedRepresentationIntervention
):
    """LoReFT (Wu et al. 2024, eq. 2): Φ(h) = h + Rᵀ(W h + b − R h), at every position pyvene is
    given, on the base alone. `rotate_layer.weight` (d, r) is Rᵀ, kept orthonormal by torch's
    orthogonal parametrization, and `learned_source` is nn.Linear(d, r) holding (W, b): the
    parameter names of pyreft's `LoreftIntervention`, without its dropout and activation
    (`lit_interventions.interventions.loreft.LoReFTIntervention` is the same map)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs, keep_last_dim=True)  # (batch, positions, d), not flattened
        rank = kwargs["low_rank_dimension"]
        self.rotate_layer = orthogonal(LowRankRotateLayer(int(self.embed_dim), rank))  # weight: (d, r) = Rᵀ
        self.learned_source = nn.Linear(int(self.embed_dim), rank)  # W: (r, d), b: (r,)

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        rotation_t = self.rotate_layer.weight.to(base.dtype)  # (d, r)
        edit = self.learned_source(base.to(self.learned_source.weight.dtype)).to(base.dtype) - base @ rotation_t
        return base + edit @ rotation_t.T

    def __str__(self):
        return "LoreftIntervention()"
