"""The callbacks every Lightning run gets for its output: the final metrics table with the run
directory (`RunSummary`, which also hides Lightning's no-optimizer warnings from a fit in closed
form) and line-based progress when stdout is not a terminal (`LineProgress`); and the one a
study's own loops get (`LoopProgress`: their batches as stages of its progress)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from lit_interventions.core.progress import Progress, stage
from lit_interventions.core.quiet import NoOptimizerExpected
from lit_interventions.interventions.capabilities import Fitted, is_trained


def _scalars(metrics) -> dict[str, float]:
    values = {}
    for key, value in metrics.items():
        value = torch.as_tensor(value)
        if value.numel() == 1:
            values[key] = float(value)
    return dict(sorted(values.items()))


def metrics_table(metrics: dict[str, float]) -> str:
    """One metric a line, names aligned."""
    if not metrics:
        return "(no metrics logged)"
    width = max(map(len, metrics))
    return "\n".join(
        f"{name:<{width}}  {value:.4f}" if math.isfinite(value) else f"{name:<{width}}  {value}"
        for name, value in metrics.items()
    )


def fitted_in_closed_form(pl_module) -> bool:
    """Whether a module's method is fitted in closed form, with no optimizer step: a `Fitted`
    method that does not train, as a `SteeringModule`'s direction estimator (`method`) or an
    `InterchangeModule`'s closed-form direction or featurizer (`intervention`)."""
    return any(
        isinstance(found, Fitted) and not is_trained(found)
        for found in (getattr(pl_module, name, None) for name in ("method", "intervention"))
    )


def _shown(path: str | Path) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def end_progress_display(trainer, pl_module, hook: str | None = None) -> None:
    """Leave the progress bar finished on screen before a summary is printed below it.

    Lightning runs the progress bar callback after the others (it is appended to the trainer's
    callbacks), so a summary printed in an end hook would come before the bar's own end: tqdm's bar
    of the stage is closed in that `hook` (`on_test_end`, `on_validation_end`) and drawn once more
    when it closes; rich's live display is stopped only at teardown and redraws the bar below
    everything printed until then. Here the tqdm hook runs first (closing a closed bar does
    nothing), and rich's live display is stopped (its teardown finds it stopped).
    """
    bar = trainer.progress_bar_callback
    if isinstance(bar, TQDMProgressBar) and hook is not None:
        getattr(bar, hook)(trainer, pl_module)
    live = getattr(getattr(bar, "progress", None), "live", None)  # RichProgressBar.progress: a rich Progress
    if live is not None and getattr(live, "is_started", False):
        live.stop()


class RunSummary(Callback):
    """At the end of fit, validate and test, rank 0 prints the last value of every logged metric
    (sorted, aligned) and the run directory, below the finished progress bar (the last lines on
    screen). A fit in closed form (`fitted_in_closed_form`) shows what it fits (the module prints
    it) and not Lightning's warnings for a fit with no optimizer (`NoOptimizerExpected`), from
    `setup` (before Lightning asks for the optimizers) to `teardown`."""

    def __init__(self):
        super().__init__()
        self._no_optimizer = NoOptimizerExpected()

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and fitted_in_closed_form(pl_module):
            self._no_optimizer.start()

    def teardown(self, trainer, pl_module, stage):
        self._no_optimizer.stop()

    def on_exception(self, trainer, pl_module, exception):
        self._no_optimizer.stop()

    def _report(self, trainer, pl_module, what: str, hook: str | None = None) -> None:
        directory = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        end_progress_display(trainer, pl_module, hook)
        print(
            f"\n{what} metrics\n{metrics_table(_scalars(trainer.callback_metrics))}\nfiles in {_shown(directory)}",
            flush=True,
        )

    def on_fit_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "fit: final")

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._report(trainer, pl_module, "validate:", "on_validation_end")

    def on_test_end(self, trainer, pl_module):
        self._report(trainer, pl_module, "test:", "on_test_end")


class LineProgress(ProgressBar):
    """Progress as plain lines (flushed), for stdout that is not a terminal (`> log.txt`): one line
    every `every` training steps (default: about 20 lines an epoch) and one per validation. A
    step of a fit in closed form, which has no loss, says so."""

    def __init__(self, every: int | None = None):
        super().__init__()
        self.every = every
        self._enabled = True
        self._closed_form = False

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._closed_form = fitted_in_closed_form(pl_module)  # before the fit replaces the method

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _print(self, text: str) -> None:
        if self._enabled:
            print(text, flush=True)

    def _values(self, trainer, pl_module, prefix: str) -> str:
        metrics = self.get_metrics(trainer, pl_module)
        return "  ".join(
            f"{k} {float(v):.4f}"
            for k, v in sorted(metrics.items())
            if k.startswith(prefix) and isinstance(v, (int, float))
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        total = self.total_train_batches
        every = self.every or (max(1, int(total) // 20) if math.isfinite(total) else 50)
        done = batch_idx + 1
        if done % every == 0 or done == total:
            shown = int(total) if math.isfinite(total) else "?"
            values = self._values(trainer, pl_module, "train") or ("closed form, no loss" if self._closed_form else "")
            self._print(f"epoch {trainer.current_epoch} step {done}/{shown}  {values}".rstrip())

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._print(f"epoch {trainer.current_epoch} validation  {self._values(trainer, pl_module, 'val')}".rstrip())

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._print("validating")

    def on_test_start(self, trainer, pl_module):
        self._print("testing")


def _batches(counts) -> int | None:
    """The sum of Lightning's batch counts (a list per dataloader, or one number); None if unknown."""
    total = sum(counts) if isinstance(counts, (list, tuple)) else counts
    return int(total) if math.isfinite(total) else None


class LoopProgress(Callback):
    """The batches of a Lightning loop a study runs (a trained method's fit, a RAVEL cell, a probe)
    as stages of the study's progress (`core.progress.stage`): training (every epoch, from where a
    resumed loop starts), validation (`validation`: False leaves it out) and test. Outside a
    study's progress it shows nothing."""

    def __init__(self, validation: bool = True):
        super().__init__()
        self.validation = validation
        self._stages: dict[str, Progress] = {}

    def _open(self, name: str, total: int | None, initial: int = 0) -> None:
        self._close(name)
        self._stages[name] = stage(total, f"{name} batches", "batch", initial).__enter__()

    def _close(self, name: str) -> None:
        found = self._stages.pop(name, None)
        if found is not None:
            found.close()

    def on_train_start(self, trainer, pl_module):
        per_epoch = _batches(trainer.num_training_batches)
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        total = per_epoch * epochs if per_epoch is not None and epochs is not None else None
        if total is not None and trainer.max_steps > 0 and trainer.accumulate_grad_batches == 1:
            total = min(total, trainer.max_steps)
        self._open("training", total, trainer.fit_loop.epoch_loop.batch_progress.total.completed)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "training" in self._stages:
            self._stages["training"].update_to(trainer.fit_loop.epoch_loop.total_batch_idx + 1)

    def on_train_end(self, trainer, pl_module):
        self._close("training")

    def on_validation_start(self, trainer, pl_module):
        if self.validation and not trainer.sanity_checking:
            self._open("validation", _batches(trainer.num_val_batches))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if "validation" in self._stages:
            self._stages["validation"].update()

    def on_validation_end(self, trainer, pl_module):
        self._close("validation")

    def on_test_start(self, trainer, pl_module):
        self._open("test", _batches(trainer.num_test_batches))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if "test" in self._stages:
            self._stages["test"].update()

    def on_test_end(self, trainer, pl_module):
        self._close("test")

    def on_exception(self, trainer, pl_module, exception):
        for name in list(self._stages):
            self._close(name)
