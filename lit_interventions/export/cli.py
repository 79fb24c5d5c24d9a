"""`lit-interventions export`: write a trained artifact in a format another tool reads.

    lit-interventions export --artifact PATH_OR_HUB_ID --to FORMAT --out DIR [--concept C] [--factor F]

FORMAT: peft (a LoRA run as a PEFT adapter), gguf-control-vector (llama.cpp control vectors),
pyvene (IntervenableModel.load), lm-eval (lm-evaluation-harness's steered model). Bad input (an
unknown format, an artifact without the format's capability, an --out holding other files or not
writable) is one `error:` line and exit code 2; a file that cannot be written once the export
runs (a full disk) is one `error:` line and exit code 1. docs/export.md says what each tool does
with the files.
"""

from __future__ import annotations

import sys

from jsonargparse import ActionConfigFile

from lit_interventions.cli.parsing import PROG, Parser, fail, resolve_configs
from lit_interventions.export.formats import FORMATS, ExportNotWritten, export_artifact


def parser() -> Parser:
    """The `export` command line (jsonargparse, with --config)."""
    parser = Parser(description=__doc__.split("\n\n")[0], prog=f"{PROG} export", default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument(
        "--artifact", type=str, required=True, help="a run or save_pretrained directory, or a hub id (owner/name)"
    )
    formats = "; ".join(f"{name}: {fmt.help}" for name, fmt in FORMATS.items())
    parser.add_argument("--to", type=str, required=True, help=f"the format. {formats}")
    parser.add_argument("--out", type=str, required=True, help="the directory to write (created if missing)")
    parser.add_argument(
        "--concept",
        type=int | str | None,
        default=None,
        help="a dictionary's concept, by name or row (default: every concept, one file each)",
    )
    parser.add_argument(
        "--factor",
        type=float | None,
        default=None,
        help="steering strength: α = factor × the concept's max activation (default 1.0)",
    )
    return parser


def main(args: list[str] | None = None) -> None:
    """`lit-interventions export`: prints each file written."""
    ns = parser().parse_args(resolve_configs(args))
    try:
        written = export_artifact(ns.artifact, ns.to, ns.out, concept=ns.concept, factor=ns.factor)
    except ExportNotWritten as err:  # the input was good; the disk was full, or --out stopped being writable
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        text = str(err).strip()
        fail(text.splitlines()[0] if text else type(err).__name__)
    for path in written:
        print(path)
