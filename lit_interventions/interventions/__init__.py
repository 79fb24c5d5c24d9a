"""Interventions: pure torch modules mapping (f(b), f(s)) to f*(b, s). No Lightning here.

Import each from the module that defines it; `lit_interventions` offers the public ones.
"""
