"""`lit-interventions concepts`: AxBench-style concept data from a list of concept names, written
by a generator LM (AxBench's recipe; `datamodules/concepts_build.py`).

    lit-interventions concepts --concepts concepts.txt --out data/my_concepts
    lit-interventions concepts --concepts concepts.txt --prompts prompts.txt --out data/my_concepts \\
        --base_url https://api.openai.com/v1 --model gpt-4o-mini --api_key_env OPENAI_API_KEY

Every option and both files are checked before any model loads: bad input is one `error:` line
naming the value and what is allowed (exit 2). A generation that fails (an endpoint that keeps
failing, a concept left without rows) is one `error:` line and exit 1; what was generated stays
cached in the output directory for the next run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from lit_interventions.cli.data import sha256_of
from lit_interventions.cli.parsing import Parser, fail
from lit_interventions.core.chat_endpoint import ChatRequestError, check_base_url
from lit_interventions.core.lm import EMBEDDED
from lit_interventions.datamodules.concepts_build import CACHE, OUTPUTS, Settings, build_concepts
from lit_interventions.datamodules.concepts_generators import DEFAULT_GENERATOR, EndpointGenerator, LocalGenerator
from lit_interventions.datamodules.concepts_recipe import check_prompts, read_concepts, read_prompts

POSITIVE = ("per_concept", "eval_per_concept", "max_new_tokens", "batch_size", "workers")


def _parser() -> Parser:
    parser = Parser(
        prog="lit-interventions concepts",
        description="Write AxBench-style concept data (train_data.parquet, latent_eval_data.parquet, "
        "metadata.jsonl, generation.json) for a list of concepts with a generator chat model.",
    )
    add = parser.add_argument
    add("--concepts", type=str, required=True, help="text file: one concept a line, optionally CONCEPT<TAB>GENRE")
    add(
        "--prompts",
        type=str,
        default=None,
        help="instructions, one a line (GENRE<TAB>TEXT for one genre); default: ours",
    )
    add("--out", type=str, required=True, help="output directory (also holds the cache, generations.jsonl)")
    add("--per_concept", type=int, default=24, help="training positives per concept, and pool negatives per genre")
    add("--eval_per_concept", type=int, default=12, help="eval positives and eval negatives per concept")
    add(
        "--lm",
        type=str,
        default=None,
        help=f"local generator: embedded name, .gguf, directory or hub id ({DEFAULT_GENERATOR})",
    )
    add(
        "--base_url",
        type=str,
        default=None,
        help="OpenAI-compatible endpoint instead of a local LM, e.g. http://127.0.0.1:8000/v1",
    )
    add("--model", type=str, default=None, help="the endpoint's model name (with --base_url)")
    add("--api_key_env", type=str, default=None, help="environment variable holding the endpoint's API key")
    add("--seed", type=int, default=0, help="seeds the instruction order and every reply")
    add("--max_new_tokens", type=int, default=96, help="longest reply, in tokens")
    add("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    add("--top_p", type=float, default=0.9, help="nucleus sampling mass, in (0, 1]")
    add("--batch_size", type=int, default=8, help="replies drawn together (local LM)")
    add("--workers", type=int, default=4, help="concurrent requests (endpoint)")
    return parser


def _check_options(cfg) -> None:
    """Each option's value, and the generator's options taken together; one error line on the first bad one."""
    for name in POSITIVE:
        if getattr(cfg, name) < 1:
            fail(f"--{name}={getattr(cfg, name)}: must be an integer >= 1")
    if cfg.seed < 0:
        fail(f"--seed={cfg.seed}: must be an integer >= 0")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        fail(f"--temperature={cfg.temperature}: must be a finite number >= 0 (0: greedy)")
    if not (0 < cfg.top_p <= 1):
        fail(f"--top_p={cfg.top_p}: must be in (0, 1]")
    if cfg.base_url is None:
        for name in ("model", "api_key_env"):
            if getattr(cfg, name) is not None:
                fail(f"--{name}={getattr(cfg, name)}: only with --base_url (an endpoint); a local LM is --lm")
        return
    if cfg.lm is not None:
        fail(f"--lm={cfg.lm} and --base_url={cfg.base_url}: choose one generator, a local LM or an endpoint")
    if not cfg.model:
        fail(f"--base_url={cfg.base_url}: needs --model, the name the endpoint serves")
    try:
        check_base_url(cfg.base_url)
    except ValueError as err:
        fail(f"--{err}")


def _check_paths(cfg):
    """(concepts, prompts) read from their files, and --out checked to be a directory or absent."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: is a file; pass a directory for the concept data")
    try:
        concepts = read_concepts(cfg.concepts)
        prompts = read_prompts(cfg.prompts)
        check_prompts(prompts, concepts, cfg.prompts)
    except ValueError as err:
        fail(str(err))
    return concepts, prompts


def _generator(cfg):
    sampling = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p}
    try:
        if cfg.base_url is not None:
            return EndpointGenerator(cfg.base_url, cfg.model, cfg.api_key_env, workers=cfg.workers, **sampling)
        lm = cfg.lm or DEFAULT_GENERATOR
        path = Path(lm).expanduser()
        if lm not in EMBEDDED and not path.exists() and (lm.startswith(("/", ".", "~")) or lm.count("/") > 1):
            fail(
                f"--lm={lm}: no such file or directory; use an embedded name ({', '.join(EMBEDDED)}), a .gguf file, a model directory or a hub id"
            )
        return LocalGenerator(lm, **sampling)
    except ValueError as err:  # an unset API key variable
        fail(f"--{err}")
    except (FileNotFoundError, ImportError) as err:  # an embedded model not installed, a missing .gguf
        fail(f"--lm={cfg.lm or DEFAULT_GENERATOR}: {err}")


def main(args: list[str] | None = None) -> dict:
    """`lit-interventions concepts ...`; returns the provenance record (generation.json)."""
    cfg = _parser().parse_args(args)
    _check_options(cfg)
    concepts, prompts = _check_paths(cfg)
    generator = _generator(cfg)
    settings = Settings(cfg.per_concept, cfg.eval_per_concept, cfg.seed, cfg.batch_size)
    sources = {
        "concepts": {"path": str(cfg.concepts), "sha256": sha256_of(Path(cfg.concepts))},
        "prompts": "built-in"
        if cfg.prompts is None
        else {"path": str(cfg.prompts), "sha256": sha256_of(Path(cfg.prompts))},
    }
    name = generator.identity().get("lm") or f"{cfg.model} at {cfg.base_url}"
    print(f"concepts: {len(concepts)} concepts -> {cfg.out}, written by {name}", file=sys.stderr, flush=True)
    try:
        record = build_concepts(concepts, prompts, cfg.out, generator, settings, sources)
    except (ChatRequestError, ValueError) as err:
        print(f"error: {err} (replies so far are kept in {Path(cfg.out) / CACHE})", file=sys.stderr)
        raise SystemExit(1) from None
    counts = record["generations"]
    print(
        f"concepts: {', '.join(OUTPUTS)} in {cfg.out}; {counts['generated']} replies generated, "
        f"{counts['cached']} from the cache",
        file=sys.stderr,
        flush=True,
    )
    return record
