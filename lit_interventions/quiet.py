"""Quiet Lightning runs: no adverts, no deprecation warnings a user cannot act on."""

from __future__ import annotations

import logging
import warnings


class _NoAdverts(logging.Filter):
    """Lightning's "💡 Tip: ... litlogger / litmodels" lines (rank_zero_info, no switch to turn off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_lightning() -> None:
    """Drop Lightning's adverts and torch's `LeafSpec` deprecation (raised by Lightning's own
    `_pytree` helper, nothing a user can act on). Idempotent."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdverts) for f in logger.filters):
        logger.addFilter(_NoAdverts())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    # train_main passes the command line as `args` (with --config names resolved): not a mistake
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended to run from within Python")
