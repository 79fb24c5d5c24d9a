"""The short `--help` of `fit` / `validate` / `test`: the options most runs change (`--help-all`
lists every Trainer option)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

from lit_interventions.cli.parsing import LINKED, PROG, fail

COMMON_TRAINER = {
    "max_epochs": (int, "epochs to train"),
    "accelerator": (str, "cpu, gpu, auto, ..."),
    "devices": (str, "how many devices (or which)"),
    "strategy": (str, "e.g. ddp"),
    "default_root_dir": (str, "runs are written under it: <dir>/<task>/layer<N>/version_<i>"),
    "log_every_n_steps": (int, "train/loss is logged every this many steps"),
    "val_check_interval": (float, "validate every this share of an epoch"),
    "precision": (str, "e.g. 32-true, bf16-mixed"),
    "enable_progress_bar": (bool, "false: no progress output"),
}


def _config_section(args: list[str], key: str) -> str | None:
    """The class_path of `key` (model or data) from `--config` or `--key CLASS` in `args`."""
    import yaml

    class_path = None
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
        name = arg.split("=", 1)[0]
        if name in ("--config", "-c") and value and Path(value).is_file():
            section = (yaml.safe_load(Path(value).read_text()) or {}).get(key)
            if isinstance(section, dict) and section.get("class_path"):
                class_path = section["class_path"]
        elif name in (f"--{key}", f"--{key}.class_path") and value:
            class_path = value
    return class_path


def _config_values(args: list[str], key: str) -> dict:
    """The `init_args` of `key` (or the `trainer` section, or {"seed_everything": value}) in the
    `--config` files of `args`."""
    import yaml

    values = {}
    for i, arg in enumerate(args):
        name, value = (
            (arg.split("=", 1) + [None])[:2] if "=" in arg else (arg, args[i + 1] if i + 1 < len(args) else None)
        )
        if name in ("--config", "-c") and value and Path(value).is_file():
            section = (yaml.safe_load(Path(value).read_text()) or {}).get(key)
            if key == "seed_everything" and section is not None:  # a top-level value, not a section
                values[key] = section
            elif isinstance(section, dict):
                values.update(section.get("init_args", section) if key != "trainer" else section)
    return {k: v for k, v in values.items() if k != "class_path"}


def short_help(args: list[str]) -> None:
    """The options most runs change: the chosen model's and data module's init args (with their
    docs), the common Trainer options and the subcommand's own; `--help-all` lists everything."""
    subcommand = args[0]
    parser = ArgumentParser(
        prog=f"{PROG} {subcommand}",
        default_config_files=[],
        description=f"{subcommand}: common options (--help-all: every Trainer option)",
    )
    parser.add_argument(
        "-c", "--config", action=ActionConfigFile, help="a YAML config, e.g. configs/das.yaml (or das.yaml)"
    )
    if subcommand != "fit":
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="a checkpoint: its model and data settings are used (a conflicting option is an error)",
        )
    else:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="resume training from this checkpoint")
    seed = _config_values(args, "seed_everything").get("seed_everything", True)  # a config's seed, as shown
    parser.add_argument("--seed_everything", type=int | bool, default=seed, help="the seed (true: a random one)")
    notes = []
    for key in ("model", "data"):
        class_path = _config_section(args, key)
        if class_path is None:
            notes.append(f"--{key} CLASS_PATH (or --config FILE) lists the {key}'s options")
            continue
        try:
            module, _, name = class_path.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            fail(f"--{key}: cannot import {class_path!r}")
        skip = set(LINKED[key])  # set by links, not by the user
        parser.add_class_arguments(cls, key, skip=skip, sub_configs=True, help=f"{class_path} (--{key}.NAME VALUE)")
        for name, value in _config_values(args, key).items():  # the config's values as the defaults shown
            if name not in skip and not isinstance(value, dict):
                try:
                    parser.set_defaults({f"{key}.{name}": value})
                except (KeyError, ArgumentError, TypeError, ValueError):
                    pass
    group = parser.add_argument_group("Trainer (common; --help-all for all)")
    trainer = _config_values(args, "trainer")
    for name, (kind, text) in COMMON_TRAINER.items():
        group.add_argument(f"--trainer.{name}", type=kind | None, default=trainer.get(name), help=text)
    if notes:
        parser.epilog = "; ".join(notes)
    text = re.sub(r",\s+known\s+subclasses:[^)]*\)", ")", parser.format_help())  # long lists of torch classes
    print(text, end="")
    raise SystemExit(0)
