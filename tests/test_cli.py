"""The `lit-interventions` command: every subcommand's help and error style, a tiny-model fit and its
checkpoint evaluated with the checkpoint's settings, the run directory's name, the final summary,
line progress when stdout is a file, no Lightning adverts, configs by short name, the short help."""

import logging
import os
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from lit_interventions.cli.commands import COMMANDS, TRAIN, main, resolve, run
from lit_interventions.cli.parsing import find_config
from lit_interventions.core.quiet import quiet_lightning
from tests.helpers import run_command

ROOT = Path(__file__).resolve().parents[1]

HELP = {  # subcommand line -> options its help must name
    ("fit", "--config", "das.yaml"): [
        "--model.layer",
        "--model.k",
        "--data.task",
        "--trainer.max_epochs",
        "--help-all",
    ],
    ("validate", "--config", "configs/das.yaml"): ["--ckpt_path", "--model.layer", "--data.eval_pairs"],
    ("test", "--config", "ravel/mdas.yaml"): ["--ckpt_path", "--model.objective", "--data.target_attribute"],
    ("sweep",): ["causalgym", "ravel"],
    ("sweep", "causalgym"): ["--tasks", "--methods", "--layers", "--out", "--batch_size"],
    ("sweep", "ravel", "--config", "sweep_ravel.yaml"): ["--attributes", "--methods", "--out"],
    ("calm",): ["--properties", "--layer", "--probe", "--epsilon"],
    ("steer",): ["--artifact", "--dictionary", "--checkpoint", "--factors", "--judge"],
    ("syntaxgym",): ["--suites", "--lm", "--out", "--batch_size", "--threads"],
    ("serve-judge",): ["--lm", "--host", "--port", "--max_new_tokens", "--max_body_bytes", "--timeout"],
    ("data",): ["name", "--out", "--base_url", "axbench-concept10"],
    ("concepts",): ["--concepts", "--prompts", "--out", "--per_concept", "--lm", "--base_url", "--api_key_env"],
    (): ["fit", "validate", "test", "sweep", "calm", "steer", "syntaxgym", "serve-judge", "data", "concepts"],
}


@pytest.mark.parametrize("line", list(HELP), ids=lambda line: " ".join(line) or "top")
def test_help_exits_0_and_names_the_key_options(line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*line, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in HELP[line]:
        assert option in out, (line, option)


def test_short_help_lists_the_modules_options_with_their_docs(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "das.yaml", "--help"])
    short = capsys.readouterr().out
    assert "residual stream after this decoder block" in short  # InterchangeModule's docs
    assert "task name in the template file" in short  # CausalGymDataModule's docs
    assert "default: 9" in short  # the config's value, not the class default
    assert "--trainer.gradient_clip_val" not in short and len(short.splitlines()) < 200
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "das.yaml", "--help-all"])
    assert exit_info.value.code == 0
    assert "--trainer.gradient_clip_val" in capsys.readouterr().out  # LightningCLI's full help


BAD = {  # a bad value for each subcommand -> part of its one-line error
    ("fit", "--config", "das.yaml", "--trainer.max_epochs", "many"): "max_epochs",
    ("validate", "--config", "das.yaml", "--model.k", "one"): "k",
    ("test", "--config", "das.yaml", "--data.eval_pairs", "x"): "eval_pairs",
    ("sweep", "causalgym", "--config", "sweep_causalgym.yaml", "--batch_size", "big"): "batch_size",
    ("sweep", "ravel", "--config", "sweep_ravel.yaml", "--train_size", "many"): "train_size",
    ("sweep", "tabular"): "invalid choice: 'tabular'",
    ("calm", "--layer", "nine"): "layer",
    ("steer", "--instructions", "ten"): "instructions",
    ("syntaxgym", "--suites", "x", "--out", "o.csv", "--batch_size", "0"): "--batch_size=0 must be a positive integer",
    ("serve-judge", "--port", "http"): "port",
    ("serve-judge", "--port", "70000"): "--port=70000 is not a port",
    ("serve-judge", "--timeout", "0"): "--timeout=0.0 must be > 0 seconds",
    ("data", "ravle", "--out", "x"): "unknown dataset 'ravle'",
    ("train",): "invalid choice: 'train'",
}


@pytest.mark.parametrize("line", list(BAD), ids=lambda line: " ".join(line))
def test_bad_value_is_one_error_line_with_exit_2(line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(list(line))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and BAD[line] in err[0], err


def test_configs_are_found_by_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the checkout: found under the package's checkout
    assert Path(find_config("das.yaml")) == ROOT / "configs" / "das.yaml"
    assert Path(find_config("ravel/mdas.yaml")) == ROOT / "configs" / "ravel" / "mdas.yaml"
    assert find_config("nope.yaml") == "nope.yaml"  # left as given: the parser reports it
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "das.yaml").write_text("model: {}\n")
    assert Path(find_config("das.yaml")).resolve() == (tmp_path / "configs" / "das.yaml").resolve()  # ./configs first


def test_leafspec_deprecation_is_filtered():
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        _tree_flatten(torch.zeros(2))
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


def test_lightning_lines_about_absent_accelerators_are_dropped_and_a_present_ones_kept(caplog):
    """Lightning logs its accelerator lines through its rank-zero logger; with `quiet_lightning`
    those naming an absent GPU/TPU/HPU (they read as a fault on a CPU machine) do not appear."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    quiet_lightning()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        for line in ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores"):
            rank_zero_info(line)
        rank_zero_info("GPU available: True (cuda), used: True")
        rank_zero_info("Restoring states from the checkpoint path at x.ckpt")
    assert [r.getMessage() for r in caplog.records] == [
        "GPU available: True (cuda), used: True",
        "Restoring states from the checkpoint path at x.ckpt",
    ]


# ----------------------------------------------------------------------------- a tiny-model run

TASK, REGION = "npi_any_subj-relc", "det"  # not das.yaml's task: test/validate must take it from the checkpoint
SMALL = ["--model.layer=1", "--data.train_pairs=12", "--data.eval_pairs=4", "--trainer.val_check_interval=1.0"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_lm_dir):
    """`lit-interventions fit --config das.yaml` with overrides; stdout as pytest captures it."""
    root = tmp_path_factory.mktemp("cli_fit")
    lm = tiny_lm_dir("gpt_neox")
    args = [
        "fit",
        "--config",
        "das.yaml",
        f"--model.lm={lm}",
        f"--trainer.default_root_dir={root}",
        *SMALL,
        f"--data.task={TASK}",
        f"--model.region={REGION}",
        "--trainer.enable_progress_bar=false",
    ]
    cli = run(args)
    (checkpoint,) = Path(cli.trainer.log_dir).glob("checkpoints/*.ckpt")
    return cli, Path(cli.trainer.log_dir), checkpoint, lm


def test_fit_names_its_run_directory_by_task_and_layer(fitted):
    cli, log_dir, _, _ = fitted
    assert log_dir.parts[-3:] == (TASK, "layer1", "version_0")
    assert (log_dir / "intervention.safetensors").is_file() and (log_dir / "config.yaml").is_file()
    assert list(log_dir.glob("events.out.tfevents.*"))


def _summary(out: str, log_dir: Path) -> list[str]:
    """The metric lines of the final summary (between its title and `files in`)."""
    lines = out.strip().splitlines()
    assert lines[-1] == f"files in {log_dir}", lines[-1]
    start = max(i for i, line in enumerate(lines) if line.endswith("metrics"))
    return lines[start + 1 : -1]


@pytest.mark.parametrize("subcommand,split", [("test", "test"), ("validate", "val")])
def test_checkpoint_settings_are_used_and_the_summary_printed(fitted, tmp_path, capsys, subcommand, split):
    """`--config das.yaml --ckpt_path` (das.yaml names another task and no region) scores the
    checkpoint's task and region; the summary is sorted and aligned, with the run directory."""
    cli, _, checkpoint, lm = fitted
    capsys.readouterr()
    tested = run(
        [
            subcommand,
            "--config",
            "das.yaml",
            f"--ckpt_path={checkpoint}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert tested.datamodule.hparams.task == TASK and tested.model.hparams.region == REGION
    assert tested.model.hparams.lm == lm and tested.datamodule.hparams.train_pairs == 12
    torch.testing.assert_close(tested.model.intervention.basis, cli.model.intervention.basis.detach())
    metrics = _summary(capsys.readouterr().out, Path(tested.trainer.log_dir))
    names = [line.split()[0] for line in metrics]
    assert names == sorted(names) and f"{split}/odds" in names
    assert len({line.rindex(" ") for line in metrics}) == 1  # values in one column
    value = float(next(line for line in metrics if line.startswith(f"{split}/odds ")).split()[-1])
    assert value == pytest.approx(tested.trainer.callback_metrics[f"{split}/odds"].item(), abs=1e-4)


def test_ckpt_path_alone_reads_the_runs_config(fitted, tmp_path):
    _, _, checkpoint, _ = fitted
    tested = run(
        [
            "test",
            f"--ckpt_path={checkpoint}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert tested.datamodule.hparams.task == TASK and "test/odds" in tested.trainer.callback_metrics


def test_an_option_that_contradicts_the_checkpoint_is_an_error(fitted, tmp_path, capsys):
    _, _, checkpoint, lm = fitted
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "test",
                "--config",
                "das.yaml",
                f"--ckpt_path={checkpoint}",
                "--model.k",
                "4",
                "--data.task=agr_gender",
                f"--model.lm={lm}",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
    assert exit_info.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "--model.k is 4 but the checkpoint has 1" in err
    assert f"--data.task is 'agr_gender' but the checkpoint has '{TASK}'" in err
    assert "--model.lm" not in err  # the same value: no conflict


def test_train_py_to_a_file_prints_progress_lines_and_no_adverts(tmp_path, tiny_lm_dir):
    """`python train.py fit ... > log.txt`: progress as lines, the summary at the end, no Lightning
    tips and no LeafSpec warning."""
    log = tmp_path / "log.txt"
    args = [
        sys.executable,
        "train.py",
        "fit",
        "--config",
        "das.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        *SMALL,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.accelerator=cpu",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.PIPE, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = log.read_text()
    steps = [line for line in text.splitlines() if line.startswith("epoch 0 step ")]
    assert steps and steps[-1].startswith("epoch 0 step 6/6") and "train/loss" in steps[-1], text
    assert any(line.startswith("epoch 0 validation") and "val/odds" in line for line in text.splitlines())
    assert "\r" not in text and text.strip().splitlines()[-1] == f"files in {tmp_path}/agr_sv_num_pp/layer1/version_0"
    assert "💡" not in text + done.stderr and "LeafSpec" not in done.stderr


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the TensorBoard event files in `directory` (not below it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_console_script_test_and_validate_write_inside_the_run_they_score(tmp_path, tiny_lm_dir):
    """`train.py fit`, then `test` and `validate --ckpt_path RUN/checkpoints/X.ckpt`: their events,
    config and hparams go to RUN/test/ and RUN/validate/ (a run of their own in TensorBoard, nested
    in the run), no version_1 appears beside the run, and the run's own files are unchanged."""
    fit = run_command(
        "train.py", "fit", "--config", "das.yaml", f"--model.lm={tiny_lm_dir('gpt2')}", *SMALL,
        f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    run_dir = tmp_path / "agr_sv_num_pp" / "layer1" / "version_0"
    (checkpoint,) = (run_dir / "checkpoints").glob("*.ckpt")
    fitted = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    for subcommand, split in (("test", "test"), ("validate", "val")):
        done = run_command(
            "train.py", subcommand, "--ckpt_path", str(checkpoint), "--trainer.enable_progress_bar=false"
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout.strip().splitlines()
        assert out[-1] == f"files in {run_dir / subcommand}"
        shown = {line.split()[0]: float(line.split()[1]) for line in out[out.index(f"{subcommand}: metrics") + 1 : -1]}
        scored = run_dir / subcommand
        assert sorted(p.name.split(".")[0] for p in scored.iterdir()) == ["config", "events", "hparams"]
        logged = _scalars(scored)
        assert sorted(logged) == sorted([*shown, "epoch", "hp_metric"]) and f"{split}/odds" in shown
        for tag, value in shown.items():
            assert logged[tag] == [(0, pytest.approx(value, abs=5e-5))], tag
        assert yaml.safe_load((scored / "config.yaml").read_text())["ckpt_path"] == str(checkpoint)
    assert [p.name for p in run_dir.parent.iterdir()] == ["version_0"]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == fitted
    assert "train/loss" in _scalars(run_dir)  # the fit's own events stay the run's


def _option_help(text: str, option: str) -> str:
    """The help of `option` in a --help text, on one line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{option} "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 8)), len(lines))
    return " ".join(line.strip() for line in lines[start:end])


@pytest.mark.parametrize(
    "args,shown",
    [
        (("train.py", "fit", "--config", "das.yaml"), "0"),  # das.yaml: seed_everything: 0
        (("fit",), "True"),  # no config: Lightning's default, a random seed
        (("test", "--config", "configs/das.yaml"), "0"),
    ],
)
def test_console_script_help_shows_the_configs_seed(args, shown):
    done = run_command(*args, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _option_help(done.stdout, "--seed_everything") == (
        f"--seed_everything SEED_EVERYTHING the seed (true: a random one) (type: int | bool, default: {shown})"
    )


def test_the_console_script_is_declared():
    import importlib

    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["lit-interventions"].partition(":")
    assert getattr(importlib.import_module(module), name) is main


def test_a_missing_or_damaged_checkpoint_is_one_line(tmp_path, capsys):
    for path, words in (
        (tmp_path / "none.ckpt", "no such checkpoint file"),
        (tmp_path / "bad.ckpt", "is not a readable Lightning checkpoint"),
    ):
        if path.name == "bad.ckpt":
            path.write_bytes(b"PK\x03\x04 truncated")
        with pytest.raises(SystemExit) as exit_info:
            main(["test", "--config", "das.yaml", "--ckpt_path", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err == f"error: --ckpt_path {path}: {words}\n" or (
            err.startswith(f"error: --ckpt_path {path} {words}") and len(err.splitlines()) == 1
        )


# ----------------------------------------------------------------------------- exit status, as a user runs it


def _console_script() -> str:
    found = shutil.which("lit-interventions", path=str(Path(sys.executable).parent)) or shutil.which(
        "lit-interventions"
    )
    assert found, "the console script is not installed: pip install -e ."
    return found


def _console(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_console_script(), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


@pytest.mark.parametrize("name", list(COMMANDS))
def test_main_returns_0_whatever_the_command_returns(name, monkeypatch):
    """The console script's status is 0 after a successful command: `sys.exit(main())` must not
    see the LightningCLI object (or a study's rows) a command returns, which exits 1."""
    calls = []
    stub = types.ModuleType("stub_command")
    stub.main = lambda rest: calls.append(rest) or object()
    monkeypatch.setitem(sys.modules, "stub_command", stub)
    monkeypatch.setitem(COMMANDS, name, ("stub_command:main", "stub"))
    assert main([*name.split(), "--x", "1"]) == 0 and calls == [["--x", "1"]]


def test_every_command_names_an_importable_function_and_a_bad_target_is_refused():
    """The table holds "module:function" strings; each resolves (imported only when it runs)."""
    for name, (target, text) in COMMANDS.items():
        assert isinstance(target, str) and ":" in target and text, name
        assert callable(resolve(target)), name
    assert {name for name, (target, _) in COMMANDS.items() if target == TRAIN} == {"fit", "validate", "test"}
    for bad in ("lit_interventions.studies.calm", "lit_interventions.studies.calm:nothing_here", ":main"):
        with pytest.raises(ValueError, match="command target"):
            resolve(bad)


def _modules_after(*argv: str) -> tuple[int, set[str]]:
    """(exit status, the project's and torch's modules imported) of `main(argv)` in a fresh interpreter."""
    code = (
        "import sys\nfrom lit_interventions.cli.commands import main\n"
        f"try:\n    status = main({list(argv)!r})\nexcept SystemExit as exit:\n    status = exit.code\n"
        "print(status)\nprint(' '.join(m for m in sys.modules if m.startswith(('lit_interventions', 'torch'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    status, modules = done.stdout.strip().splitlines()[-2:]
    return int(status), set(modules.split())


def test_help_imports_only_what_the_command_needs():
    status, modules = _modules_after("--help")
    assert status == 0 and not any(m.startswith(("torch", "lit_interventions.studies")) for m in modules), modules
    status, modules = _modules_after("data", "--help")
    assert status == 0 and "lit_interventions.cli.data" in modules
    assert not any(m.startswith(("lit_interventions.studies", "lit_interventions.cli.lightning")) for m in modules)


def test_console_script_fit_exits_0_and_bad_input_2(tmp_path, tiny_lm_dir):
    """`lit-interventions fit` in a subprocess: 0 after a successful fit (with its summary), 2 with
    one error line on a bad value, and 2 for a command it does not know or a bare group."""
    done = _console(
        "fit",
        "--config",
        "das.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        *SMALL,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"files in {tmp_path}/agr_sv_num_pp/layer1/version_0"
    for line, words in (
        (("fit", "--config", "das.yaml", "--trainer.max_epochs", "many"), "max_epochs"),
        (("sweep", "tabular"), "invalid choice: 'tabular'"),
        (("train",), "invalid choice: 'train'"),
    ):
        bad = _console(*line)
        assert bad.returncode == 2, (line, bad.stderr[-2000:])
        (err,) = bad.stderr.strip().splitlines()
        assert err.startswith("error: ") and words in err
    bare = _console("sweep")
    assert bare.returncode == 2 and "causalgym" in bare.stdout and "ravel" in bare.stdout


@pytest.mark.parametrize(
    "content,words",
    [
        (b"", "the file is empty"),
        (b"- model\n- data\n", "holds a YAML list, not a mapping"),
        (b"model: [\n", "not valid YAML at line 2, column 1"),
        (b"model:\n  lm: caf\xe9\n", "not UTF-8 text (byte 16)"),
    ],
)
@pytest.mark.parametrize("command", ["fit", "sweep causalgym", "calm"])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, content, words, command):
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--config", str(config)])
    assert exit_info.value.code == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"error: --config {config}: {words}"), err


def test_a_trainer_setting_lightning_refuses_and_a_file_as_run_directory_are_one_line(tmp_path, tiny_lm_dir, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    lm = tiny_lm_dir("gpt2")
    for extra, words in (
        (["--trainer.max_steps", "-5"], "`max_steps` must be a non-negative integer or -1"),
        ([f"--trainer.default_root_dir={afile}"], f"--trainer.default_root_dir {afile} is a file, not a directory"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "fit",
                    "--config",
                    "das.yaml",
                    f"--model.lm={lm}",
                    *SMALL,
                    f"--trainer.default_root_dir={tmp_path}",
                    *extra,
                ]
            )
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and words in err, err
    assert afile.read_text() == "not a directory"


def test_console_script_test_without_a_checkpoint_refuses_an_untrained_intervention(tmp_path, tiny_lm_dir):
    """`test` without --ckpt_path on DAS (parameters to learn) would score a random rotation: exit
    2 with one line saying what to pass, before any run directory is written."""
    done = _console(
        "test",
        "--config",
        "das.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        *SMALL,
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "GPU available" not in done.stderr  # before the trainer
    err = done.stderr.strip().splitlines()[-1]
    assert err.startswith("error: test without --ckpt_path would score the untrained intervention") and (
        "--ckpt_path" in err.split(";")[1]
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_console_script_help_exits_0_for_every_command(name):
    done = _console(*name.split(), "--help", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: ") and done.stderr == "", done.stderr[-2000:]
