"""A fit resumed from a mid-epoch checkpoint (`fit --ckpt_path`) equals an uninterrupted one: the
same final weights (bit for bit) and validation metric, and no "not resumable" warning."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import train
from lit_interventions.core.loaders import ResumableLoader, split_loader
from tests.helpers import run_command

ROOT = Path(__file__).resolve().parents[1]
NOT_RESUMABLE = "not resumable"
# 24 training examples in batches of 4: 6 steps an epoch, validation after steps 3 and 6 of each
SMALL = [
    "--model.layer=1",
    "--data.train_pairs=12",
    "--data.eval_pairs=4",
    "--trainer.val_check_interval=0.5",
    "--trainer.enable_progress_bar=false",
    "--trainer.accelerator=cpu",
]
EVERY_STEP = [  # a checkpoint after every training step, as a run killed at any step would have left
    "--trainer.callbacks+=ModelCheckpoint",
    "--trainer.callbacks.every_n_train_steps=1",
    "--trainer.callbacks.save_top_k=-1",
    "--trainer.callbacks.filename={step}",
]
AFTER_VALIDATION = [  # Lightning's default checkpoint: after every validation (here after steps 3, 6, 9, 12)
    "--trainer.callbacks+=ModelCheckpoint",
    "--trainer.callbacks.save_top_k=-1",
    "--trainer.callbacks.filename=val-{step}",
]


def _args(lm_dir: str, root: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/das.yaml", f"--model.lm={lm_dir}", f"--trainer.default_root_dir={root}"] + [
        *SMALL,
        *extra,
    ]


def _fit(lm_dir: str, root: Path, *extra: str):
    cli = train.main(args=_args(lm_dir, root, *extra))
    return cli.model.intervention.basis.detach().clone(), cli.trainer.callback_metrics["val/odds"].item(), cli


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_lm_dir):
    """Two epochs, uninterrupted, with a checkpoint after every step."""
    root = tmp_path_factory.mktemp("whole")
    basis, odds, cli = _fit(tiny_lm_dir("gpt2"), root, "--trainer.max_epochs=2", *EVERY_STEP, *AFTER_VALIDATION)
    return basis, odds, Path(cli.trainer.log_dir) / "checkpoints"


@pytest.mark.parametrize(
    "name",
    [
        "step=4",  # mid epoch 0, between validations
        "step=8",  # mid epoch 1
        "val-step=3",  # mid epoch 0, after its validation
        "val-step=6",  # the end of epoch 0, after its validation
    ],
)
def test_a_fit_resumed_from_any_step_equals_the_uninterrupted_one(whole, tmp_path, tiny_lm_dir, name, recwarn):
    basis, odds, checkpoints = whole
    resumed, resumed_odds, _ = _fit(
        tiny_lm_dir("gpt2"), tmp_path, "--trainer.max_epochs=2", f"--ckpt_path={checkpoints / f'{name}.ckpt'}"
    )
    assert torch.equal(resumed, basis), (resumed - basis).abs().max().item()
    assert resumed_odds == odds
    assert not [w for w in recwarn if NOT_RESUMABLE in str(w.message)]


def test_the_console_script_resumes_a_killed_fit_exactly(tmp_path, tiny_lm_dir):
    """`python -m lit_interventions fit` as a user runs it: a checkpoint of step 2 of 6 (the
    process could have been killed right after it), resumed with --ckpt_path, gives the
    uninterrupted run's direction and val/odds, without Lightning's "not resumable" warning."""
    lm = tiny_lm_dir("gpt2")

    def run(root: Path, *extra: str) -> subprocess.CompletedProcess:
        done = run_command(*_args(lm, root, *extra), env={"PYTHONPATH": str(ROOT)}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run(tmp_path / "whole", *EVERY_STEP)
    whole_dir = tmp_path / "whole" / "agr_sv_num_pp" / "layer1" / "version_0"
    done = run(tmp_path / "resumed", f"--ckpt_path={whole_dir / 'checkpoints' / 'step=2.ckpt'}")
    assert NOT_RESUMABLE not in done.stderr
    resumed_dir = tmp_path / "resumed" / "agr_sv_num_pp" / "layer1" / "version_0"
    whole_basis = load_file(whole_dir / "intervention.safetensors")["basis"]
    assert torch.equal(load_file(resumed_dir / "intervention.safetensors")["basis"], whole_basis)
    odds = [(d / "config.json").read_text() for d in (whole_dir, resumed_dir)]
    assert '"val/odds"' in odds[0] and odds[0].split('"val/odds"')[1][:40] == odds[1].split('"val/odds"')[1][:40]


# --- the loader -------------------------------------------------------------------------------


def _passes(loader, n: int) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(n)]


@pytest.mark.parametrize("seed", [None, 3])
def test_the_shuffled_order_of_every_pass_is_torchs(seed):
    """The order of each pass is the one a plain shuffled DataLoader gives (from torch's global
    generator, or from the seeded one): uninterrupted runs keep their batches."""
    torch.manual_seed(5)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    plain = _passes(DataLoader(range(11), batch_size=3, shuffle=True, generator=generator), 3)
    torch.manual_seed(5)
    ours = _passes(split_loader(range(11), 3, None, shuffle=True, seed=seed), 3)
    assert ours == plain and plain[0] != plain[1]


@pytest.mark.parametrize("seed", [None, 3])
def test_a_loader_resumed_mid_pass_gives_the_rest_of_that_pass_then_the_next_ones(seed):
    torch.manual_seed(5)
    whole = ResumableLoader(split_loader(range(11), 3, None, shuffle=True, seed=seed), lambda: 2, exact=True)
    first = iter(whole)
    used = [next(first).tolist() for _ in range(2)]
    state = whole.state_dict()  # saved after two batches of the first pass
    rest = [batch.tolist() for batch in first]
    later = _passes(whole, 2)
    torch.manual_seed(99)  # another process: the global generator holds something else
    resumed = ResumableLoader(split_loader(range(11), 3, None, shuffle=True, seed=seed), lambda: 0, exact=True)
    resumed.load_state_dict(state)
    assert state["batches"] == 2 and _passes(resumed, 3) == [rest, *later]
    assert len(used + rest) == 4


def test_a_fit_killed_with_sigkill_resumes_from_its_last_checkpoint_exactly(tmp_path, tiny_lm_dir):
    """`kill -9` mid-epoch, as a crash or an out-of-memory kill does: every checkpoint the killed
    run left is whole (written to a temporary file and renamed), and `fit --ckpt_path` from the
    newest gives the uninterrupted run's direction bit for bit."""
    import signal
    import sys
    import time

    lm, longer = tiny_lm_dir("gpt2"), ["--data.train_pairs=40"]  # 20 steps an epoch: time to kill
    command = [sys.executable, "-m", "lit_interventions", *_args(lm, tmp_path / "killed", *longer, *EVERY_STEP)]
    checkpoints = tmp_path / "killed" / "agr_sv_num_pp" / "layer1" / "version_0" / "checkpoints"
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "step=3.ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
    finally:
        assert process.wait(timeout=60) == -signal.SIGKILL  # killed mid-epoch, not finished
    left = sorted(checkpoints.iterdir(), key=lambda p: p.stat().st_mtime)
    assert left and all(p.suffix == ".ckpt" or p.name.startswith(".") for p in left)
    steps = [p for p in left if p.suffix == ".ckpt"]
    for path in steps:  # whole files: each one loads
        torch.load(path, map_location="cpu", weights_only=True)
    newest = max(steps, key=lambda p: int(p.stem.removeprefix("step=")))
    assert 3 <= int(newest.stem.removeprefix("step=")) < 20
    for root, extra in ((tmp_path / "whole", []), (tmp_path / "resumed", [f"--ckpt_path={newest}"])):
        done = run_command(*_args(lm, root, *longer, *extra), env={"PYTHONPATH": str(ROOT)}, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    bases = [
        load_file(root / "agr_sv_num_pp" / "layer1" / "version_0" / "intervention.safetensors")["basis"]
        for root in (tmp_path / "whole", tmp_path / "resumed")
    ]
    assert torch.equal(bases[0], bases[1]), (bases[0] - bases[1]).abs().max().item()
