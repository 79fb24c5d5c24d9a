"""Interventions: pure torch modules mapping (f(b), f(s)) to f*(b, s). No Lightning here.

Import each from the module that defines it; `lit_interventions` offers the public ones.
"""

# kept here only until studies/causalgym_scoring.py imports it from interventions/rotation.py
from lit_interventions.interventions.rotation import FixedSubspaceIntervention  # noqa: F401
