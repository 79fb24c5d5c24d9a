"""`lit-interventions generate`: a prompt's continuation with an artifact applied, beside the
continuation without it.

    lit-interventions generate --artifact checkpoints/axbench/builtin-diffmean --prompt "Tell me a story" \\
        --concept 0 --factor 4
    lit-interventions generate --artifact runs/das/.../version_0 --prompt "The author near the keys" \\
        --source "The authors near the keys" --json
    lit-interventions generate --artifact checkpoints/axbench/builtin-diffmean --prompt "Tell me a story" \\
        --concept 0 --factor 4 --gate true     # the edit only where the concept's latent > τ_c

Every option is checked, and the artifacts are read (tensors only), before the LM loads.
"""

from __future__ import annotations

import json
import math
import shutil
import textwrap

from transformers.utils import logging as transformers_logging

from lit_interventions.cli.parsing import PROG, Parser, fail, resolve_configs
from lit_interventions.core.edits import concept_index
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.positions import Positions
from lit_interventions.inference.apply import LoadedArtifact, load_artifact
from lit_interventions.inference.gate import check_gate
from lit_interventions.inference.generate import generate_pair, prompt_positions


def add_artifact_options(parser: Parser) -> None:
    """--artifact (several, or the option repeated, compose), --lm, --dtype and
    --trust_remote_code: what `generate` and `serve` load."""
    add = parser.add_argument
    add(
        "--artifact",
        type=str,
        nargs="+",
        action="extend",
        required=True,
        help="run or save_pretrained directories, or hub ids (several, or the option repeated, compose)",
    )
    add("--lm", type=str | None, default=None, help="the LM (default: the model the artifact was trained on)")
    add("--dtype", type=str, default="float32")
    add("--trust_remote_code", action="store_true", help="load artifacts naming unregistered classes")


def parser() -> Parser:
    """The `generate` command line."""
    from jsonargparse import ActionConfigFile

    parser = Parser(description=__doc__.split("\n\n")[0], prog=f"{PROG} generate", default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    add = parser.add_argument
    add_artifact_options(parser)
    add("--prompt", type=str, required=True, help="the text to continue (a chat model's user turn)")
    add("--source", type=str | None, default=None, help="an interchange's source text")
    add("--concept", type=str | None, default=None, help="a dictionary concept: its name or index")
    add(
        "--factor",
        type=float,
        default=1.0,
        help="the steering factor (a dictionary: x the concept's max activation; any other edit f*: h + factor*(f*(h) - h))",
    )
    add_gate_option(parser)
    add(
        "--positions",
        type=str,
        default="site",
        help="site | all | prompt | generated | last | fN+lM | indices such as 0,3,-1",
    )
    add("--span", type=str | None, default=None, help="edit the last token of this piece of the prompt")
    add("--source_positions", type=str, default="last", help="the source token read: last or one index")
    add("--source_span", type=str | None, default=None, help="read the source at the last token of this piece")
    add("--max_new_tokens", type=int, default=32)
    add("--seed", type=int, default=0)
    add("--sample", action="store_true", help="sample (temperature, top_p) instead of greedy decoding")
    add("--temperature", type=float, default=1.0)
    add("--top_p", type=float, default=1.0)
    add("--chat", type=bool | None, default=None, help="use the chat template (default: when the tokenizer has one)")
    add("--json", action="store_true", help="print one JSON object: prompt, unsteered, steered")
    return parser


def add_gate_option(parser: Parser) -> None:
    """--gate: conditional steering of a concept dictionary (`inference.gate`), for `generate` and `serve`."""
    parser.add_argument(
        "--gate",
        type=str | None,
        default=None,
        help="gate a dictionary's edit on its concept's latent, h + a*w_c*1[z_c(h) > tau]: true (tau per concept "
        "from the eval split, Youden's J) or a threshold tau (default: no gate)",
    )


def checked_gate(gate: str | None, artifacts: list[LoadedArtifact]):
    """--gate parsed and checked against the artifacts (`check_gate`), else one error line."""
    try:
        return check_gate(gate, artifacts, "--gate")
    except ValueError as err:
        fail(str(err).splitlines()[0])


def check_options(ns) -> None:
    """One error line for the first bad option, before anything loads."""
    if ns.max_new_tokens < 1:
        fail(f"--max_new_tokens={ns.max_new_tokens} must be an integer >= 1")
    if not math.isfinite(ns.factor):
        fail(f"--factor={ns.factor} must be a finite number")
    if not (math.isfinite(ns.temperature) and ns.temperature > 0):
        fail(f"--temperature={ns.temperature} must be a number > 0")
    if not 0 < ns.top_p <= 1:
        fail(f"--top_p={ns.top_p} must be in (0, 1]")
    for name in ("positions", "source_positions"):
        try:
            Positions.parse(getattr(ns, name))
        except ValueError as err:
            fail(str(err).replace("positions=", f"--{name}=", 1))
    if not ns.prompt:
        fail("--prompt is empty; give the text to continue")


def check_concept(artifacts: list[LoadedArtifact], concept: str | None) -> None:
    """A concept that no dictionary artifact holds: one error line, before the LM loads."""
    for artifact in artifacts:
        names = artifact.concepts
        if names and concept is not None:
            try:
                concept_index(concept, names, len(names), artifact.where)
            except ValueError as err:
                fail(str(err))


def command_artifacts(
    paths: list[str], lm: str | None, concept: str | None, trust_remote_code: bool
) -> tuple[list[LoadedArtifact], str]:
    """(the artifacts `--artifact` names, read, and the LM to load: `--lm`, else the first
    artifact's model); one error line for an unreadable artifact, a concept none holds, or no
    model to load, before the LM loads (`generate`, `serve`)."""
    try:
        artifacts = [load_artifact(path, trust_remote_code=trust_remote_code) for path in paths]
    except (OSError, ValueError) as err:
        fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    check_concept(artifacts, concept)
    name = lm or artifacts[0].model
    if not name:
        fail(f"{artifacts[0].where} records no model; pass --lm")
    return artifacts, name


def side_by_side(left: str, right: str, titles=("unsteered", "steered")) -> str:
    """Two texts in two columns as wide as the terminal allows."""
    width = max(20, (shutil.get_terminal_size((100, 24)).columns - 3) // 2)

    def column(text: str) -> list[str]:
        return [line for paragraph in text.split("\n") for line in (textwrap.wrap(paragraph, width) or [""])]

    a, b = column(left), column(right)
    rows = [(titles[0], titles[1]), ("-" * width, "-" * width)]
    rows += [(a[i] if i < len(a) else "", b[i] if i < len(b) else "") for i in range(max(len(a), len(b)))]
    return "\n".join(f"{x:<{width}} | {y}".rstrip() for x, y in rows)


def generate_main(args: list[str] | None = None) -> dict:
    """`lit-interventions generate`; returns what it printed (as a dict)."""
    ns = parser().parse_args(resolve_configs(args))
    check_options(ns)
    transformers_logging.disable_progress_bar()  # the weights' loading bar: the output is the text
    artifacts, lm_name = command_artifacts(ns.artifact, ns.lm, ns.concept, ns.trust_remote_code)
    gate = checked_gate(ns.gate, artifacts)
    try:
        tokenizer = load_tokenizer(lm_name)
        prompt_positions(tokenizer, ns.prompt, ns.positions, ns.span, ns.chat)  # checked before the LM loads
    except ValueError as err:
        line = str(err).splitlines()[0]
        fail(f"--{line}" if line.startswith("positions=") else line)
    try:
        lm = load_lm(lm_name, ns.dtype)
        result = generate_pair(
            lm,
            tokenizer,
            artifacts,
            ns.prompt,
            source=ns.source,
            concept=ns.concept,
            factor=ns.factor,
            positions=ns.positions,
            span=ns.span,
            source_positions=ns.source_positions,
            source_span=ns.source_span,
            max_new_tokens=ns.max_new_tokens,
            seed=ns.seed,
            do_sample=ns.sample,
            temperature=ns.temperature,
            top_p=ns.top_p,
            chat=ns.chat,
            gate=gate,
        )
    except ValueError as err:
        fail(str(err).splitlines()[0])
    if ns.json:
        print(json.dumps({k: result[k] for k in ("prompt", "unsteered", "steered")}, ensure_ascii=False))
    else:
        print(f"prompt: {ns.prompt}\n\n{side_by_side(result['unsteered'], result['steered'])}")
    return result
