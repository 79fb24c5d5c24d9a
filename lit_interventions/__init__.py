"""lit-interventions: learned interventions on frozen language models, with PyTorch Lightning."""

__version__ = "0.1.0"
