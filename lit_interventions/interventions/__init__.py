"""Interventions: pure torch modules mapping (f(b), f(s)) to f*(b, s). No Lightning here."""

from lit_interventions.interventions.base import Intervention, InterventionProtocol
from lit_interventions.interventions.capabilities import (
    Annealed,
    DirectionEstimator,
    Fitted,
    Penalised,
    SourceFree,
    Trained,
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
    FullSubspaceSwap,
    RotatedSpaceIntervention,
    subspace_interchange,
)

__all__ = [
    "Intervention",
    "InterventionProtocol",
    "fit_intervention",
    "FixedSubspaceIntervention",
    "FullSubspaceSwap",
    "Annealed",
    "DirectionEstimator",
    "Fitted",
    "Penalised",
    "SourceFree",
    "Trained",
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
