"""The `lit-interventions` command: one entry-point table, `COMMANDS` ({command: ("module:function",
help)}), one parser style (jsonargparse) and one error style (a single `error: ...` line on stderr,
exit code 2) for every job this package runs.

    lit-interventions fit|validate|test   --config configs/das.yaml [--model.layer 6 ...]
    lit-interventions sweep causalgym     --config configs/sweep_causalgym.yaml
    lit-interventions sweep ravel         --config configs/sweep_ravel.yaml
    lit-interventions calm                --config configs/calm_ravel.yaml
    lit-interventions steer               --config configs/steer_eval.yaml --checkpoint DIR
    lit-interventions syntaxgym           --suites DIR --out FILE
    lit-interventions serve-judge         --lm smollm2-135m-instruct --port 8000
    lit-interventions generate            --artifact DIR_OR_HUB_ID --prompt TEXT [--concept C --factor F]
    lit-interventions serve               --artifact DIR_OR_HUB_ID [--lm NAME] --port 8000
    lit-interventions export              --artifact DIR_OR_HUB_ID --to FORMAT --out DIR
    lit-interventions data                NAME --out DIR
    lit-interventions concepts            --concepts FILE --out DIR [--prompts FILE] [--lm NAME | --base_url URL --model NAME]

`python -m lit_interventions ...` is the same command (torchrun runs it with `-m lit_interventions`).
Every command exits 0 when it succeeds, 2 on bad input, 143 / 130 when stopped by SIGTERM /
SIGINT (`lit_interventions.core.signals`; the servers, whose normal stop that is, 0), and non-zero
on any other failure.

The table names each command's function as `"module:function"`, the form of a console_scripts
entry point; the function is imported (`resolve`) only when its command runs, so `--help` of the
table imports no study, and a command imports only what it needs. Each function takes the rest of
the command line; `fit`/`validate`/`test` are LightningCLI (`lit_interventions.cli.lightning`,
the same as `python train.py ...`), which takes the stage as its first argument; the studies are in
`lit_interventions.studies`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from lit_interventions.cli.parsing import PROG, Parser, fail
from lit_interventions.core.extras import MissingExtra
from lit_interventions.core.quiet import quiet_lightning
from lit_interventions.core.signals import stop_on_signals

__all__ = ["COMMANDS", "TRAIN", "main", "resolve", "run"]

TRAIN = "lit_interventions.cli.lightning:train_main"  # fit / validate / test: LightningCLI, given the stage

COMMANDS: dict[str, tuple[str, str]] = {
    "fit": (TRAIN, "train a module (LightningCLI; --config configs/das.yaml)"),
    "validate": (TRAIN, "score the dev split (--ckpt_path: the checkpoint's settings)"),
    "test": (TRAIN, "score the eval split (--ckpt_path: the checkpoint's settings)"),
    "sweep causalgym": (
        "lit_interventions.studies.causalgym_sweep:main",
        "every method at every layer x region of CausalGym tasks",
    ),
    "sweep ravel": ("lit_interventions.studies.ravel_sweep:main", "every method at every layer of RAVEL attributes"),
    "calm": ("lit_interventions.studies.calm:main", "CALM on RAVEL"),
    "steer": ("lit_interventions.studies.steer:main", "AxBench steering evaluation"),
    "syntaxgym": ("lit_interventions.studies.syntaxgym.cli:main", "SyntaxGym accuracy of a frozen LM"),
    "serve-judge": ("lit_interventions.serving.judge_server:main", "serve a local chat model as an OpenAI-style judge"),
    "generate": (
        "lit_interventions.inference.cli:generate_main",
        "generate with a trained artifact applied, beside the unsteered continuation",
    ),
    "serve": (
        "lit_interventions.serving.steered_server:main",
        "serve an LM with artifacts applied: OpenAI-compatible chat and text completions",
    ),
    "export": (
        "lit_interventions.export.cli:main",
        "write an artifact in another tool's format (peft, gguf-control-vector, pyvene, lm-eval)",
    ),
    "data": (
        "lit_interventions.cli.data:main",
        "download a published dataset (CausalGym, SyntaxGym, RAVEL, AxBench), sha256-checked",
    ),
    "concepts": (
        "lit_interventions.cli.concepts:main",
        "write AxBench-style concept data for a list of concepts with a generator chat model",
    ),
}


def resolve(target: str) -> Callable[[list[str]], object]:
    """The function a table entry names, `"package.module:function"`, imported now. A command
    whose optional packages are not installed (`core.extras.MissingExtra`) is one `error:` line
    naming the extra to install, exit code 2."""
    module, _, name = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not module or not name:
        raise ValueError(f"command target {target!r} must be 'package.module:function'")
    try:
        imported = importlib.import_module(module)
    except MissingExtra as error:
        fail(str(error))
    function = getattr(imported, name, None)
    if not callable(function):
        raise ValueError(f"command target {target!r}: {module} has no function {name!r}")
    return function


def _group(words: list[str]) -> dict[str, str]:
    """The commands under `words` ({next word: help}): the top level, or a group such as `sweep`."""
    n = len(words)
    return {
        name.split()[n]: text
        for name, (_, text) in COMMANDS.items()
        if name.split()[:n] == words and len(name.split()) > n
    }


def _parser(words: list[str]) -> Parser:
    prog = " ".join([PROG, *words])
    description = __doc__.split("\n\n")[0] if not words else f"{prog}: choose one"
    parser = Parser(prog=prog, description=description, default_config_files=[])
    subcommands = parser.add_subcommands(required=True, dest="command")
    for name, text in _group(words).items():
        subcommands.add_subcommand(name, Parser(description=text), help=text)
    return parser


def _command(argv: list[str]) -> str | None:
    """The longest command of the table that `argv` starts with."""
    for n in (2, 1):
        name = " ".join(argv[:n])
        if len(argv) >= n and name in COMMANDS:
            return name
    return None


def run(argv: list[str] | None = None):
    """Run `lit-interventions ARGV`; returns what the command returned (the LightningCLI of a fit,
    a study's rows). Help exits 0; bad input is one `error:` line and exit 2 (SystemExit)."""
    quiet_lightning()
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command(argv)
    if name is None:  # help, an unknown command, or a group without its member (`sweep`)
        words = argv[:1] if argv and _group(argv[:1]) else []
        rest = argv[len(words) :]
        if not rest:
            _parser(words).print_help()
            raise SystemExit(2)
        _parser(words).parse_args(rest)
        raise SystemExit(2)
    target, _ = COMMANDS[name]
    rest = argv[len(name.split()) :]
    function = resolve(target)
    if target == TRAIN:  # LightningCLI names the stage in its usage line itself
        return function([name, *rest])
    program, sys.argv[0] = sys.argv[0], f"{PROG} {name}"  # the usage line names the command
    try:
        return function(rest)
    finally:
        sys.argv[0] = program


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 once the command has succeeded (what it returned is not an exit
    status); help exits 0, bad input 2, and any other failure non-zero."""
    with stop_on_signals():
        run(argv)
    return 0
