"""The `lit-interventions` command: one console script, one parser style (jsonargparse), one error
style (a single `error: ...` line on stderr, exit code 2) for every job this package runs.

    lit-interventions fit|validate|test --config configs/das.yaml [--model.layer 6 ...]
    lit-interventions sweep       --config configs/sweep_causalgym.yaml | configs/sweep_ravel.yaml
    lit-interventions calm        --config configs/calm_ravel.yaml
    lit-interventions steer       --config configs/steer_eval.yaml --checkpoint DIR
    lit-interventions syntaxgym   --suites DIR --out FILE
    lit-interventions serve-judge --lm smollm2-135m-instruct --port 8000

`fit`/`validate`/`test` are Lightning's CLI (`InterventionCLI` below; `python train.py ...` is the
same). What every Lightning run gets here: no Lightning adverts, a run directory named by what it
is (`runs/das/agr_sv_num_pp/layer9/version_0`), line-based progress when stdout is not a terminal,
a final table of the metrics with the run directory, and `test`/`validate --ckpt_path` that use
the checkpoint's own model and data settings.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path

import torch
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from lit_interventions.callbacks.guard import NonFiniteError, NonFiniteGuard

ROOT = Path(__file__).resolve().parents[1]
PROG = "lit-interventions"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test")

# ----------------------------------------------------------------------------- quiet runs


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


# ----------------------------------------------------------------------------- configs by short name


def find_config(path: str) -> str:
    """`das.yaml` -> `configs/das.yaml` (and `ravel/mdas.yaml` -> `configs/ravel/mdas.yaml`) when
    the path does not exist as given: under ./configs, then under this checkout's configs/."""
    if Path(path).exists():
        return path
    for base in (Path.cwd() / "configs", ROOT / "configs"):
        for candidate in (base / path, base / f"{path}.yaml"):
            if candidate.is_file():
                return str(candidate)
    return path


def resolve_configs(args: list[str] | None) -> list[str]:
    """`args` with every `--config` value passed through `find_config`."""
    args = list(sys.argv[1:] if args is None else args)
    out = []
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            arg = "--config=" + find_config(arg.split("=", 1)[1])
        elif i and args[i - 1] in ("--config", "-c"):
            arg = find_config(arg)
        out.append(arg)
    return out


# ----------------------------------------------------------------------------- errors


def first_reason(message: str) -> str:
    """The first specific reason in a jsonargparse error, with the option it is about and the
    value given: `--trainer.max_epochs: Expected a <class 'int'>; got many`."""
    reason = _first_reason(message)
    outer = re.match(r'Parser key "([^"]+)":', message.strip())
    inner = re.search(r'Parser key "([^"]+)":\s*(.*)', reason)
    key = None
    if inner:
        key = f"{outer.group(1)}.{inner.group(1)}" if outer else inner.group(1)
        reason = inner.group(2)
    elif outer:
        key = outer.group(1)
    given = re.search(r"^\s*Given value: (.*)$", message, re.M)
    if given and "Got value" not in reason and not re.match(r"(NestedArg|Namespace)\(", given.group(1)):
        reason += f"; got {given.group(1)}"
    return f"--{key}: {reason}" if key else reason


def _first_reason(message: str) -> str:
    """The first reason in a jsonargparse error (it lists one per type it tried, and the detail of
    a reason on the lines indented below it)."""
    lines = message.strip().splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith("- ") and not text.startswith("- Expected a <class 'NoneType'>"):
            indent = len(line) - len(line.lstrip())
            detail = [d.strip() for d in lines[i + 1 :] if len(d) - len(d.lstrip()) > indent + 2]
            stop = next((j for j, d in enumerate(lines[i + 1 :]) if len(d) - len(d.lstrip()) <= indent + 2), len(detail))
            return " ".join([text[2:], *detail[:stop]])
    return " ".join(line.strip() for line in lines[:2])


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(ArgumentParser):
    """jsonargparse's parser with errors as one `error: ...` line on stderr (exit code 2)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            super().error(message, ex)  # raises
        fail(first_reason(message))


# ----------------------------------------------------------------------------- callbacks every run gets


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
    return "\n".join(f"{name:<{width}}  {value:.4f}" if math.isfinite(value) else f"{name:<{width}}  {value}"
                     for name, value in metrics.items())  # fmt: skip


def _shown(path: str | Path) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class RunSummary(Callback):
    """At the end of fit, validate and test, rank 0 prints the last value of every logged metric
    (sorted, aligned) and the run directory."""

    def _report(self, trainer, what: str) -> None:
        directory = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        print(f"\n{what} metrics\n{metrics_table(_scalars(trainer.callback_metrics))}\nfiles in {_shown(directory)}",
              flush=True)  # fmt: skip

    def on_fit_end(self, trainer, pl_module):
        self._report(trainer, "fit: final")

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._report(trainer, "validate:")

    def on_test_end(self, trainer, pl_module):
        self._report(trainer, "test:")


class LineProgress(ProgressBar):
    """Progress as plain lines (flushed), for stdout that is not a terminal (`> log.txt`): one line
    every `every` training steps (default: about 20 lines an epoch) and one per validation."""

    def __init__(self, every: int | None = None):
        super().__init__()
        self.every = every
        self._enabled = True

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
        return "  ".join(f"{k} {float(v):.4f}" for k, v in sorted(metrics.items())
                         if k.startswith(prefix) and isinstance(v, (int, float)))  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        total = self.total_train_batches
        every = self.every or (max(1, int(total) // 20) if math.isfinite(total) else 50)
        done = batch_idx + 1
        if done % every == 0 or done == total:
            shown = int(total) if math.isfinite(total) else "?"
            self._print(f"epoch {trainer.current_epoch} step {done}/{shown}  {self._values(trainer, pl_module, 'train')}")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._print(f"epoch {trainer.current_epoch} validation  {self._values(trainer, pl_module, 'val')}")

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self._print("validating")

    def on_test_start(self, trainer, pl_module):
        self._print("testing")


# ----------------------------------------------------------------------------- run names


def run_name(model, data) -> str:
    """A logger name from what the run is: the task (CausalGym), target attribute (RAVEL),
    concepts (AxBench) or entity type (SAE activations), then the layer: `agr_sv_num_pp/layer9`."""
    mhp = dict(getattr(model, "hparams", {}) or {})
    dhp = dict(getattr(data, "hparams", {}) or {}) if data is not None else {}
    parts = []
    if dhp.get("task"):
        parts.append(str(dhp["task"]))
    elif dhp.get("target_attribute"):
        parts.append(str(dhp["target_attribute"]))
    elif "concepts" in dhp:
        concepts = dhp["concepts"]
        parts.append("concepts_all" if concepts is None else "concept" + "+".join(str(c) for c in concepts))
    elif dhp.get("entity_type"):
        parts.append(str(dhp["entity_type"]))
    layer = mhp.get("layer", dhp.get("layer"))
    sites = getattr(model, "sites", None) or []  # composed sites (InterchangeModule)
    layers = mhp.get("layers") or [site.layer for site in sites]
    if sites:
        layer = None  # composed sites: every layer is named
    if isinstance(layer, int):
        parts.append(f"layer{layer}")
    elif isinstance(layers, (list, tuple)) and layers:
        parts.append("layers" + "+".join(str(x) for x in layers))
    if mhp.get("component") not in (None, "block_output"):
        parts[-1:] = [f"{parts[-1]}_{mhp['component']}"] if parts else [mhp["component"]]
    return "/".join(part.replace(os.sep, "_") for part in parts) or "lightning_logs"


# ----------------------------------------------------------------------------- checkpoint settings

SHARED = ("lm", "region", "multitask")  # model init args the data module also takes
RUNTIME = {"eval_batch_size", "cache", "num_workers", "read_batch_size"}  # may differ from a checkpoint's


def given_options(args: list[str]) -> dict[str, set[str]]:
    """The `--model.X` / `--data.X` names given on the command line (`init_args.` skipped)."""
    given = {"model": set(), "data": set()}
    for arg in args:
        if not isinstance(arg, str) or not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0].split(".")
        if key[0] in given and len(key) > 1:
            name = key[2] if key[1] == "init_args" and len(key) > 2 else key[1]
            if name not in ("class_path", "init_args", "dict_kwargs"):
                given[key[0]].add(name)
    return given


def _hidden_size(data):
    return getattr(data, "hidden_size", None)


LINKED = {"model": {"hidden_size"}, "data": set(SHARED)}  # link targets: never parsed from a checkpoint


def _plain(value):
    return value.as_dict() if hasattr(value, "as_dict") else value


def _parameters(class_path: str) -> set[str]:
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}


# ----------------------------------------------------------------------------- fit / validate / test


class InterventionCLI(LightningCLI):
    """LightningCLI with `--model.lm` (and `region`, `multitask`) shared by the data module, bad
    input as one `error:` line, and the run conveniences in this module's docstring."""

    def __init__(self, *args, **kwargs):
        quiet_lightning()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser):
        for name in SHARED:  # a link whose target class lacks the argument is skipped
            parser.link_arguments(f"model.init_args.{name}", f"data.init_args.{name}")
        # a model sized by its data (the SAE: the LM's hidden size, known once the data module is built)
        parser.link_arguments("data", "model.init_args.hidden_size", compute_fn=_hidden_size, apply_on="instantiate")

    def init_parser(self, **kwargs):
        return super().init_parser(**kwargs, exit_on_error=False)  # subcommand parsers too

    def parse_arguments(self, parser, args):
        """A bad value found while parsing (the data module validates its task when the parser
        checks the class) is one line on stderr, as in `instantiate_classes`."""
        self._given = list(args) if isinstance(args, (list, tuple)) else list(sys.argv[1:] if args is None else [])
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            fail(first_reason(str(err)))

    def _parse_ckpt_path(self) -> None:
        """`validate`/`test --ckpt_path`: the model's AND the data module's settings come from the
        checkpoint (a config file's values are replaced); an option given on the command line that
        differs from the checkpoint's value is an error naming both."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
        given = given_options(self._given)
        update, conflicts = {}, []
        for key, section in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
            saved = dict(ckpt.get(section) or {})
            saved.pop("_instantiator", None)
            current = self.config[subcommand].get(key)
            class_path = saved.pop("_class_path", None) or (current.get("class_path") if current is not None else None)
            if not saved or not class_path:
                continue
            known = _parameters(class_path)
            init_args = {}
            for name, value in saved.items():
                if name not in known or name in LINKED[key]:
                    continue  # link targets come from the model
                if name in given[key]:
                    here = _plain(self.config[subcommand].get(f"{key}.init_args.{name}"))
                    if name in RUNTIME:
                        continue  # the command line's value is used
                    if here != value:
                        conflicts.append(f"--{key}.{name} is {here!r} but the checkpoint has {value!r}")
                init_args[name] = value
            update[key] = {"class_path": class_path, "init_args": init_args}
        if conflicts:
            fail(f"{'; '.join(conflicts)} ({ckpt_path}); drop the option to use the checkpoint's value")
        if update:
            try:
                self.config = self.parser.parse_object({subcommand: update}, self.config)
            except ArgumentError as err:
                fail(f"the settings saved in {ckpt_path} do not parse: {first_reason(str(err))}")

    def before_instantiate_classes(self):
        if self.subcommand in ("validate", "test"):
            if not any(a.startswith("--verbose") for a in self._given):
                self.config[self.subcommand]["verbose"] = False  # RunSummary prints the metrics
            # scoring a checkpoint in a new run directory: nothing of the checkpoint callback's state matters
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from")

    def instantiate_classes(self):
        """Bad input (unknown task, region, layer, file) is one line on stderr, not a traceback."""
        try:
            super().instantiate_classes()
            check = getattr(self.model, "check_data", None)  # a module that needs something of its data
            if check is not None and self.datamodule is not None:
                check(self.datamodule)
        except (ValueError, FileNotFoundError, ImportError) as err:
            fail(first_reason(str(err)))

    def _instantiate_trainer(self, config, callbacks):
        if config.get("logger") in (None, True):  # the default TensorBoard logger, named by the run
            root = config.get("default_root_dir") or os.getcwd()
            config["logger"] = TensorBoardLogger(save_dir=root, name=run_name(self.model, self.datamodule))
        listed = [*(config.get("callbacks") or []), *callbacks]
        if (config.get("enable_progress_bar") is not False and not sys.stdout.isatty()
                and not any(isinstance(c, ProgressBar) for c in listed)):  # fmt: skip
            callbacks.append(LineProgress())
        return super()._instantiate_trainer(config, callbacks)


def trainer_defaults() -> dict:
    from lit_interventions.callbacks.dictionary import ExportDictionary
    from lit_interventions.callbacks.export import ExportIntervention

    return {"callbacks": [NonFiniteGuard(), ExportIntervention(), ExportDictionary(), RunSummary()]}


def _checkpoint_config(args: list[str]) -> list[str]:
    """`validate`/`test --ckpt_path FILE` without `--config`: the run's saved config.yaml."""
    if args[:1] and args[0] in ("validate", "test") and not any(a in ("--config", "-c") or a.startswith("--config=") for a in args):
        for i, arg in enumerate(args):
            path = arg.split("=", 1)[1] if arg.startswith("--ckpt_path=") else (args[i + 1] if arg == "--ckpt_path" and i + 1 < len(args) else None)
            if path and (Path(path).parent.parent / "config.yaml").is_file():
                return [args[0], "--config", str(Path(path).parent.parent / "config.yaml"), *args[1:]]
    return args


def train_main(args=None, run: bool = True):
    """fit / validate / test (`python train.py ...`, `lit-interventions fit ...`)."""
    quiet_lightning()
    args = _checkpoint_config(resolve_configs(args))
    if args[:1] and args[0] in LIGHTNING_SUBCOMMANDS and any(a in ("-h", "--help") for a in args):
        short_help(args)  # exits
    args = ["--help" if a == "--help-all" else a for a in args]
    try:
        return InterventionCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults=trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )
    except NonFiniteError as err:  # the guard stopped the run: one line, a failing exit, nothing exported
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


# ----------------------------------------------------------------------------- short help

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
    """The `init_args` of `key` (or the `trainer` section) in the `--config` files of `args`."""
    import yaml

    values = {}
    for i, arg in enumerate(args):
        name, value = (arg.split("=", 1) + [None])[:2] if "=" in arg else (arg, args[i + 1] if i + 1 < len(args) else None)
        if name in ("--config", "-c") and value and Path(value).is_file():
            section = (yaml.safe_load(Path(value).read_text()) or {}).get(key) or {}
            if isinstance(section, dict):
                values.update(section.get("init_args", section) if key != "trainer" else section)
    return {k: v for k, v in values.items() if k != "class_path"}


def short_help(args: list[str]) -> None:
    """The options most runs change: the chosen model's and data module's init args (with their
    docs), the common Trainer options and the subcommand's own; `--help-all` lists everything."""
    subcommand = args[0]
    parser = ArgumentParser(prog=f"{PROG} {subcommand}", default_config_files=[],
                            description=f"{subcommand}: common options (--help-all: every Trainer option)")  # fmt: skip
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="a YAML config, e.g. configs/das.yaml (or das.yaml)")
    if subcommand != "fit":
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="a checkpoint: its model and data settings are used (a conflicting option is an error)")  # fmt: skip
    else:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="resume training from this checkpoint")
    parser.add_argument("--seed_everything", type=int | bool, default=True, help="the seed (true: a random one)")
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
        parser.add_class_arguments(cls, key, skip=skip, sub_configs=True,
                                   help=f"{class_path} (--{key}.NAME VALUE)")  # fmt: skip
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


# ----------------------------------------------------------------------------- the console script

COMMANDS = {
    "fit": "train a module (LightningCLI; --config configs/das.yaml)",
    "validate": "score the dev split (--ckpt_path: the checkpoint's settings)",
    "test": "score the eval split (--ckpt_path: the checkpoint's settings)",
    "sweep": "CausalGym or RAVEL sweep, by the config's `benchmark:` key",
    "calm": "CALM on RAVEL",
    "steer": "AxBench steering evaluation",
    "syntaxgym": "SyntaxGym accuracy of a frozen LM",
    "serve-judge": "serve a local chat model as an OpenAI-style judge",
}


def serve_judge(args=None) -> None:
    """`serve-judge`: parsed here (jsonargparse), run by `judge_server.main`."""
    parser = Parser(prog=f"{PROG} serve-judge", default_config_files=[],
                            description="Serve a chat LM behind an OpenAI-style /v1/chat/completions endpoint.")  # fmt: skip
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--lm", type=str, default="smollm2-135m-instruct", help="the chat model (what load_lm accepts)")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="tokens generated per answer at most")
    parser.add_argument("--dtype", type=str, default="float32", help="float32, bfloat16 or float16")
    ns = parser.parse_args(resolve_configs(args))
    if ns.port < 0 or ns.port > 65535:
        parser.error(f"--port={ns.port} is not a port (0..65535)")
    if ns.max_new_tokens < 1:
        parser.error(f"--max_new_tokens={ns.max_new_tokens} must be a positive integer")
    from lit_interventions import judge_server
    from lit_interventions.lm import DTYPES

    if ns.dtype not in DTYPES:
        parser.error(f"--dtype={ns.dtype!r}; choose one of {', '.join(sorted(DTYPES))}")
    judge_server.main(["--lm", ns.lm, "--host", ns.host, "--port", str(ns.port),
                       "--max_new_tokens", str(ns.max_new_tokens), "--dtype", ns.dtype])  # fmt: skip


def _top_parser() -> ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0], default_config_files=[])
    subcommands = parser.add_subcommands(required=True, dest="command")
    for name, text in COMMANDS.items():
        subcommands.add_subcommand(name, Parser(description=text), help=text)
    return parser


def main(argv: list[str] | None = None):
    """`lit-interventions COMMAND ...`: each command's own parser gets the rest of the line."""
    quiet_lightning()
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv and argv[0] in COMMANDS else (None, argv)
    if command is None:  # help, or an unknown command: the top parser says so
        if not argv:
            _top_parser().print_help()
            raise SystemExit(2)
        _top_parser().parse_args(argv)
        raise SystemExit(2)
    if command in LIGHTNING_SUBCOMMANDS:
        return train_main([command, *rest])
    program, sys.argv[0] = sys.argv[0], f"{PROG} {command}"  # the usage line names the command
    try:
        return _study(command, rest)
    finally:
        sys.argv[0] = program


def _study(command: str, rest: list[str]):
    if command == "sweep":
        from lit_interventions.sweep import main as sweep_main

        return sweep_main(rest)
    if command == "calm":
        from lit_interventions.calm import main as calm_main

        return calm_main(rest)
    if command == "steer":
        from lit_interventions.steer_eval import main as steer_main

        return steer_main(rest)
    if command == "syntaxgym":
        from lit_interventions.syntaxgym import main as syntaxgym_main

        return syntaxgym_main(rest)
    return serve_judge(rest)


if __name__ == "__main__":
    main()
