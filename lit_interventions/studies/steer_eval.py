"""AxBench steering evaluation: steer, generate, judge, choose the factor on one half, report on the other.

    lit-interventions steer --config configs/steer_eval.yaml --artifact DIR_OR_HUB_ID [--out DIR]
    lit-interventions steer --config configs/steer_eval.yaml --artifact [RUN_DIR_A, RUN_DIR_B]

An artifact is anything `lit-interventions generate` applies (a concept dictionary, an
intervention, a LoReFT / LoRA steering module, a run directory, a hub id; `--dictionary` and
`--checkpoint` are other spellings of `--artifact`), applied with `inference.apply.apply` at every
factor. A concept dictionary steers Φ(h) = h + α·w at every position of its layer, α = factor ×
(the concept's max activation) (AxBench §3.3, `Dictionary.edits`); any other artifact's edit f*
(LoReFT, LoRA, a steering intervention) is scaled, Φ(h) = h + factor·(f*(h) − h), f* itself at
factor 1 (`core.edits.scaled`). An interchange intervention (DAS) needs a source text and is
refused before the LM loads. A dictionary is evaluated on its chosen concepts, any other artifact
on the one concept its config names.

Per concept, N instructions are drawn (seeded); every (factor, instruction) is generated (left
padding, the LM's chat template) and judged (concept, instruction relevance, fluency, overall =
their harmonic mean). The factor with the best mean overall on the first half of the instructions
is chosen; its scores on the other half are reported.

Writes DIR/generations.jsonl (one line per generation, with the judge's replies), DIR/factors.csv
(every factor × half), DIR/summary.csv (the reported scores per concept) and DIR/steering.png.
A rerun skips the (concept, factor) cells already in generations.jsonl.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lit_interventions.artifacts.plots import report_figures
from lit_interventions.cli.studies import claim_out_dir, run_cli
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.progress import Progress, TokenSteps, line_seconds, stage
from lit_interventions.core.sharding import LoadOptions
from lit_interventions.inference.apply import LoadedArtifact, apply
from lit_interventions.metrics.judge import ASPECTS, Judge, chat_prompt, generate_replies
from lit_interventions.studies.steer_checks import (
    FACTORS,
    artifact_paths,
    check_settings,
    concept_cells,
    ready_judge,
    steered_lm,
)
from lit_interventions.studies.steer_report import (
    FACTOR_COLUMNS,
    SCORES,
    SUMMARY_COLUMNS,
    choose_and_report,
    keep_whole_cells,
    plot_factors,
    read_generations,
    write_report,
)
from lit_interventions.studies.steer_sources import (
    artifact_concepts,
    artifact_method,
    load_artifacts,
    load_instructions,
)

__all__ = [
    "FACTORS",
    "FACTOR_COLUMNS",
    "SCORES",
    "SUMMARY_COLUMNS",
    "SteerPlan",
    "choose_and_report",
    "generate",
    "load_artifacts",
    "load_instructions",
    "main",
    "plan_steer_eval",
    "plot_factors",
    "run_steer_eval",
]


def generate(
    model,
    tokenizer,
    instructions: list[str],
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    top_k: int = 50,
) -> list[str]:
    """Sampled replies to each instruction (chat template, left padding), batched, from the `top_k`
    most likely tokens at `temperature` (0: every token; temperature 0: greedy); each decoding
    step counted in the study's progress (`core.progress.stage`)."""
    torch.manual_seed(seed)
    templated = bool(getattr(tokenizer, "chat_template", None))
    room = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    texts = [chat_prompt(tokenizer, i) if templated else i for i in instructions]
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with stage(math.ceil(len(texts) / batch_size) * max_new_tokens, "generated tokens", "token") as shown:
        return generate_replies(
            model,
            tokenizer,
            texts,
            max_new_tokens,
            batch_size,
            max_length=max(1, room - max_new_tokens) if room else None,
            streamer=TokenSteps(shown, max_new_tokens),
            **sampling,
        )


@dataclass
class SteerPlan:
    """A checked steering evaluation: which artifact runs which concepts at which factors, on which
    LM, with which instructions and generation settings, judged by whom, written where."""

    lm: str
    placement: LoadOptions
    cells_of: dict  # LoadedArtifact -> the concepts of it to evaluate
    factors: list[float]
    pool: list[str]  # the instructions to draw from
    judge: Judge
    out: Path
    instructions: int
    max_new_tokens: int
    temperature: float
    batch_size: int
    seed: int
    top_k: int = 50


_read_generations = read_generations  # its name before the split (tests import it from here)


# --- plan: validate everything before generating ------------------------------------------------
def plan_steer_eval(
    *,
    artifact=None,
    dictionary=None,
    checkpoint=None,
    lm,
    concepts,
    factors,
    instructions,
    instruction_file,
    max_new_tokens,
    temperature,
    batch_size,
    judge,
    out,
    seed,
    device_map,
    quantization,
    trust_remote_code=False,
    top_k=50,
) -> SteerPlan:
    """Check every argument, read the artifacts (their tensors: an interchange intervention is
    refused here, before the LM loads), draw up the cells and claim the output directory
    (DIR/meta.json), all before any generation; the arguments are `run_steer_eval`'s."""
    placement = LoadOptions(device_map, quantization)
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    paths = artifact_paths(artifact, dictionary, checkpoint)
    factors = check_settings(factors, instructions, max_new_tokens, temperature, batch_size, top_k)
    artifacts = load_artifacts(paths, trust_remote_code)
    lm = steered_lm(artifacts, lm)
    cells_of = concept_cells(concepts, artifacts)
    pool = load_instructions(instruction_file)
    if len(pool) < instructions:
        raise ValueError(f"instructions={instructions} but only {len(pool)} instructions are available")
    judge = ready_judge(judge)
    out = Path(out)
    meta = {
        "lm": lm,
        "method": "+".join(sorted({artifact_method(a) for a in artifacts})),
        "artifact": paths,
        "instructions": instructions,
        "instruction_file": instruction_file,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "seed": seed,
    }
    claim_out_dir(out, meta, what="a steering evaluation")
    return SteerPlan(
        lm,
        placement,
        cells_of,
        factors,
        pool,
        judge,
        out,
        instructions,
        max_new_tokens,
        temperature,
        batch_size,
        seed,
        top_k,
    )


# --- run: generate and judge, one (concept, factor) cell at a time -----------------------------
def _run_cell(plan: SteerPlan, model, tokenizer, artifact: LoadedArtifact, concept: str, factor: float) -> list[dict]:
    """The rows of one cell: N instructions drawn for the concept (seeded by concept), generated
    with the artifact applied at the factor (`apply`), judged; the first N//2 are the "select" half."""
    names, told = artifact_concepts(artifact)
    chosen = random.Random(f"{plan.seed}:{concept}").sample(plan.pool, plan.instructions)
    with apply(model, artifact, tokenizer=tokenizer, concept=concept if told else None, factor=factor) as steered:
        responses = generate(
            steered,
            tokenizer,
            chosen,
            plan.max_new_tokens,
            plan.temperature,
            plan.batch_size,
            seed=zlib.crc32(f"{plan.seed}:{concept}:{factor}".encode()),
            top_k=plan.top_k,
        )
    scores = _judged(plan.judge, [concept] * len(chosen), chosen, responses)
    select = plan.instructions // 2
    return [
        {
            "method": artifact_method(artifact),
            "concept": concept,
            "concept_id": names.index(concept),
            "factor": float(factor),
            "half": "select" if k < select else "report",
            "instruction_index": k,
            "instruction": text,
            "response": response,
            **score.as_dict(),
        }
        for k, (text, response, score) in enumerate(zip(chosen, responses, scores))
    ]


def _judged(judge: Judge, concepts: list[str], instructions: list[str], responses: list[str]) -> list:
    """`judge.score`, called on a few generations at a time, each call counted in the study's
    progress: as many as fill whole batches of the judge's prompts (3 a generation; a local judge's
    `batch_size`, an endpoint's `workers`), so the judge sees the batches one call gives it."""
    per = getattr(judge, "batch_size", None) or getattr(judge, "workers", None) or 1
    size = per // math.gcd(per, len(ASPECTS))
    scores = []
    with stage(len(responses), "judged generations", "generation") as shown:
        for a in range(0, len(responses), size):
            scores += judge.score(concepts[a : a + size], instructions[a : a + size], responses[a : a + size])
            shown.update(len(responses[a : a + size]))
    return scores


def run_cells(plan: SteerPlan) -> list[dict]:
    """Every row of DIR/generations.jsonl: those already there, then each cell not yet complete,
    generated, judged and appended (flushed) one cell at a time."""
    path = plan.out / "generations.jsonl"
    rows = keep_whole_cells(path, _read_generations(path), plan.instructions)
    done = defaultdict(int)
    for row in rows:
        done[(row["concept"], float(row["factor"]))] += 1
    placement = plan.placement
    model, tokenizer = (
        load_lm(plan.lm, "float32", placement.device_map, placement.quantization),
        load_tokenizer(plan.lm),
    )
    work = [(s, c, f) for s, names in plan.cells_of.items() for c in names for f in plan.factors]
    todo = [(s, c, f) for s, c, f in work if done[(c, float(f))] < plan.instructions]
    with path.open("a") as sink, Progress(len(work), "steering cells", "cell", len(work) - len(todo)) as shown:
        for artifact, concept, factor in todo:
            shown.note(f"{concept}, factor {factor}")
            cell = _run_cell(plan, model, tokenizer, artifact, concept, factor)
            sink.write("".join(json.dumps(r) + "\n" for r in cell))
            sink.flush()
            rows += cell
            shown.update()
    return rows


# --- the evaluation: plan, run, report ----------------------------------------------------------
def run_steer_eval(
    artifact: str | list[str] | None = None,
    dictionary: str | list[str] | None = None,
    checkpoint: str | list[str] | None = None,
    lm: str | None = None,
    concepts: str | list[str | int] | None = "all",
    factors: list[float] | None = None,
    instructions: int = 10,
    instruction_file: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 50,
    batch_size: int = 10,
    judge: dict | Judge | None = None,
    out: str = "runs/steer_eval",
    seed: int = 0,
    device_map: str | int | dict | None = None,
    quantization: str | None = None,
    trust_remote_code: bool = False,
) -> list[dict]:
    """Run (or resume) the steering evaluation; returns the summary rows.

    Args:
        artifact: what steers, one or a list: any artifact `lit-interventions generate` applies (a
            concept dictionary, an intervention that edits the LM alone, a LoReFT / LoRA run
            directory or .ckpt, a hub id). A dictionary is evaluated on its concepts, any other
            artifact on the one concept its config names.
        dictionary, checkpoint: other spellings of `artifact` (give exactly one of the three).
        lm: the LM to steer (default: the model the artifacts were trained on; must match it).
        concepts: names or ids among the artifacts' concepts, or 'all'.
        factors: steering factors (default the paper's 14), each run for every artifact: a
            dictionary's α = factor × max activation; any other edit f* is scaled, h + factor·(f* − h).
        instructions: N instructions per concept: the first N//2 choose the factor, the rest report.
        instruction_file: a JSON list or a text file of instructions (default: the AxBench data module's).
        max_new_tokens, temperature, top_k: generation (AxBench: 128, 1.0 and transformers' default
            top_k 50; top_k 0 samples from every token).
        batch_size: generation batch size.
        judge: the judge config, {backend: openai|local, ...options} (see metrics/judge.py).
        out: output directory. seed: instruction sampling and generation seed.
        device_map, quantization: a steered LM larger than one device (`lit_interventions.core.sharding`):
            e.g. "auto" and "4bit".
        trust_remote_code: import a class path an artifact names that is not registered (only for
            artifacts whose source you trust: importing runs its code).
    """
    plan = plan_steer_eval(
        artifact=artifact,
        dictionary=dictionary,
        checkpoint=checkpoint,
        lm=lm,
        concepts=concepts,
        factors=factors,
        instructions=instructions,
        instruction_file=instruction_file,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        batch_size=batch_size,
        judge=judge,
        out=out,
        seed=seed,
        device_map=device_map,
        quantization=quantization,
        trust_remote_code=trust_remote_code,
    )
    rows = run_cells(plan)
    cells = {(c, float(f)) for names in plan.cells_of.values() for c in names for f in plan.factors}
    return write_report(plan.out, rows, cells)


def main(args=None) -> None:
    """`lit-interventions steer`: the evaluation from the command line (a --judge dict), then the mean overall."""

    def customize(parser):
        parser.add_function_arguments(run_steer_eval, as_positional=False, skip={"judge"})
        parser.add_argument(
            "--judge",
            type=dict,
            default={"backend": "openai"},
            help="judge backend and options, e.g. {backend: openai, base_url: ..., model: ..., api_key_env: ...}",
        )

    with report_figures():  # steering.png not written: one line, the CSVs kept
        summary = run_cli(
            run_steer_eval, __doc__, args, customize, errors=(ValueError, FileNotFoundError, ConnectionError)
        )
    if summary:
        print(f"mean overall over {len(summary)} concepts: {np.mean([r['overall'] for r in summary]):.3f}")
