"""Lightning checkpoints that are whole or absent on a local disk.

Lightning's own writer stages a checkpoint in the system's temporary directory and moves it into
place; across file systems that move is a copy, so a full disk leaves a truncated checkpoint
under its final name. `AtomicCheckpointIO` writes it beside its target and renames it there
(`write_atomically`): a reader, or a resumed run, sees the previous checkpoint or the new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_interventions.core.files import write_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes go through a temporary file beside the checkpoint
    and `os.replace`; remote paths (s3://, ...) keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        local = str(path).removeprefix("file://")
        if storage_options is not None or "://" in local:
            return super().save_checkpoint(checkpoint, path, storage_options)
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(local, lambda tmp: torch.save(checkpoint, tmp))
