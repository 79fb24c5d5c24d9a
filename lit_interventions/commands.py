"""The `lit-interventions` command: one console script, one parser style (jsonargparse), one error
style (a single `error: ...` line on stderr, exit code 2) for every job this package runs.

    lit-interventions fit|validate|test --config configs/das.yaml [--model.layer 6 ...]
    lit-interventions sweep       --config configs/sweep_causalgym.yaml | configs/sweep_ravel.yaml
    lit-interventions calm        --config configs/calm_ravel.yaml
    lit-interventions steer       --config configs/steer_eval.yaml --checkpoint DIR
    lit-interventions syntaxgym   --suites DIR --out FILE
    lit-interventions serve-judge --lm smollm2-135m-instruct --port 8000

This module dispatches the subcommands; the jobs live elsewhere: `fit`/`validate`/`test` in
`lit_interventions.cli_lightning` (`python train.py ...` is the same; its short `--help` in
`lit_interventions.help`), the parser and error style in `lit_interventions.parsing`, the quiet
Lightning logging in `lit_interventions.quiet`, the run summary and progress lines in
`lit_interventions.callbacks.progress`. Their names are re-exported here.
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from lit_interventions.callbacks.progress import LineProgress, RunSummary, metrics_table
from lit_interventions.cli_lightning import (
    LIGHTNING_SUBCOMMANDS,
    LINKED,
    RUNTIME,
    SHARED,
    InterventionCLI,
    given_options,
    run_name,
    train_main,
    trainer_defaults,
)
from lit_interventions.help import COMMON_TRAINER, short_help
from lit_interventions.parsing import PROG, ROOT, Parser, fail, find_config, first_reason, resolve_configs
from lit_interventions.quiet import quiet_lightning

__all__ = [  # re-exported: the names other modules, tests and train.py import from here
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
    "run_name",
    "serve_judge",
    "short_help",
    "train_main",
    "trainer_defaults",
]

COMMANDS = {
    "fit": "train a module (LightningCLI; --config configs/das.yaml)",
    "validate": "score the dev split (--ckpt_path: the checkpoint's settings)",
    "test": "score the eval split (--ckpt_path: the checkpoint's settings)",
    "sweep": "CausalGym or RAVEL sweep, by the config's `benchmark:` key",
    "calm": "CALM on RAVEL",
    "steer": "AxBench steering evaluation",
    "syntaxgym": "SyntaxGym accuracy of a frozen LM",
    "serve-judge": "serve a local chat model as an OpenAI-style judge",
    "data": "download a published dataset (CausalGym, SyntaxGym, RAVEL, AxBench), sha256-checked",
}


def serve_judge(args=None) -> None:
    """`serve-judge`: `judge_server.main` (jsonargparse, the same error style)."""
    from lit_interventions import judge_server

    judge_server.main(args)


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
    if command == "data":
        from lit_interventions.data import main as data_main

        return data_main(rest)
    return serve_judge(rest)


if __name__ == "__main__":
    main()
