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
"""

from __future__ import annotations

import math
from fnmatch import fnmatch
from pathlib import Path

import torch
from lightning import Callback

from lit_interventions.core.lm import cache_dir
from lit_interventions.core.signals import Stopped, pending_signal

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


def likely_cause(trainer, pl_module) -> str:
    """The most probable reason a run went non-finite, in words (checked in this order: the
    learning rate, the frozen LM's weights, the dtype)."""
    hp = getattr(pl_module, "hparams", {}) or {}
    lrs = [hp.get("lr")] if "lr" in hp else []  # as configured; then as scheduled now
    lrs += [g.get("lr") for opt in (getattr(trainer, "optimizers", None) or []) for g in opt.param_groups]
    for lr in lrs:
        if isinstance(lr, (int, float)) and (not math.isfinite(lr) or abs(lr) > HUGE_LR):
            return f"a bad learning rate (lr={lr}); use a finite lr such as 1e-3"
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
