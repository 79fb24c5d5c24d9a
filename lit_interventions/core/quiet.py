"""Quiet Lightning runs: no adverts, no deprecation warnings a user cannot act on, and the
warnings a user acts on (`OneLineWarning`) shown as one line."""

from __future__ import annotations

import logging
import re
import warnings


class OneLineWarning(UserWarning):
    """A warning about the run a user acts on: a command shows it as one line on stderr,
    `warning: <message>` (no file, line number or source line)."""


def _one_line(format_warning):
    """`warnings.formatwarning` that gives a `OneLineWarning` as one line and formats the rest with
    `format_warning` (recording warnings, `catch_warnings(record=True)`, is left as it is)."""

    def formatwarning(message, category, filename, lineno, line=None):
        if issubclass(category, OneLineWarning):
            return f"warning: {message}\n"
        return format_warning(message, category, filename, lineno, line)

    formatwarning.one_line = True
    return formatwarning


class _NoAdverts(logging.Filter):
    """Lightning's "💡 Tip: ... litlogger / litmodels" lines (rank_zero_info, no switch to turn off),
    and its accelerator lines for hardware that is absent ("GPU available: False, used: False",
    "TPU available: False, using: 0 TPU cores"): on a CPU-only machine they read as a fault. A
    present accelerator's line ("GPU available: True (cuda), used: True") is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg) % record.args if record.args else str(record.msg)
        return not message.startswith("💡 Tip") and not re.match(r"[A-Z]PU available: False\b", message)


def quiet_lightning() -> None:
    """Drop Lightning's adverts and torch's `LeafSpec` deprecation (raised by Lightning's own
    `_pytree` helper, nothing a user can act on), and show a `OneLineWarning` as one line.
    Idempotent."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdverts) for f in logger.filters):
        logger.addFilter(_NoAdverts())
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # train_main passes the command line as `args` (with --config names resolved): not a mistake
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended to run from within Python")
    if not getattr(warnings.formatwarning, "one_line", False):
        warnings.formatwarning = _one_line(warnings.formatwarning)


# Lightning's warnings for a fit with no optimizer step: expected of a closed-form fit
NO_OPTIMIZER_WARNINGS = (
    r"`LightningModule.configure_optimizers` returned `None`, this fit will run with no optimizer",
    r"`training_step` returned `None`",
)


class NoOptimizerExpected:
    """Lightning's warnings for a fit with no optimizer step (`NO_OPTIMIZER_WARNINGS`: "this fit
    will run with no optimizer", "`training_step` returned `None`") hidden from `start()` to
    `stop()`, for a fit in closed form, where they are expected; every other warning is shown
    as before. `stop()` restores the warning filters of `start()`; both are idempotent."""

    def __init__(self):
        self._saved: warnings.catch_warnings | None = None

    def start(self) -> None:
        if self._saved is None:
            self._saved = warnings.catch_warnings()
            self._saved.__enter__()
            for message in NO_OPTIMIZER_WARNINGS:
                warnings.filterwarnings("ignore", message=message)

    def stop(self) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None


class _NoOptionalKernel(logging.Filter):
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (logged when peft
    imports it, in every run): an optional faster 4-bit kernel from the `kernels` hub package,
    which this project does not use (`sharding.keep_4bit_differentiable` turns that path off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


def quiet_imports() -> None:
    """Filters for what third-party packages log while being imported. Idempotent."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _NoOptionalKernel) for f in logger.filters):
        logger.addFilter(_NoOptionalKernel())
