"""What a first fit prints, run as a user runs it (`python train.py fit ...` in a subprocess, its
output a pipe): a fit in closed form says what it fits and on how many tokens or states, its step
lines say there is no loss, and Lightning's warnings for a fit with no optimizer are not shown;
the same warning from a module that is not fitted in closed form still is."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

from lit_interventions.datamodules.axbench import AxBenchDataModule

from lit_interventions.callbacks.progress import RunSummary, fitted_in_closed_form
from lit_interventions.interventions.additive import ReFTR1Dictionary
from lit_interventions.interventions.directions import DiffMeanDirection
from lit_interventions.interventions.fitted import DirectionInterchange
from lit_interventions.interventions.rotation import FullSubspaceSwap, RotatedSpaceIntervention
from tests.helpers import run_command

NO_OPTIMIZER = "`LightningModule.configure_optimizers` returned `None`, this fit will run with no optimizer"
NO_STEP = "`training_step` returned `None`"


def _response_tokens(lm: str) -> tuple[int, int]:
    """(positive, negative) response tokens of the train split of diffmean.yaml's data with
    concepts 0 and 1, counted from the batches' masks: a positive's tokens of its concept, every
    response token of a negative."""
    data = AxBenchDataModule(lm=lm, concepts=[0, 1], max_length=256, batch_size=8, eval_batch_size=16)
    data.setup("fit")
    positive = negative = 0
    for batch in data.train_dataloader():
        text = batch["output_mask"].bool()
        positive += int((text & (batch["token_labels"] >= 0)).sum())
        negative += int((text & (batch["label"] == 0)[:, None]).sum())
    return positive, negative


def test_an_axbench_closed_form_fit_says_what_it_fits_and_no_optimizer_warning(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    done = run_command(
        "train.py",
        "fit",
        "--config",
        "configs/diffmean.yaml",
        f"--model.lm={lm}",
        "--model.layer=1",
        "--data.concepts=[0,1]",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    positive, negative = _response_tokens(lm)
    assert positive > 0 and negative > 0
    line = f"fitting diffmean in closed form on {positive} response tokens of 2 concepts and {negative} negative tokens"
    assert done.stdout.splitlines().count(line) == 1, done.stdout
    steps = [s for s in done.stdout.splitlines() if s.startswith("epoch 0 step ")]
    assert steps and all(re.fullmatch(r"epoch 0 step \d+/\d+  closed form, no loss", s) for s in steps), steps
    assert NO_OPTIMIZER not in done.stderr + done.stdout and "no optimizer" not in done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("files in ")


def test_a_causalgym_closed_form_fit_says_what_it_fits_and_no_optimizer_warning(tmp_path, tiny_lm_dir):
    done = run_command(
        "train.py",
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={tiny_lm_dir('llama')}",
        "--model.layer=1",
        "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
        "--model.intervention.method=diffmean",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 12 train pairs, swap-doubled: 24 bases, 12 of each of the task's 2 sentence types
    assert done.stdout.splitlines().count("diffmean: a 1-dimensional subspace") == 1, done.stdout  # what it fitted
    assert re.search(r"^epoch 0 step 6/6  closed form, no loss$", done.stdout, re.M), done.stdout
    assert NO_OPTIMIZER not in done.stderr and NO_STEP not in done.stderr, done.stderr


def test_the_no_optimizer_warning_is_hidden_only_during_a_closed_form_fit():
    # what is fitted in closed form: a direction estimator, a Fitted intervention; not a trained one
    assert fitted_in_closed_form(SimpleNamespace(method=DiffMeanDirection()))
    assert fitted_in_closed_form(SimpleNamespace(intervention=DirectionInterchange(8)))
    assert not fitted_in_closed_form(SimpleNamespace(method=ReFTR1Dictionary()))
    assert not fitted_in_closed_form(SimpleNamespace(intervention=RotatedSpaceIntervention(8)))
    assert not fitted_in_closed_form(SimpleNamespace(intervention=FullSubspaceSwap(8)))  # fixed: nothing to fit

    summary = RunSummary()
    closed, trained = SimpleNamespace(method=DiffMeanDirection()), SimpleNamespace(method=ReFTR1Dictionary())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary.setup(None, trained, "fit")
        warnings.warn(NO_OPTIMIZER, stacklevel=1)  # 1: shown
        summary.teardown(None, trained, "fit")
        summary.setup(None, closed, "validate")
        warnings.warn(NO_OPTIMIZER, stacklevel=1)  # 2: shown (not a fit)
        summary.setup(None, closed, "fit")
        warnings.warn(NO_OPTIMIZER, stacklevel=1)  # hidden
        warnings.warn(NO_STEP + ". If this was on purpose, ignore this warning...", stacklevel=1)  # hidden
        warnings.warn("another warning", stacklevel=1)  # 3: shown
        summary.on_exception(None, closed, RuntimeError())
        warnings.warn(NO_OPTIMIZER, stacklevel=1)  # 4: shown again after the fit
    assert [str(w.message) for w in seen] == [NO_OPTIMIZER, NO_OPTIMIZER, "another warning", NO_OPTIMIZER]
