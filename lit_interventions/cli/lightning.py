"""`fit` / `validate` / `test`: Lightning's CLI (`InterventionCLI`; `python train.py ...` and
`lit-interventions fit ...` are the same).

What every Lightning run gets here: no Lightning adverts, a run directory named by what it
is (`runs/das/agr_sv_num_pp/layer9/version_0`), line-based progress when stdout is not a terminal,
a final table of the metrics with the run directory, and `test`/`validate --ckpt_path` that use
the checkpoint's own model and data settings and write their results inside the run that wrote
the checkpoint (`RUN/test/`, `RUN/validate/`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import yaml
from jsonargparse import ArgumentError, get_loader, set_loader
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO

from lit_interventions.artifacts.checkpoint_io import AtomicCheckpointIO, read_checkpoint
from lit_interventions.callbacks.dictionary import ExportDictionary
from lit_interventions.callbacks.export import ExportIntervention
from lit_interventions.callbacks.guard import DegenerateGuard, NonFiniteError, NonFiniteGuard, SignalGuard
from lit_interventions.callbacks.progress import LineProgress, RunSummary
from lit_interventions.cli.help import short_help
from lit_interventions.cli.parsing import LINKED, SHARED, fail, first_reason, resolve_configs
from lit_interventions.core.pair_checks import IdenticalPairsError
from lit_interventions.core.quiet import quiet_lightning
from lit_interventions.modules.steering import current_method_config

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test")

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
    if mhp.get("head") is not None:  # the heads of a head component: _h1, _h0+2
        heads = mhp["head"] if isinstance(mhp["head"], (list, tuple)) else [mhp["head"]]
        parts[-1] = f"{parts[-1]}_h{'+'.join(str(h) for h in heads)}"
    return "/".join(part.replace(os.sep, "_") for part in parts) or "lightning_logs"


# ----------------------------------------------------------------------------- checkpoint settings

# may differ from a checkpoint's: how the run reads its data and where the frozen LM is placed
RUNTIME = {
    "eval_batch_size",
    "cache",
    "num_workers",
    "read_batch_size",
    "device_map",
    "quantization",
    "max_memory",
    "offload_folder",
}


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


def _plain(value):
    return value.as_dict() if hasattr(value, "as_dict") else value


def _parameters(class_path: str) -> set[str]:
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}


# ----------------------------------------------------------------------------- fit / validate / test


RUN_CONFIG_MODE = "lit_interventions_yaml"  # YAML, with older runs' method configs read as current ones


def _current_methods(document):
    """A loaded YAML document with an AxBench method config of an older run
    (`model.init_args.method` naming a removed class path, `steering.RUN_CONFIG_METHODS`) replaced
    by the registered method it stands for, and the SteeringModule options it sets; any other
    document as it is."""
    model = document.get("model") if isinstance(document, dict) else None
    init_args = model.get("init_args") if isinstance(model, dict) else None
    method = init_args.get("method") if isinstance(init_args, dict) else None
    if isinstance(method, dict):
        init_args["method"], options = current_method_config(method)
        init_args.update(options)
    return document


set_loader(RUN_CONFIG_MODE, lambda text: _current_methods(get_loader("yaml")(text)), exceptions=(yaml.YAMLError,))


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

    def _set_seed(self) -> None:
        """LightningCLI's seeding without its "Seed set to N" line on stderr (config.yaml records
        the seed), so that bad input found afterwards is the only line there."""
        seed_log = logging.getLogger(seed_everything.__module__)
        level = seed_log.level
        seed_log.setLevel(logging.WARNING)
        try:
            super()._set_seed()
        finally:
            seed_log.setLevel(level)

    def init_parser(self, **kwargs):
        # subcommand parsers too; configs read by `_current_methods`
        return super().init_parser(**kwargs, exit_on_error=False, parser_mode=RUN_CONFIG_MODE)

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
        ckpt = check_checkpoint(ckpt_path)
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
            # scoring a checkpoint: nothing of the checkpoint callback's state matters
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from")

    def instantiate_classes(self):
        """Bad input (unknown task, region, layer, file) is one line on stderr, not a traceback."""
        try:
            super().instantiate_classes()
            check = getattr(self.model, "check_data", None)  # a module that needs something of its data
            if check is not None and self.datamodule is not None:
                check(self.datamodule)
        except (ValueError, FileNotFoundError, ImportError) as err:
            self._release_version()
            fail(first_reason(str(err)))

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            self._release_version()
            raise

    def _release_version(self) -> None:
        """After a run that failed before its first step: the version_N directory it reserved
        (`reserved_version`) removed when it holds nothing but TensorBoard's event files (Lightning's
        logger opens them when it closes), so that no empty run is left behind."""
        reserved = getattr(self, "_reserved", None)
        trainer = getattr(self, "trainer", None)
        if reserved is None or not reserved.is_dir() or getattr(trainer, "global_step", 0):
            return
        if all(p.is_file() and p.name.startswith("events.out.tfevents.") for p in reserved.iterdir()):
            shutil.rmtree(reserved)

    def _refuse_untrained_test(self) -> None:
        """`test` without `--ckpt_path` on a module with parameters to learn would score them as
        initialised, not as trained: one line saying what to pass."""
        if self.subcommand != "test" or self.config["test"].get("ckpt_path"):
            return
        if any(p.requires_grad for p in self.model.parameters()):
            fail(
                "test without --ckpt_path would score the untrained intervention; pass --ckpt_path "
                "runs/<run>/version_N/checkpoints/<file>.ckpt (the run fit wrote), or use validate to score one "
                "that needs no training"
            )

    def _instantiate_trainer(self, config, callbacks):
        self._refuse_untrained_test()  # the model is built, the trainer not yet
        root = config.get("default_root_dir") or os.getcwd()
        writable_directory(root, "--trainer.default_root_dir")
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # checkpoints whole or not at all
            config["plugins"] = [*plugins, AtomicCheckpointIO()]
        if config.get("logger") in (None, True):  # the default TensorBoard logger, named by the run
            ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
            scored = scored_run(self.subcommand, ckpt_path)
            if scored is not None:  # RUN/version_N/test/: beside the run's own events, a run of its own in TensorBoard
                config["logger"] = TensorBoardLogger(
                    scored.parent, name="", version=scored.name, sub_dir=self.subcommand
                )
            else:
                name = run_name(self.model, self.datamodule)
                version = reserved_version(root, name)
                self._reserved = None if version is None else Path(root) / name / f"version_{version}"
                config["logger"] = TensorBoardLogger(save_dir=root, name=name, version=version)
        listed = [*(config.get("callbacks") or []), *callbacks]
        if (
            config.get("enable_progress_bar") is not False
            and not sys.stdout.isatty()
            and not any(isinstance(c, ProgressBar) for c in listed)
        ):
            callbacks.append(LineProgress())
        try:
            return super()._instantiate_trainer(config, callbacks)
        except MisconfigurationException as err:  # a trainer setting Lightning refuses (max_steps -5, ...)
            fail(first_reason(str(err)))


def reserved_version(root: str | os.PathLike, name: str) -> int | None:
    """The next free N of ROOT/NAME/version_N, its directory made here: `mkdir` fails on one that
    another run started at the same moment made first, so two runs on one root never share a
    directory. None in a distributed run's other processes (Lightning gives them rank 0's)."""
    if int(os.environ.get("LOCAL_RANK", 0)) or int(os.environ.get("NODE_RANK", 0)):
        return None
    parent = Path(root) / name
    parent.mkdir(parents=True, exist_ok=True)
    taken = [p.name.removeprefix("version_") for p in parent.glob("version_*") if p.is_dir()]
    version = max((int(n) for n in taken if n.isdigit()), default=-1) + 1
    while True:
        try:
            (parent / f"version_{version}").mkdir()
            return version
        except FileExistsError:
            version += 1


def scored_run(subcommand: str, ckpt_path: str | None) -> Path | None:
    """The run directory `validate`/`test --ckpt_path RUN/checkpoints/FILE.ckpt` writes its
    results into (RUN, when it can be written); None for `fit`, a checkpoint elsewhere or a
    read-only run (a new run directory then)."""
    if subcommand not in ("validate", "test") or not ckpt_path or not Path(ckpt_path).is_file():
        return None
    run = Path(ckpt_path).parent.parent
    return run if Path(ckpt_path).parent.name == "checkpoints" and os.access(run, os.W_OK) else None


def writable_directory(path: str | os.PathLike, option: str) -> None:
    """One error line when `path` is a file, or a directory that cannot be created or written (a
    file is created and removed there: permissions, a read-only file system, ACLs)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        fail(f"{option} {path} is a file, not a directory; pass a directory for the run's outputs")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"{option} {path} cannot be created ({err.strerror or type(err).__name__}); pass a writable directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        fail(f"{option} {path} is not writable ({err.strerror or type(err).__name__}); pass a writable directory")


def trainer_defaults() -> dict:
    """The callbacks every run gets: the guards, the exports and the final summary."""
    guards = [NonFiniteGuard(), DegenerateGuard(), SignalGuard()]
    return {"callbacks": [*guards, ExportIntervention(), ExportDictionary(), RunSummary()]}


def _ckpt_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith("--ckpt_path="):
            return arg.split("=", 1)[1]
        if arg == "--ckpt_path" and i + 1 < len(args):
            return args[i + 1]
    return None


def _checkpoint_config(args: list[str]) -> list[str]:
    """`fit`/`validate`/`test --ckpt_path FILE`: the file checked (`check_checkpoint`) before
    anything loads; without `--config` (or `--model`), the run's saved config.yaml
    (`RUN/config.yaml` beside `RUN/checkpoints/FILE.ckpt`), and one error line saying to pass it
    when there is none."""
    path = _ckpt_path(args) if args[:1] and args[0] in LIGHTNING_SUBCOMMANDS else None
    if not path or path in ("last", "best", "hpc", "registry"):  # Lightning's named checkpoints
        return args
    check_checkpoint(path)
    if any(
        a in ("--config", "-c", "--model") or a.startswith(("--config=", "--model=", "--model.class_path"))
        for a in args
    ):
        return args
    config = run_config(Path(path))
    if config is None:
        fail(
            f"--ckpt_path {path}: a checkpoint needs its run's config, and {Path(path).parent.parent / 'config.yaml'} "
            "(where a run keeps it: RUN/config.yaml beside RUN/checkpoints/) does not exist; pass "
            "--config RUN/config.yaml of the run that wrote the checkpoint"
        )
    foreign = foreign_class_paths(config)
    if foreign:
        fail(
            f"--ckpt_path {path}: its run's {config} names class_path {foreign[0]!r}, outside lit_interventions "
            f"and Lightning, so it was not used (importing it runs its code); if you trust it, pass --config {config}"
        )
    return [args[0], "--config", str(config), *args[1:]]


TRUSTED_PACKAGES = ("lit_interventions.", "lightning.")  # class paths a run's config.yaml may name unasked


def foreign_class_paths(config: Path) -> list[str]:
    """The dotted `class_path` values in `config` (a YAML file, read as data) outside
    `TRUSTED_PACKAGES`: what a config picked up beside a checkpoint, not given by the user, would
    make LightningCLI import. A short class name (no dot) names a class already imported."""
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        fail(f"{config} is not a readable YAML config ({type(err).__name__}); pass --config with a valid one")
    found, todo = [], [data]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            path = value.get("class_path")
            if isinstance(path, str) and "." in path and not path.startswith(TRUSTED_PACKAGES):
                found.append(path)
            todo += list(value.values())
        elif isinstance(value, list):
            todo += value
    return sorted(found)


def run_config(ckpt: Path) -> Path | None:
    """The config.yaml of the run that wrote `ckpt`: `RUN/checkpoints/FILE.ckpt` -> `RUN/config.yaml`
    (or beside the checkpoint); None when there is none."""
    for candidate in (ckpt.parent.parent / "config.yaml", ckpt.parent / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


def check_checkpoint(path: str) -> dict:
    """The checkpoint `--ckpt_path` names (tensors memory-mapped), or one error line naming it:
    missing, truncated, damaged, or a pickle that names code to run (refused; nothing in it runs)."""
    try:
        return read_checkpoint(path, mmap=True)
    except (ValueError, FileNotFoundError) as err:
        fail(f"--ckpt_path {err}")


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
    except IdenticalPairsError as err:  # found when the data is set up, before the LM loads: bad input
        fail(str(err))
