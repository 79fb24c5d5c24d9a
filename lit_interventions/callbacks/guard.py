"""Stop a run the moment it goes non-finite, before anything is exported.

`NonFiniteGuard` checks, on every training step, the loss the module returned, every metric
logged so far under `train/`, and the module's own (trainable) parameters after the optimizer
step; after each validation (sanity check excluded) and when training ends, every logged metric
and the parameters again. The first NaN or ±inf raises `NonFiniteError` with one line naming the
metric (or parameter), the step, and the likely cause: a bad learning rate (non-finite or huge),
non-finite weights in the frozen LM (with the directory they were loaded from, e.g. the model
cache), or a low-precision dtype. The error propagates out of `trainer.fit`, so `on_fit_end` never
runs: the export callbacks (`ExportIntervention`, `ExportDictionary`) write nothing, and the
process exits non-zero.

    trainer = L.Trainer(callbacks=[NonFiniteGuard(), ExportDictionary()])

Metrics that are NaN by design can be skipped with `ignore` (fnmatch patterns): by default the
per-concept AUROC `*/auroc/*`, which is NaN for a concept whose positives or negatives are not
among the validation batches seen (e.g. with `limit_val_batches`).

`DegenerateGuard` warns (one line, `DegenerateRunWarning`) when a run whose every number is finite
exports a result that means nothing: a trained mask all 0/1 at a validation before training ends
(saturated: it no longer learns), a trainable parameter that did not start at zero become zero
everywhere (collapsed: the intervention does nothing), or every validation metric the same at
each of two or more validations although the trained parameters changed.
"""

from __future__ import annotations

import math
import warnings
from fnmatch import fnmatch
from pathlib import Path

import torch
from lightning import Callback

from lit_interventions.core.model_cache import cache_dir
from lit_interventions.core.quiet import OneLineWarning
from lit_interventions.core.signals import Stopped, pending_signal
from lit_interventions.interventions.capabilities import Tempered

HUGE_LR = 1e3  # a learning rate above this is reported as the likely cause


class NonFiniteError(RuntimeError):
    """A training loss, logged metric or parameter became NaN or infinite."""


def _scalar(value) -> float | None:
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if tensor.numel() != 1 or not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    return float(tensor.detach().float().cpu())


def _non_finite_weights(model: torch.nn.Module) -> tuple[str, int] | None:
    """(first parameter name, number of parameters) with a NaN/inf value in `model`, or None."""
    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    return (bad[0], len(bad)) if bad else None


def _in_cache(path: Path) -> bool:
    try:
        return path.is_dir() and cache_dir().resolve() in path.resolve().parents
    except OSError:
        return False


def bad_learning_rate(trainer, pl_module) -> str | None:
    """ "a bad learning rate (lr=...); ..." when the configured or scheduled lr is non-finite or
    above `HUGE_LR`, else None."""
    hp = getattr(pl_module, "hparams", {}) or {}
    lrs = [hp.get("lr")] if "lr" in hp else []  # as configured; then as scheduled now
    lrs += [g.get("lr") for opt in (getattr(trainer, "optimizers", None) or []) for g in opt.param_groups]
    for lr in lrs:
        if isinstance(lr, (int, float)) and (not math.isfinite(lr) or abs(lr) > HUGE_LR):
            return f"a bad learning rate (lr={lr}); use a finite lr such as 1e-3"
    return None


def likely_cause(trainer, pl_module) -> str:
    """The most probable reason a run went non-finite, in words (checked in this order: the
    learning rate, the frozen LM's weights, the dtype)."""
    hp = getattr(pl_module, "hparams", {}) or {}
    bad_lr = bad_learning_rate(trainer, pl_module)
    if bad_lr:
        return bad_lr
    lm = (getattr(pl_module, "_frozen", None) or {}).get("lm")  # never load the LM just to diagnose
    if isinstance(lm, torch.nn.Module):
        found = _non_finite_weights(lm)
        if found:
            source = getattr(lm.config, "_name_or_path", "") or hp.get("lm", "?")
            where = f"loaded from {source}"
            if source and _in_cache(Path(source)):
                where += f" (the model cache: delete {source} and it will be converted again)"
            return f"NaN/inf weights in the frozen LM ({found[1]} tensors, first {found[0]}), {where}"
    dtype = hp.get("dtype")
    if dtype in ("float16", "bfloat16"):
        return f"overflow in the LM's low-precision dtype ({dtype}); use --model.dtype float32"
    return "an unstable objective or bad data; try a smaller learning rate"


class NonFiniteGuard(Callback):
    """Raise `NonFiniteError` on the first NaN/inf training loss, logged metric or parameter.

    Args:
        ignore: fnmatch patterns of metric names not to check (NaN by design).
        check_parameters: also check the module's trainable parameters (cheap: the LM is not
            one of them).
    """

    def __init__(self, ignore: list[str] | tuple[str, ...] = ("*/auroc/*",), check_parameters: bool = True):
        self.ignore = list(ignore)
        self.check_parameters = check_parameters
        self._step = 0

    def _fail(self, trainer, pl_module, what: str, value: float | str, when: str) -> None:
        raise NonFiniteError(
            f"{what} is {value} {when}; likely cause: {likely_cause(trainer, pl_module)}. "
            "The run was stopped and nothing was exported."
        )

    def _when(self, trainer, stage: str, step: int | None = None) -> str:
        step = trainer.global_step if step is None else step
        return f"at step {step} (epoch {trainer.current_epoch}, {stage})"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = trainer.global_step  # the step this batch makes (global_step counts it when done)

    def _check_metrics(self, trainer, pl_module, stage: str, prefix: str = "", step: int | None = None) -> None:
        for name, value in list(trainer.callback_metrics.items()):
            if not name.startswith(prefix) or any(fnmatch(name, p) for p in self.ignore):
                continue
            number = _scalar(value)
            if number is not None and not math.isfinite(number):
                self._fail(trainer, pl_module, name, number, self._when(trainer, stage, step))

    def _check_parameters(self, trainer, pl_module, stage: str, step: int | None = None) -> None:
        if not self.check_parameters:
            return
        for name, p in pl_module.named_parameters():
            if p.requires_grad and p.is_floating_point() and not torch.isfinite(p).all():
                self._fail(trainer, pl_module, f"parameter {name}", "nan/inf", self._when(trainer, stage, step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        number = _scalar(loss) if loss is not None else None
        if number is not None and not math.isfinite(number):
            self._fail(trainer, pl_module, "train/loss", number, self._when(trainer, f"batch {batch_idx}", self._step))
        self._check_metrics(trainer, pl_module, f"batch {batch_idx}", prefix="train/", step=self._step)
        self._check_parameters(trainer, pl_module, f"after the optimizer step of batch {batch_idx}", step=self._step)

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self._check_metrics(trainer, pl_module, "validation")
        self._check_parameters(trainer, pl_module, "validation")

    def on_train_end(self, trainer, pl_module):
        self._check_metrics(trainer, pl_module, "end of training")
        self._check_parameters(trainer, pl_module, "end of training")


class SignalGuard(Callback):
    """Raises `Stopped` at the next batch when SIGTERM / SIGINT arrived during the run and its
    first raise was swallowed (by a finalizer, say): a stopped run never trains on."""

    def _check(self) -> None:
        signum = pending_signal()
        if signum is not None:
            raise Stopped(signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._check()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._check()


class DegenerateRunWarning(OneLineWarning):
    """A fit finished with finite numbers that mean nothing (see `DegenerateGuard`)."""


def _trainable(pl_module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in pl_module.named_parameters() if p.requires_grad and p.is_floating_point()}


class DegenerateGuard(Callback):
    """Warn once per finding (`DegenerateRunWarning`, one line naming it and the likely cause):

    - saturated: at a validation before the last training step, a trained mask (a `Tempered`
      module's `weights()`, DBM's σ(m/T)) is all exactly 0 or 1, so its gradient is zero and it no
      longer learns (at the last step a binary mask is what annealing T aims at);
    - collapsed: a trainable parameter that did not start all zero is all zero at a validation
      or when training ends (e.g. a unit-norm dictionary renormalised by an infinite norm);
    - constant: every validation metric (`val/...`, `ignore` patterns skipped) had the same value
      at each of two or more validations although the trainable parameters changed between the
      first and the last.

    Args:
        ignore: fnmatch patterns of metric names left out of the constant check.
    """

    def __init__(self, ignore: list[str] | tuple[str, ...] = ("*/auroc/*",)):
        self.ignore = list(ignore)
        self._zero_at_start: set[str] = set()
        self._validations: list[dict[str, float]] = []
        self._first: dict[str, torch.Tensor] = {}
        self._warned: set[str] = set()

    def _warn(self, trainer, pl_module, key: str, finding: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        cause = (
            bad_learning_rate(trainer, pl_module) or "an unstable objective or bad data; try a smaller learning rate"
        )
        warnings.warn(f"{finding}; likely cause: {cause}", DegenerateRunWarning, stacklevel=2)

    def on_train_start(self, trainer, pl_module):
        self._zero_at_start = {n for n, p in _trainable(pl_module).items() if not p.any()}
        self._validations, self._first, self._warned = [], {}, set()

    def _check_collapsed(self, trainer, pl_module, when: str) -> None:
        for name, p in _trainable(pl_module).items():
            if name not in self._zero_at_start and not p.any():
                self._warn(
                    trainer,
                    pl_module,
                    f"collapsed {name}",
                    f"parameter {name} is all 0 {when}: the intervention does nothing",
                )

    def _check_saturated(self, trainer, pl_module, when: str) -> None:
        for name, module in pl_module.named_modules():
            weights = getattr(module, "weights", None)
            if not (isinstance(module, Tempered) and callable(weights)):
                continue
            w = weights().detach()
            if ((w == 0) | (w == 1)).all() and trainer.global_step < trainer.estimated_stepping_batches:
                finding = f"the mask of {name or 'the module'} is all 0 or 1 {when} (before the last step): it is "
                self._warn(trainer, pl_module, f"saturated {name}", finding + "saturated and no longer learns")

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.state.fn != "fit":  # `validate` has nothing trained
            return
        when = f"at the validation of step {trainer.global_step}"
        self._check_collapsed(trainer, pl_module, when)
        self._check_saturated(trainer, pl_module, when)
        metrics = {}
        for name, value in trainer.callback_metrics.items():
            number = _scalar(value) if name.startswith("val/") else None
            if number is not None and not any(fnmatch(name, p) for p in self.ignore):
                metrics[name] = number
        self._validations.append(metrics)
        if not self._first:
            self._first = {n: p.detach().clone() for n, p in _trainable(pl_module).items()}

    def on_train_end(self, trainer, pl_module):
        self._check_collapsed(trainer, pl_module, "when training ends")
        seen = self._validations
        if len(seen) < 2 or not seen[0] or any(m != seen[0] for m in seen[1:]):
            return
        now = _trainable(pl_module)
        if all(torch.equal(now[n], p) for n, p in self._first.items() if n in now):
            return
        values = ", ".join(f"{n} {v:.6g}" for n, v in sorted(seen[0].items()))
        self._warn(
            trainer,
            pl_module,
            "constant",
            f"every validation metric was the same at all {len(seen)} "
            f"validations ({values}) although the trained parameters changed: the result means nothing",
        )
