"""lit-interventions: learned interventions on frozen language models, with PyTorch Lightning.

What a notebook imports; each name's module says more:

    from lit_interventions import Site, load_lm, RotatedSpaceIntervention, InterchangeModule
    from lit_interventions import CausalGymDataModule, OddsCallback, from_pretrained, Dictionary

- the frozen LM and where to read or write it: `load_lm`, `load_tokenizer`, `Site`, and the
  batch of interchange pairs, `PairBatch` (`lit_interventions.core`);
- interventions, pure torch modules mapping (f(b), f(s)) to f* (`lit_interventions.interventions`);
- objectives and the LightningModules that train them (`lit_interventions.objectives`,
  `lit_interventions.modules`);
- data modules, one per benchmark (`lit_interventions.datamodules`), and the metric callbacks
  that score them (`lit_interventions.callbacks.metrics`);
- artifacts: `from_pretrained` loads any saved intervention or dictionary
  (`lit_interventions.artifacts`);
- using them: `apply(lm, artifact, ...)` edits a loaded LM while it generates, `generate_pair`
  gives a prompt's continuation without and with it (`lit_interventions.inference`).
"""

__version__ = "0.1.0"

import importlib

from lit_interventions.core.quiet import quiet_imports as _quiet_imports

_quiet_imports()  # before peft imports bitsandbytes, which logs an optional kernel's absence

# {name: the module that defines it}. Each is imported on first use, so that importing one
# module (`lit_interventions.interventions.rotation`, pure torch) does not import Lightning,
# transformers and scikit-learn with the rest.
_API = {
    "Dictionary": "lit_interventions.artifacts.dictionary",
    "apply": "lit_interventions.inference.apply",
    "encode_text": "lit_interventions.core.positions",
    "span_position": "lit_interventions.core.positions",
    "generate_pair": "lit_interventions.inference.generate",
    "from_pretrained": "lit_interventions.artifacts.pretrained",
    "AUROCCallback": "lit_interventions.callbacks.metrics",
    "DisentangleCallback": "lit_interventions.callbacks.metrics",
    "OddsCallback": "lit_interventions.callbacks.metrics",
    "PairBatch": "lit_interventions.core.batch",
    "collate_pairs": "lit_interventions.core.batch",
    "load_lm": "lit_interventions.core.lm",
    "load_tokenizer": "lit_interventions.core.lm",
    "Site": "lit_interventions.core.sites",
    "ActivationsDataModule": "lit_interventions.datamodules.activations",
    "RavelActivationsDataModule": "lit_interventions.datamodules.activations",
    "AxBenchDataModule": "lit_interventions.datamodules.axbench",
    "CausalGymDataModule": "lit_interventions.datamodules.causalgym",
    "PairsDataModule": "lit_interventions.datamodules.pairs",
    "ContrastDataModule": "lit_interventions.datamodules.contrast",
    "RavelDataModule": "lit_interventions.datamodules.ravel",
    "ConceptDictionary": "lit_interventions.interventions.additive",
    "ReFTR1Dictionary": "lit_interventions.interventions.additive",
    "SSVDictionary": "lit_interventions.interventions.additive",
    "GradientAttack": "lit_interventions.interventions.attacks",
    "RandomSignIntervention": "lit_interventions.interventions.attacks",
    "FGSM": "lit_interventions.interventions.attacks",
    "PGD": "lit_interventions.interventions.attacks",
    "RandomSign": "lit_interventions.interventions.attacks",
    "Intervention": "lit_interventions.interventions.base",
    "InterventionProtocol": "lit_interventions.interventions.base",
    "register_intervention": "lit_interventions.interventions.base",
    "Composition": "lit_interventions.interventions.compose",
    "DiffMeanDirection": "lit_interventions.interventions.directions",
    "KMeansDirection": "lit_interventions.interventions.directions",
    "LATDirection": "lit_interventions.interventions.directions",
    "LDADirection": "lit_interventions.interventions.directions",
    "PCADirection": "lit_interventions.interventions.directions",
    "ProbeDirection": "lit_interventions.interventions.directions",
    "RandomDirection": "lit_interventions.interventions.directions",
    "FeatureInterchange": "lit_interventions.interventions.featurizers",
    "FullVectorSwap": "lit_interventions.interventions.featurizers",
    "PCAFeaturizer": "lit_interventions.interventions.featurizers",
    "SAEFeaturizer": "lit_interventions.interventions.featurizers",
    "DirectionInterchange": "lit_interventions.interventions.fitted",
    "FeatureInterchangeFit": "lit_interventions.interventions.fitted",
    "LoReFTIntervention": "lit_interventions.interventions.loreft",
    "SigmoidMaskIntervention": "lit_interventions.interventions.mask",
    "FixedSubspaceIntervention": "lit_interventions.interventions.rotation",
    "RotatedSpaceIntervention": "lit_interventions.interventions.rotation",
    "InterchangeModule": "lit_interventions.modules.interchange",
    "MultiSiteInterchangeModule": "lit_interventions.modules.multisite",
    "ProbeModule": "lit_interventions.modules.probe",
    "SAEModule": "lit_interventions.modules.sae",
    "SteeringModule": "lit_interventions.modules.steering",
    "LoRAModule": "lit_interventions.modules.steering_baselines",
    "LoReFTModule": "lit_interventions.modules.steering_loreft",
    "CauseIsoLoss": "lit_interventions.objectives",
    "CounterfactualLoss": "lit_interventions.objectives",
}


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'lit_interventions' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = [
    "AUROCCallback",
    "ActivationsDataModule",
    "AxBenchDataModule",
    "CausalGymDataModule",
    "ContrastDataModule",
    "CauseIsoLoss",
    "Composition",
    "ConceptDictionary",
    "CounterfactualLoss",
    "Dictionary",
    "DiffMeanDirection",
    "DirectionInterchange",
    "DisentangleCallback",
    "FeatureInterchange",
    "FeatureInterchangeFit",
    "FixedSubspaceIntervention",
    "FullVectorSwap",
    "GradientAttack",
    "InterchangeModule",
    "Intervention",
    "InterventionProtocol",
    "KMeansDirection",
    "LATDirection",
    "LDADirection",
    "LoRAModule",
    "LoReFTIntervention",
    "LoReFTModule",
    "MultiSiteInterchangeModule",
    "OddsCallback",
    "PCADirection",
    "PCAFeaturizer",
    "PairsDataModule",
    "ProbeDirection",
    "ProbeModule",
    "RandomDirection",
    "RandomSignIntervention",
    "FGSM",
    "PGD",
    "RandomSign",
    "RavelActivationsDataModule",
    "RavelDataModule",
    "ReFTR1Dictionary",
    "RotatedSpaceIntervention",
    "SAEFeaturizer",
    "SAEModule",
    "SSVDictionary",
    "Site",
    "SigmoidMaskIntervention",
    "SteeringModule",
    "__version__",
    "apply",
    "encode_text",
    "from_pretrained",
    "generate_pair",
    "load_lm",
    "load_tokenizer",
    "register_intervention",
    "span_position",
]
