"""Interventions: pure torch modules mapping (f(b), f(s)) to f*(b, s). No Lightning here."""

from lit_interventions.interventions.base import (
    Intervention,
    InterventionProtocol,
    load_intervention,
    save_intervention,
)
from lit_interventions.interventions.directions import (
    METHODS,
    DiffMeanDirection,
    KMeansDirection,
    LDADirection,
    PCADirection,
    ProbeDirection,
    RandomDirection,
    default_probe_strength,
    fit_direction,
    fit_intervention,
)
from lit_interventions.interventions.rotation import (
    FixedSubspaceIntervention,
    RotatedSpaceIntervention,
    subspace_interchange,
)

__all__ = [
    "Intervention",
    "InterventionProtocol",
    "load_intervention",
    "save_intervention",
    "fit_intervention",
    "FixedSubspaceIntervention",
    "RotatedSpaceIntervention",
    "subspace_interchange",
    "METHODS",
    "DiffMeanDirection",
    "KMeansDirection",
    "LDADirection",
    "PCADirection",
    "ProbeDirection",
    "RandomDirection",
    "default_probe_strength",
    "fit_direction",
]
