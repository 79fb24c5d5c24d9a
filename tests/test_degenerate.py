"""Runs whose every number is finite but whose result means nothing: a warning (`DegenerateGuard`)
or a refusal before any model loads (identical pairs); each planted, and a sound run beside it
that gets neither."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from lit_interventions.datamodules.causalgym import CausalGymDataModule

import train
from lit_interventions.callbacks.guard import DegenerateRunWarning
from lit_interventions.core.pair_checks import IdenticalPairsError, refuse_identical_pairs
from tests.helpers import run_command

CAUSALGYM = [  # 24 training examples in batches of 4: 6 steps, validations after steps 3 and 6
    "--model.layer=1",
    "--data.train_pairs=12",
    "--data.eval_pairs=4",
    "--trainer.val_check_interval=0.5",
]
AXBENCH = ["--model.layer=1", "--data.concepts=[0, 5]", "--data.max_length=96", "--trainer.max_epochs=1"]
HUGE_LR = "likely cause: a bad learning rate (lr=1e+30); use a finite lr such as 1e-3"


def _fit(lm_dir: str, root: Path, config: str, *extra: str) -> list[str]:
    """The DegenerateRunWarning messages of one `train.py fit`."""
    args = ["fit", "--config", config, f"--model.lm={lm_dir}", f"--trainer.default_root_dir={root}"]
    args += ["--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu", *extra]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.main(args=args)
    return [str(w.message) for w in caught if issubclass(w.category, DegenerateRunWarning)]


def test_a_dbm_mask_saturated_by_a_huge_lr_warns_and_a_sound_one_does_not(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("gpt2")
    found = _fit(lm, tmp_path / "huge", "configs/dbm.yaml", *CAUSALGYM, "--model.lr=1e30")
    assert found[0] == (
        "the mask of intervention is all 0 or 1 at the validation of step 3 (before the last step): it is "
        f"saturated and no longer learns; {HUGE_LR}"
    )
    assert found[1].startswith("every validation metric was the same at all 2 validations (val/iia 0.5, val/loss ")
    assert found[1].endswith(f"although the trained parameters changed: the result means nothing; {HUGE_LR}")
    assert len(found) == 2
    # a sound run: without the sparsity term some dimensions pass ½ within these 6 steps, so the
    # hard mask of evaluation swaps them and the metrics move
    sound = ["--model.lr=0.01", "--model.objective.init_args.sparsity=0.0"]
    assert _fit(lm, tmp_path / "sound", "configs/dbm.yaml", *CAUSALGYM, *sound) == []


def test_a_dictionary_collapsed_to_zero_warns_and_a_sound_one_does_not(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    found = _fit(lm, tmp_path / "huge", "configs/reft_r1.yaml", *AXBENCH, "--model.lr=1e30")
    assert found == [
        f"parameter dictionary.weight is all 0 at the validation of step 13: the intervention does nothing; {HUGE_LR}"
    ]
    assert _fit(lm, tmp_path / "sound", "configs/reft_r1.yaml", *AXBENCH, "--model.lr=0.01") == []


# --- identical pairs ----------------------------------------------------------------------------

SAME = {  # the label variable has the same word for both types: base and source sentences are equal
    "same": {
        "templates": ["The {noun} {verb} the {obj}"],
        "label": "noun",
        "labels": {"sg": ["was"], "pl": ["were"]},
        "variables": {
            "noun": {"sg": ["dog"], "pl": ["dog"]},
            "verb": ["saw", "liked", "found"],
            "obj": ["tree", "car", "ball", "house", "road", "cat", "bird", "door"],
        },
    }
}


def _templates(tmp_path: Path, plural: str) -> str:
    spec = json.loads(json.dumps(SAME))
    spec["same"]["variables"]["noun"]["pl"] = [plural]
    path = tmp_path / f"{plural}.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_a_split_of_identical_pairs_is_refused_when_set_up(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("gpt2")
    data = CausalGymDataModule(task="same", templates=_templates(tmp_path, "dog"), lm=lm, train_pairs=12, eval_pairs=4)
    with pytest.raises(IdenticalPairsError) as raised:
        data.setup()
    message = str(raised.value)
    assert message.startswith("every train pair of task 'same' has the same tokens as base and source (e.g. 'The dog ")
    assert message.endswith(
        "make the base and source sentences differ (in a templates file: the label variable's options per type)"
    )
    sound = CausalGymDataModule(
        task="same", templates=_templates(tmp_path, "dogs"), lm=lm, train_pairs=12, eval_pairs=4
    )
    sound.setup()  # one word apart: accepted
    assert len(sound.splits["train"]) == 24


def test_the_check_refuses_only_when_every_pair_is_identical():
    class Example:
        def __init__(self, base, source):
            self.base_ids, self.source_ids = base, source

    refuse_identical_pairs([], "train", "nothing")  # nothing to check
    refuse_identical_pairs([Example([1, 2], [1, 2]), Example([1, 2], [1, 3])], "train", "x")  # one differs
    with pytest.raises(IdenticalPairsError, match=r"^every dev pair of x has the same tokens as base and source: "):
        refuse_identical_pairs([Example([1, 2], [1, 2]), Example([4], [4])], "dev", "x")


def test_the_console_script_refuses_identical_pairs_in_one_line(tmp_path, tiny_lm_dir):
    done = run_command(
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        "--data.task=same",
        f"--data.templates={_templates(tmp_path, 'dog')}",
        *["--model.layer=1", "--data.train_pairs=12", "--data.eval_pairs=4", f"--trainer.default_root_dir={tmp_path}"],
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: every train pair of task 'same' has the same tokens as base and source")
    assert "Traceback" not in done.stderr and not list(tmp_path.rglob("*.ckpt"))
    assert not list(tmp_path.rglob("version_*"))  # the run's reserved directory is not left behind empty


def test_the_console_script_shows_the_warning_as_one_line(tmp_path, tiny_lm_dir):
    """A saturated DBM run, as a user runs it: exit 0 (the run finished), each finding on one
    `warning:` line of stderr, with no file name, line number or source line around it."""
    done = run_command(
        "fit",
        "--config",
        "configs/dbm.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        *CAUSALGYM,
        "--model.lr=1e30",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "saturated" in line or "means nothing" in line]
    assert len(lines) == 2 and all(line.startswith("warning: ") for line in lines), done.stderr[-3000:]
    assert lines[0].endswith(f"saturated and no longer learns; {HUGE_LR}")
    assert "DegenerateRunWarning" not in done.stderr
