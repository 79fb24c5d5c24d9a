"""`lit-interventions syntaxgym`: the command line.

    lit-interventions syntaxgym --suites DIR_OR_FILES --lm NAME --out FILE

The output CSV has the header `suite,items,accuracy` and one row per suite, then
`SG score (all suites),<items>,<mean accuracy over every suite>` and, last,
`SG score,<items>,<mean accuracy>` over the suites the official analysis counts (`score.sg_score`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch

from lit_interventions.cli.parsing import Parser, fail, resolve_configs
from lit_interventions.core.lm import DEFAULT_LM, DTYPES, load_lm, load_tokenizer
from lit_interventions.studies.syntaxgym.score import SuiteResult, evaluate_suite, score_rows, write_csv
from lit_interventions.studies.syntaxgym.suites import load_suite, suite_paths


def _arguments(argv: list[str] | None):
    from jsonargparse import ActionConfigFile

    parser = Parser(
        prog="lit-interventions syntaxgym",
        description="SyntaxGym accuracy of a frozen LM: per-suite accuracy and the SG score (mean over suites).",
        default_config_files=[],
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with these options")
    parser.add_argument(
        "--suites", type=str, required=True, nargs="+", help="a directory of *.json suites, or suite files"
    )
    parser.add_argument("--lm", type=str, default=DEFAULT_LM, help="what lit_interventions.core.lm.load_lm accepts")
    parser.add_argument(
        "--out",
        type=str,
        required=True,
        help="CSV: suite,items,accuracy; last rows 'SG score (all suites)' and 'SG score'",
    )
    parser.add_argument("--batch_size", "--batch-size", type=int, default=16, help="sentences per forward pass")
    parser.add_argument("--dtype", type=Literal[tuple(sorted(DTYPES))], default="float32", help="the LM's dtype")
    parser.add_argument(
        "--attach_punctuation",
        "--attach-punctuation",
        type=bool,
        default=False,
        help="join a punctuation-only region ('.', ',') to the previous one without a space "
        "(default: with a space, as syntaxgym-core)",
    )
    parser.add_argument(
        "--threads",
        type=int | None,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 is much faster when other processes share the cores",
    )
    return parser, parser.parse_args(resolve_configs(argv))


def main(argv: list[str] | None = None) -> list[SuiteResult]:
    """`lit-interventions syntaxgym`."""
    parser, args = _arguments(argv)
    out = Path(args.out)
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch_size={args.batch_size} must be a positive integer")
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads={args.threads} must be a positive integer")
            torch.set_num_threads(args.threads)
        suites = [load_suite(path) for path in suite_paths(_flat(args.suites))]  # all checked before the LM loads
        started = time.perf_counter()
        model, tokenizer = load_lm(args.lm, args.dtype), load_tokenizer(args.lm)
        results = []
        for suite in suites:
            results.append(
                evaluate_suite(
                    suite, model, tokenizer, batch_size=args.batch_size, attach_punctuation=args.attach_punctuation
                )
            )
            print(f"{suite.name:<28} items {results[-1].items:>3}  accuracy {results[-1].accuracy:.3f}", flush=True)
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))
    write_csv(results, out)
    print(score_line(results))
    print(f"wrote {out} ({time.perf_counter() - started:.1f} s with model loading)", flush=True)
    return results


def score_line(results: list[SuiteResult]) -> str:
    """The SG score, once: over the suites the official analysis counts, and over every suite
    given (the CSV's `SG score (all suites)`) beside it when that counts more suites."""
    (_, every, _, all_score), (name, suites, _, score) = score_rows(results)
    line = f"{name:<28} suites {suites:>2}  accuracy {score:.3f}"
    return line if every == suites else f"{line}  (all {every} suites: {all_score:.3f})"


def _flat(values) -> list[str]:
    """--suites a b c, --suites '[a, b]' or a YAML list: one flat list of paths."""
    flat = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        flat.extend(_flat(value) if isinstance(value, (list, tuple)) else [str(value)])
    return flat
