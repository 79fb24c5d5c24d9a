"""lit-interventions: learned interventions on frozen language models, with PyTorch Lightning."""

__version__ = "0.1.0"

from lit_interventions.quiet import quiet_imports as _quiet_imports

_quiet_imports()  # before peft imports bitsandbytes, which logs an optional kernel's absence
