"""The `lit-interventions` command: one entry-point table, `COMMANDS` ({command: (function, help)}),
one parser style (jsonargparse) and one error style (a single `error: ...` line on stderr, exit
code 2) for every job this package runs.

    lit-interventions fit|validate|test   --config configs/das.yaml [--model.layer 6 ...]
    lit-interventions sweep causalgym     --config configs/sweep_causalgym.yaml
    lit-interventions sweep ravel         --config configs/sweep_ravel.yaml
    lit-interventions calm                --config configs/calm_ravel.yaml
    lit-interventions steer               --config configs/steer_eval.yaml --checkpoint DIR
    lit-interventions syntaxgym           --suites DIR --out FILE
    lit-interventions serve-judge         --lm smollm2-135m-instruct --port 8000
    lit-interventions data                NAME --out DIR

`python -m lit_interventions ...` is the same command (torchrun runs it with `-m lit_interventions`).
Every command exits 0 when it succeeds, 2 on bad input, and non-zero on any other failure. Each
function takes the rest of the command line; `fit`/`validate`/`test` live in
`lit_interventions.cli.lightning` (`python train.py ...` is the same), the studies in
`lit_interventions.studies`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

from jsonargparse import ArgumentParser

from lit_interventions.callbacks.progress import LineProgress, RunSummary, metrics_table
from lit_interventions.cli import data
from lit_interventions.cli.help import COMMON_TRAINER, short_help
from lit_interventions.cli.lightning import (
    LIGHTNING_SUBCOMMANDS,
    RUNTIME,
    InterventionCLI,
    given_options,
    run_name,
    train_main,
    trainer_defaults,
)
from lit_interventions.cli.parsing import (
    LINKED,
    PROG,
    ROOT,
    SHARED,
    Parser,
    fail,
    find_config,
    first_reason,
    resolve_configs,
)
from lit_interventions.core.quiet import quiet_lightning
from lit_interventions.serving import judge_server
from lit_interventions.studies import calm, causalgym_sweep, ravel_sweep, steer_eval, syntaxgym

__all__ = [  # re-exported: the names tests and train.py import from here
    "COMMANDS",
    "COMMON_TRAINER",
    "LIGHTNING_SUBCOMMANDS",
    "LINKED",
    "PROG",
    "ROOT",
    "RUNTIME",
    "SHARED",
    "InterventionCLI",
    "LineProgress",
    "Parser",
    "RunSummary",
    "fail",
    "find_config",
    "first_reason",
    "given_options",
    "main",
    "metrics_table",
    "quiet_lightning",
    "resolve_configs",
    "run",
    "run_name",
    "short_help",
    "train_main",
    "trainer_defaults",
]


def _lightning(subcommand: str, rest: list[str]):
    return train_main([subcommand, *rest])


COMMANDS: dict[str, tuple[Callable[[list[str]], object], str]] = {
    "fit": (partial(_lightning, "fit"), "train a module (LightningCLI; --config configs/das.yaml)"),
    "validate": (partial(_lightning, "validate"), "score the dev split (--ckpt_path: the checkpoint's settings)"),
    "test": (partial(_lightning, "test"), "score the eval split (--ckpt_path: the checkpoint's settings)"),
    "sweep causalgym": (causalgym_sweep.main, "every method at every layer x region of CausalGym tasks"),
    "sweep ravel": (ravel_sweep.main, "every method at every layer of RAVEL attributes"),
    "calm": (calm.main, "CALM on RAVEL"),
    "steer": (steer_eval.main, "AxBench steering evaluation"),
    "syntaxgym": (syntaxgym.main, "SyntaxGym accuracy of a frozen LM"),
    "serve-judge": (judge_server.main, "serve a local chat model as an OpenAI-style judge"),
    "data": (data.main, "download a published dataset (CausalGym, SyntaxGym, RAVEL, AxBench), sha256-checked"),
}


def _group(words: list[str]) -> dict[str, str]:
    """The commands under `words` ({next word: help}): the top level, or a group such as `sweep`."""
    n = len(words)
    return {
        name.split()[n]: text
        for name, (_, text) in COMMANDS.items()
        if name.split()[:n] == words and len(name.split()) > n
    }


def _parser(words: list[str]) -> ArgumentParser:
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
    function, _ = COMMANDS[name]
    rest = argv[len(name.split()) :]
    if name in LIGHTNING_SUBCOMMANDS:
        return function(rest)
    program, sys.argv[0] = sys.argv[0], f"{PROG} {name}"  # the usage line names the command
    try:
        return function(rest)
    finally:
        sys.argv[0] = program


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 once the command has succeeded (what it returned is not an exit
    status); help exits 0, bad input 2, and any other failure non-zero."""
    run(argv)
    return 0
