"""The export formats, each defined by the capability it needs, and `export_artifact`.

A format is reached through a route: a capability (a method the loaded artifact provides, such
as `peft_adapter`, `steering_vectors` or `to_pyvene`) and the writer that turns what it returns
into the other tool's files. Which artifacts a format takes is decided by their methods alone,
so a new artifact class joins a format by providing the capability; there is no table of kinds.
"""

from __future__ import annotations

import importlib
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_interventions.artifacts.hub import CONFIG, local_directory, read_config
from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.core.files import disk_full, first_reason
from lit_interventions.export import layout
from lit_interventions.export.request import ExportRequest

Writer = Callable[[Any, ExportRequest], list[Path]]


@dataclass(frozen=True)
class Format:
    """An export format: its routes (capability, writer), tried in order, and which entries of an
    output directory are its own (`owns`), so that an export replaces only those. A writer is
    named `"package.module:function"` and imported when an export takes its route (pyvene's and
    peft's imports cost seconds that the other formats and a refused export need not pay)."""

    routes: tuple[tuple[str, str], ...]
    owns: Callable[[Path], bool]
    help: str

    def route(self, artifact: Any) -> str | None:
        """The writer of the first route whose capability `artifact` provides."""
        return next((write for capability, write in self.routes if callable(getattr(artifact, capability, None))), None)

    @property
    def capabilities(self) -> str:
        return " or ".join(f"{capability}()" for capability, _ in self.routes)


HERE = "lit_interventions.export"
FORMATS: dict[str, Format] = {
    "peft": Format(
        (("peft_adapter", f"{HERE}.peft_adapter:write_peft"),),
        layout.peft_files,
        "a PEFT adapter directory (PeftModel.from_pretrained, vLLM --lora-modules)",
    ),
    "gguf-control-vector": Format(
        (("steering_vectors", f"{HERE}.control_vector:write_control_vectors"),),
        layout.gguf_files,
        "one llama.cpp control vector per concept (llama-cli --control-vector FILE)",
    ),
    "pyvene": Format(
        (
            ("to_pyvene", f"{HERE}.pyvene_format:write_pyvene_intervention"),
            ("to_pyvene_layers", f"{HERE}.pyvene_format:write_pyvene_layers"),
            ("steering_vectors", f"{HERE}.pyvene_format:write_pyvene_additions"),
        ),
        layout.pyvene_files,
        "a directory pyvene.IntervenableModel.load(DIR, model) restores (one per concept)",
    ),
    "lm-eval": Format(
        (("steering_vectors", f"{HERE}.lm_eval_steering:write_lm_eval"),),
        layout.torch_files,
        "one steering .pt per concept for lm-evaluation-harness (--model steered)",
    ),
}


def writer(target: str) -> Writer:
    """The writer a route names, `"package.module:function"`, imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def supported_formats(artifact: Any) -> list[str]:
    """The formats `artifact` can be exported to: those with a route whose capability it provides."""
    return [name for name, fmt in FORMATS.items() if fmt.route(artifact) is not None]


def check_format(to: object) -> Format:
    """The format `to` names; a ValueError listing the formats for any other value."""
    if not isinstance(to, str) or to not in FORMATS:
        raise ValueError(f"--to {to!r} is not an export format; formats: {', '.join(FORMATS)}")
    return FORMATS[to]


def check_out(out: Path, fmt: Format, to: str) -> None:
    """`out` may receive the export: absent, its nearest existing folder a directory that can be
    written; or a directory that can be written holding only files `fmt` writes (an earlier export
    of the same format), which are replaced, and the temporary files of another export writing
    there at the same time (`layout.in_flight`: the last one to finish leaves its files, each
    whole). Nothing is created."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing)")
    if out.is_dir():
        for entry in sorted(out.iterdir()):
            if not layout.in_flight(entry) and not fmt.owns(entry):
                raise ValueError(
                    f"--out {out} already holds {entry.name}, which a {to} export does not write; "
                    "give an empty or new directory"
                )
    existing = next(folder for folder in (out, *out.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out} cannot be created: {existing} is a file; give a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):  # permissions, a read-only file system, ACLs
            pass
    except OSError as err:
        where = "" if existing == out else f" (it would be created in {existing})"
        raise ValueError(
            f"--out {out} is not writable{where}: {err.strerror or type(err).__name__}; give a directory you can write"
        ) from None


def export_artifact(
    artifact: str | Path,
    to: str,
    out: str | Path,
    concept: str | int | None = None,
    factor: float | None = None,
    **download: Any,
) -> list[Path]:
    """Write the artifact saved at `artifact` (a directory or a hub id) in the format `to` into the
    directory `out`; returns the files written. `concept` (a name or row; None: every concept) and
    `factor` (default 1.0) go to capabilities that take them; given to one that does not, they are
    refused. The format, `factor` and `out` are checked before the artifact is read, its
    capability right after it loads (before any writer's work). `download`: as `from_pretrained`."""
    fmt = check_format(to)
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor)
    ):
        raise ValueError(f"--factor {factor!r} must be a finite number")
    if concept is not None and (isinstance(concept, bool) or not isinstance(concept, int | str)):
        raise ValueError(f"--concept {concept!r} must be a concept's name or its row")
    out = Path(out).expanduser()
    check_out(out, fmt, to)
    directory = local_directory(artifact, **download)
    loaded = from_pretrained(directory)
    write = fmt.route(loaded)
    if write is None:
        supported = supported_formats(loaded)
        can = f"it can be exported to: {', '.join(supported)}" if supported else "it has no export format"
        raise ValueError(f"{type(loaded).__name__} cannot be exported to {to} (it has no {fmt.capabilities}); {can}")
    config = read_config(directory) if (directory / CONFIG).is_file() else {}
    model = config.get("model") or getattr(loaded, "model", None)
    request = ExportRequest(directory, config, out, concept, factor, model if isinstance(model, str) else None)
    try:
        return writer(write)(loaded, request)
    except (FileNotFoundError, FileExistsError):
        raise  # a file the export reads (the LM's config): the command's line names it
    except OSError as err:
        raise ExportNotWritten(out, err) from err
    except RuntimeError as err:  # torch's zip writer on a short write: `unexpected pos`, no errno
        if not disk_full(err, out):
            raise
        raise ExportNotWritten(out, err) from err


class ExportNotWritten(OSError):
    """An export's file could not be written (a full disk, a directory made read-only while it
    ran): one line naming `--out` and why, the disk being full when it is. Every file is written
    beside itself and renamed (`write_atomically`), so nothing half-written is left under a final
    name, and the files of an earlier export that were not replaced are whole."""

    def __init__(self, out: Path, reason: BaseException):
        full = disk_full(reason, out)
        why = "the disk is full (No space left on device)" if full else first_reason(reason)
        fix = "free some space and export again" if full else "fix that and export again"
        super().__init__(
            f"--out {out} could not be written: {why}; no file is left half-written (each is written "
            f"beside itself and renamed), {fix}"
        )
