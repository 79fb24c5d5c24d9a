"""AxBench steering evaluation: steer, generate, judge, choose the factor on one half, report on the other.

    lit-interventions steer --config configs/steer_eval.yaml --artifact DIR_OR_HUB_ID [--out DIR]
    lit-interventions steer --config configs/steer_eval.yaml --artifact [RUN_DIR_A, RUN_DIR_B]
    lit-interventions steer --config configs/steer_eval.yaml --method prompt --lm NAME [--concept_dir DIR]
    lit-interventions steer --config configs/steer_eval.yaml --artifact DIR --mode suppress --side_effects true
    lit-interventions steer --config configs/steer_eval.yaml --artifact DIR --gate true --side_effects true

An artifact is anything `lit-interventions generate` applies (a concept dictionary, an
intervention, a LoReFT / LoRA steering module, a run directory, a hub id; `--dictionary` and
`--checkpoint` are other spellings of `--artifact`), applied with `inference.apply.apply` at every
factor. A concept dictionary steers Φ(h) = h + α·w at every position of its layer, α = factor ×
(the concept's max activation) (AxBench §3.3, `Dictionary.edits`); any other artifact's edit f*
(LoReFT, LoRA, a steering intervention) is scaled, Φ(h) = h + factor·(f*(h) − h), f* itself at
factor 1 (`core.edits.scaled`). An interchange intervention (DAS) needs a source text and is
refused before the LM loads. A dictionary is evaluated on its chosen concepts, any other artifact
on the one concept its config names.

`--method prompt` is AxBench's prompt baseline: no artifact and no edit; the LM is asked for the
concept in the prompt (`prompt_baseline_input`), once per (concept, instruction) at factor 0 (no
intervention: `--factors` does not apply), for the concepts of the built-in set or `--concept_dir`.
Its rows are judged and reported as any method's, with method "prompt".

`--mode suppress` is AxBench's suppression evaluation (`AlpacaEval_Suppress`,
axbench/utils/dataset.py): every instruction is put to the LM as the prompt baseline's user turn,
which asks for the concept (`prompt_baseline_input`), and the artifact steers against it: each
factor f is applied as −f (AxBench negates every steering factor). The rows carry `mode` and the
applied (negative) factor, are judged on the bare instruction as in `steer` mode, and their
overall is AxBench's suppression score, H(2 − concept, instruction, fluency) (`mode_scores`), by
which the factor is chosen as in `steer` mode. The prompt baseline in this mode is the unsuppressed reference: the same prompt, no edit.

`--side_effects true` measures each cell's side effects with the same edit as the cell's
generations (`cell_edit`): `kl_neutral` (`side_effects.kl_neutral`) on our neutral prompts
(`data/axbench/neutral_prompts.json`), and `capability_delta`, the mean SyntaxGym suite accuracy
steered minus unsteered (`cell_capability_delta`) on our three built-in suites
(`data/syntaxgym/`) or `--capability_suites`; the prompt baseline has no edit, so both are 0.

`--gate true|THRESHOLD` steers conditionally (`inference.gate`, CAST): a concept dictionary's edit
at a token only where the concept's own latent crosses τ, h + α·w_c·1[z_c(h) > τ_c], in the
generations and in kl_neutral alike; `true` takes τ_c chosen on the eval split (Youden's J), a
number is τ for every concept. An artifact with no latent (LoReFT, LoRA, the prompt baseline) is
refused before the LM loads; meta.json records the gate.

Per concept, N instructions are drawn (seeded); every (factor, instruction) is generated (left
padding, the LM's chat template) and judged (concept, instruction relevance, fluency, overall =
their harmonic mean). The factor with the best mean overall on the first half of the instructions
is chosen; its scores on the other half are reported.

Writes DIR/generations.jsonl (one line per generation, with the judge's replies), DIR/factors.csv
(every factor × half), DIR/summary.csv (the reported scores per concept) and DIR/steering.png;
with `--mode suppress` the CSVs gain a `mode` column, with `--side_effects true` `kl_neutral` and
`capability_delta` ones, and steering.png two Pareto panels (`pareto_panel`).
A rerun skips the (concept, factor) cells already in generations.jsonl; DIR/meta.json records the
settings and the instruction file's sha256, and a rerun with other settings, or on an instruction
file changed in place, is refused in one line before the LM loads.

The file reads in that order: plan (every check, and the artifacts read, before the LM loads),
run (generate and judge each cell), report, then `run_steer_eval` and `main`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import warnings
import zlib
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lit_interventions.artifacts.plots import report_figures, save_figure
from lit_interventions.artifacts.results import check_recorded, claim_out_dir
from lit_interventions.cli.studies import run_cli
from lit_interventions.core.files import FILE_DIGESTS, read_utf8, unchanged_files, write_atomically
from lit_interventions.core.lm import hidden_size, load_config, load_lm, load_tokenizer
from lit_interventions.core.progress import Progress, TokenSteps, line_seconds, stage
from lit_interventions.core.sharding import LoadOptions
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, load_concepts
from lit_interventions.datamodules.axbench_files import load_instructions as builtin_instructions
from lit_interventions.inference.apply import LoadedArtifact, apply, load_artifact
from lit_interventions.inference.gate import check_gate
from lit_interventions.interventions.capabilities import is_source_free
from lit_interventions.metrics.judge import make_judge
from lit_interventions.metrics.judge_base import Judge
from lit_interventions.metrics.judge_compare import agreement_lines
from lit_interventions.metrics.judge_local import chat_prompt, generate_replies
from lit_interventions.metrics.judge_prompts import ASPECTS, mode_scores
from lit_interventions.studies.side_effects import (
    NEUTRAL_PROMPTS,
    Unsteered,
    kl_neutral,
    neutral_log_probs,
    pareto_panel,
    pareto_points,
    side_effect_inputs,
    suite_accuracy,
)
from lit_interventions.studies.syntaxgym.suites import Suite

FACTORS = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0]  # AxBench's steering factors
SCORES = ["concept_score", "instruct_score", "fluency_score", "overall"]
SUMMARY_COLUMNS = ["method", "concept", "factor", *SCORES]
FACTOR_COLUMNS = ["method", "concept", "factor", "half", *SCORES, "n"]
PROMPT = "prompt"  # the steering method that needs no artifact: AxBench's prompt baseline
PROMPT_FACTOR = 0.0  # the factor column of its rows: no intervention, the prompt alone steers
MODES = ("steer", "suppress")  # steer toward the concept, or against it where the prompt asks for it
RECORDED = {"mode": MODES[0], "side_effects": False, "gate": None}  # in meta.json only where a run's differs from these
SIDE_EFFECT = "kl_neutral"  # the side-effect column of the rows and CSVs (--side_effects true)
CAPABILITY = "capability_delta"  # the second side-effect column: SyntaxGym accuracy steered − unsteered
SIDE_EFFECTS = (SIDE_EFFECT, CAPABILITY)  # the side-effect columns, in their CSV order
# AxBench's steering prompt (axbench/utils/dataset.py, T_PROMPT_STEERING) with the concept in it
PROMPT_TEMPLATE = (
    "You must answer the question with content related to {concept} even if it is not related to the "
    "question or it does not make sense."
)


# --- plan: validate everything before generating --------------------------------------------------
@dataclass
class SteerPlan:
    """A checked steering evaluation: which artifact (or the prompt baseline) runs which concepts at
    which factors, on which LM, with which instructions and generation settings, judged by whom,
    written where."""

    lm: str
    placement: LoadOptions
    cells_of: dict  # LoadedArtifact or PromptBaseline -> the concepts of it to evaluate
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
    mode: str = "steer"  # one of MODES
    neutral: list[str] | None = None  # the neutral prompts of kl_neutral (None: no side effects measured)
    suites: list[Suite] | None = None  # the SyntaxGym suites of capability_delta (None: not measured)
    gate: bool | float | None = None  # conditional steering (`inference.gate`; None: the edit at every token)


@dataclass(frozen=True)
class PromptBaseline:
    """AxBench's prompt baseline (`PromptSteering`, axbench/models/prompt.py): no artifact, the LM
    unedited; `concepts` is the concept set it draws from (a concept's id is its index)."""

    concepts: tuple[str, ...]


def prompt_baseline_input(concept: str, instruction: str) -> str:
    """The user turn of the prompt baseline, as AxBench's `SteeringDatasetFactory.create_eval_df`
    builds it (axbench/utils/dataset.py): " " + the steering prompt (`PROMPT_TEMPLATE` with the
    concept) + "\n\nQuestion: " + the instruction; the LM's chat template is put around it when
    it is generated, as around any instruction."""
    return f" {PROMPT_TEMPLATE.format(concept=concept)}\n\nQuestion: {instruction}"


def load_instructions(path: str | None) -> list[str]:
    """Steering instructions: a JSON list / text file (one per line), or the AxBench data module's
    (`data/axbench/instructions.json`)."""
    if path:
        text = read_utf8(path)  # a byte-order mark is not part of the first instruction
        items = json.loads(text) if path.endswith(".json") else [line.strip() for line in text.splitlines()]
        return [str(i) for i in items if str(i).strip()]
    return list(builtin_instructions())


def load_artifacts(paths: list[str], trust_remote_code: bool = False) -> list[LoadedArtifact]:
    """Each artifact read (`load_artifact`; a class path a file names is imported only with
    `trust_remote_code`), and refused in one line unless it is applied to an LM on its own and
    edits the LM alone."""
    artifacts = [load_artifact(path, trust_remote_code=trust_remote_code) for path in paths]
    for artifact in artifacts:
        kind = type(artifact.obj).__name__
        if not callable(getattr(artifact.obj, "edits", None)):
            raise ValueError(
                f"{artifact.where} holds a {kind}, which is not applied to an LM on its own; steer takes an "
                "intervention, a concept dictionary or a steering module (LoReFT, LoRA)"
            )
        if not is_source_free(artifact.obj):
            raise ValueError(
                f"{artifact.where} holds a {kind}, an interchange intervention: it needs a source text, and "
                "the steering evaluation has none; steer takes artifacts that edit the LM alone (a concept "
                "dictionary, LoReFT, LoRA, a steering intervention)"
            )
    return artifacts


def artifact_method(artifact: LoadedArtifact) -> str:
    """The method its config (or the object) records, else its class name."""
    return artifact.config.get("method") or getattr(artifact.obj, "method", None) or type(artifact.obj).__name__


def source_method(source: LoadedArtifact | PromptBaseline) -> str:
    """The method column of a cell source's rows: PROMPT for the prompt baseline, else `artifact_method`."""
    return PROMPT if isinstance(source, PromptBaseline) else artifact_method(source)


def artifact_concepts(artifact: LoadedArtifact) -> tuple[list[str], bool]:
    """(the concepts it steers toward, whether `apply` is told which): a dictionary's names
    (told), or the one concept its config names (its edit is that concept's); [] when it names none."""
    if artifact.concepts:
        return artifact.concepts, True
    concept = artifact.config.get("concept")
    return ([concept] if isinstance(concept, str) and concept else []), False


def pick_concepts(value, valid: list[str]) -> list[str]:
    """The concepts named by `value` (names, ids, or None / "all" for every one), in its order."""
    if value in (None, "all", ["all"]):
        return list(valid)
    chosen = []
    for item in [value] if isinstance(value, (str, int)) else list(value):
        if isinstance(item, int) or (isinstance(item, str) and item.isdigit() and item not in valid):
            index = int(item)
            if not 0 <= index < len(valid):
                raise ValueError(
                    f"concept id {index} is out of range: there are {len(valid)} concepts (0..{len(valid) - 1})"
                )
            chosen.append(valid[index])
        elif item in valid:
            chosen.append(item)
        else:
            raise ValueError(f"Unknown concept {item!r}; valid: {', '.join(valid)} (names or ids, or 'all')")
    return chosen


def artifact_paths(artifact, dictionary, checkpoint) -> list[str]:
    """The artifacts to steer with, a list: --artifact, or its spellings --dictionary and
    --checkpoint (exactly one of the three; each one path or a list)."""
    given = [value for value in (artifact, dictionary, checkpoint) if value is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --artifact, --dictionary or --checkpoint (a path or hub id, or a list)")
    paths = [given[0]] if isinstance(given[0], str) else list(given[0])
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"--artifact={given[0]!r} must be a path or hub id, or a non-empty list of them")
    return paths


def check_method(method, artifact, dictionary, checkpoint, concept_dir) -> None:
    """`method`: None (steer with the artifacts given) or PROMPT (no artifact); `concept_dir` only
    with PROMPT (an artifact's concepts are its own). A ValueError line otherwise."""
    options = {"artifact": artifact, "dictionary": dictionary, "checkpoint": checkpoint}
    given = [name for name, value in options.items() if value is not None]
    if method is None:
        if concept_dir is not None:
            raise ValueError(
                f"--concept_dir={concept_dir!r} is for --method prompt; an artifact is judged on its own concepts"
            )
        return
    if method != PROMPT:
        raise ValueError(
            f"--method={method!r} is not a steering method; allowed: {PROMPT!r} (AxBench's prompt baseline, "
            "no artifact), or no --method with --artifact"
        )
    if given:
        raise ValueError(
            f"--method {PROMPT} takes no artifact (the prompt alone steers), but --{given[0]} is given; "
            "drop it, or drop --method to steer with the artifact"
        )


def prompt_cells(concepts, concept_dir: str | None, lm: str | None) -> tuple[str, dict]:
    """(the LM, {PromptBaseline: the chosen concepts}) of the prompt baseline: the concepts (names,
    ids or 'all') of the concept directory's set (None: the built-in set); the LM must be named,
    and its config is read (not its weights)."""
    if lm is None:
        raise ValueError(f"--method {PROMPT} needs --lm, the LM to prompt (no artifact names one)")
    names = load_concepts(concept_dir).concepts
    load_config(lm)  # an LM that is not there: refused before the judge is built
    return lm, {PromptBaseline(tuple(names)): pick_concepts(concepts, names)}


def check_mode(mode, side_effects) -> None:
    """`mode` one of MODES and `side_effects` a bool; a ValueError line otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"--mode={mode!r} is not a steering mode; allowed: 'steer' (toward the concept) or 'suppress' "
            "(the prompt asks for the concept and the artifact steers against it)"
        )
    if not isinstance(side_effects, bool):
        raise ValueError(f"--side_effects={side_effects!r} must be true or false")


def applied_factors(factors: list[float], mode: str) -> list[float]:
    """The factors as applied and written in the rows: as given in `steer` mode, negated in
    `suppress` mode (AxBench's `AlpacaEval_Suppress` applies −f for every steering factor f)."""
    return [0.0 - f for f in factors] if mode == "suppress" else factors


def check_settings(factors, instructions, max_new_tokens, temperature, batch_size, top_k):
    """The factors (default FACTORS), once the settings that need no file are checked."""
    factors = list(FACTORS if factors is None else factors)
    if not factors or any(not isinstance(f, (int, float)) or f < 0 for f in factors):
        raise ValueError(f"factors={factors!r} must be a non-empty list of non-negative numbers")
    if not isinstance(instructions, int) or instructions < 2:
        raise ValueError(f"instructions={instructions!r} must be an integer >= 2 (half select, half report)")
    if max_new_tokens < 1 or temperature < 0 or batch_size < 1 or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}, temperature={temperature}, batch_size={batch_size}, top_k={top_k!r}: "
            "need max_new_tokens >= 1, temperature >= 0, batch_size >= 1, top_k an integer >= 0"
        )
    return factors


def steered_lm(artifacts: list[LoadedArtifact], lm: str | None) -> str:
    """The LM to steer: `lm`, or the one the artifacts' configs name; it must match them, in name
    and (where an artifact records it) hidden size. Reads the LM's config only."""
    models = {a.model for a in artifacts if a.model}
    if lm is None:
        if len(models) != 1:
            raise ValueError(f"cannot tell which LM to steer (the cards name {sorted(models) or 'none'}); pass --lm")
        lm = models.pop()
    elif models - {lm}:
        raise ValueError(f"--lm {lm!r} differs from the model the steering weights were trained on: {sorted(models)}")
    d = hidden_size(load_config(lm))
    for artifact in artifacts:
        width = getattr(artifact.obj, "hidden_size", None)
        if isinstance(width, int) and not isinstance(width, bool) and width != d:
            raise ValueError(f"{artifact.where} has hidden size {width}, but {lm!r} has {d}")
    return lm


def concept_cells(concepts, artifacts: list[LoadedArtifact]) -> dict:
    """{artifact: its concepts to evaluate}: the chosen ones (names or ids among all the
    artifacts' concepts, or 'all') of each artifact. Each artifact must name a concept (a
    dictionary's, or the one its config records); one artifact that names none (an intervention
    trained on another benchmark) is judged on the one concept name `concepts` gives. No concept
    may be steered by two."""
    if len(artifacts) == 1 and not artifact_concepts(artifacts[0])[0] and _one_name(concepts):
        artifacts[0].config["concept"] = concepts  # what its edit is judged on
    named = {artifact: artifact_concepts(artifact)[0] for artifact in artifacts}
    if unnamed := [a.where for a, names in named.items() if not names]:
        raise ValueError(
            f"{unnamed[0]} names no concept to steer toward; give the one it is judged on (--concepts NAME, "
            "with one artifact) or retrain with model.concept set"
        )
    every = [c for names in named.values() for c in names]
    if twice := sorted(c for c, n in Counter(every).items() if n > 1):
        raise ValueError(f"concept {twice[0]!r} is steered by two artifacts; evaluate them in separate runs (--out)")
    wanted = pick_concepts(concepts, every)
    cells_of = {}
    for artifact, names in named.items():
        own = set(names)
        if chosen := [c for c in wanted if c in own]:
            cells_of[artifact] = chosen
    return cells_of


def _one_name(concepts) -> bool:
    """Whether `concepts` is one concept name (not 'all', not an id)."""
    return isinstance(concepts, str) and bool(concepts.strip()) and concepts != "all" and not concepts.isdigit()


def ready_judge(judge: dict | Judge | None, concepts: list[str] = ()) -> Judge:
    """The judge (default the `offline` backend: proxies under a reference LM, no endpoint),
    checked to answer (e.g. the endpoint is down) and prepared for the `concepts` (the offline
    judge refuses one whose detector is unreliable), before generating."""
    if judge is None:
        judge = {"backend": "offline"}
    judge = judge if isinstance(judge, Judge) else make_judge(**judge)
    judge.check()
    judge.prepare(list(concepts))
    return judge


def cell_sources(method, paths, trust_remote_code, lm, concepts, concept_dir, factors, mode, gate=None) -> tuple:
    """(the LM, {source: its concepts}, the factors as applied, the data files to digest, the
    method of meta.json, the gate checked by `steer_gate`): the prompt baseline's (factor 0, the
    concept set's metadata), or the artifacts' (read and checked; `applied_factors`)."""
    if method == PROMPT:
        lm, cells_of = prompt_cells(concepts, concept_dir, lm)
        metadata = Path(concept_dir or BUILTIN_DIR) / "metadata.jsonl"
        return lm, cells_of, [PROMPT_FACTOR], {"concept_metadata": metadata}, PROMPT, steer_gate(gate, cells_of)
    artifacts = load_artifacts(paths, trust_remote_code)
    lm = steered_lm(artifacts, lm)
    methods = "+".join(sorted({artifact_method(a) for a in artifacts}))
    cells_of = concept_cells(concepts, artifacts)
    return lm, cells_of, applied_factors(factors, mode), {}, methods, steer_gate(gate, cells_of)


def instruction_pool(instruction_file: str | None, instructions: int) -> list[str]:
    """The instructions to draw from (`load_instructions`), at least `instructions` of them."""
    pool = load_instructions(instruction_file)
    if len(pool) < instructions:
        raise ValueError(f"instructions={instructions} but only {len(pool)} instructions are available")
    return pool


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
    method=None,
    concept_dir=None,
    mode="steer",
    side_effects=False,
    capability_suites=None,
    gate=None,
) -> SteerPlan:
    """Check every argument, read the artifacts and suites (an interchange, or a gate one cannot take, is
    refused), draw up the cells and claim DIR/meta.json, all before the LM loads; `run_steer_eval`'s arguments."""
    placement = LoadOptions(device_map, quantization)
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    check_mode(mode, side_effects)
    side_files, suites = side_effect_inputs(capability_suites, side_effects)
    check_method(method, artifact, dictionary, checkpoint, concept_dir)
    paths = [] if method == PROMPT else artifact_paths(artifact, dictionary, checkpoint)
    factors = check_settings(factors, instructions, max_new_tokens, temperature, batch_size, top_k)
    lm, cells_of, factors, files, methods, gate = cell_sources(
        method, paths, trust_remote_code, lm, concepts, concept_dir, factors, mode, gate
    )
    pool, out = instruction_pool(instruction_file, instructions), Path(out)
    files |= {"instruction_file": instruction_file or BUILTIN_DIR / "instructions.json", **side_files}
    digests = unchanged_files(out / "meta.json", files)
    check_recorded(out, {"mode": mode, "side_effects": side_effects, "gate": gate}, RECORDED, "a steering evaluation")
    judge = ready_judge(judge, [c for names in cells_of.values() for c in names])
    meta = {
        "lm": lm,
        "method": methods,
        "artifact": paths,
        **({"concept_dir": concept_dir} if method == PROMPT else {}),
        "instructions": instructions,
        "instruction_file": instruction_file,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "seed": seed,
        **({"mode": mode} if mode != "steer" else {}),
        **({"side_effects": True, "capability_suites": [s.name for s in suites]} if side_effects else {}),
        **({"gate": gate} if gate is not None else {}),
        FILE_DIGESTS: digests,  # a resume on an instruction file changed in place is refused, naming it
    }
    claim_out_dir(out, meta, what="a steering evaluation", ignore=(FILE_DIGESTS,))
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
        mode,
        builtin_instructions(NEUTRAL_PROMPTS) if side_effects else None,
        suites or None,
        gate,
    )


def steer_gate(gate, cells_of: dict) -> bool | float | None:
    """--gate checked against the cells' sources before the LM loads (`check_gate`): None, True or
    a threshold in range; the prompt baseline, which has no edit, is refused with a gate."""
    if gate is None or gate is False:
        return None
    if any(isinstance(source, PromptBaseline) for source in cells_of):
        raise ValueError(f"--gate={json.dumps(gate)}: the prompt baseline has no edit to gate; drop --gate")
    return check_gate(gate, list(cells_of), "--gate")


# --- run: generate and judge, one (concept, factor) cell at a time --------------------------------
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


def _run_cell(plan: SteerPlan, model, tokenizer, source, concept: str, factor: float, baseline=None) -> list[dict]:
    """The rows of one cell: N instructions drawn for the concept (seeded by concept), generated
    with the artifact applied at the factor (`apply`), or, for the prompt baseline, generated by
    the LM unedited from `prompt_baseline_input` (the row's "prompt"; in `suppress` mode every
    source's); judged on the instruction; the first N//2 are the "select" half. With side effects
    (`baseline`: the `Unsteered` references) each row carries the cell's kl_neutral and capability_delta."""
    chosen = random.Random(f"{plan.seed}:{concept}").sample(plan.pool, plan.instructions)
    sampling = {"seed": zlib.crc32(f"{plan.seed}:{concept}:{factor}".encode()), "top_k": plan.top_k}
    settings = (plan.max_new_tokens, plan.temperature, plan.batch_size)
    prompts = None
    if isinstance(source, PromptBaseline) or plan.mode == "suppress":
        prompts = [prompt_baseline_input(concept, text) for text in chosen]
    if isinstance(source, PromptBaseline):
        names = list(source.concepts)
        responses = generate(model, tokenizer, prompts, *settings, **sampling)
    else:
        names, told = artifact_concepts(source)
        with apply(
            model, source, tokenizer=tokenizer, concept=concept if told else None, factor=factor, gate=plan.gate
        ) as steered:
            responses = generate(steered, tokenizer, prompts or chosen, *settings, **sampling)
    scores = _judged(plan.judge, [concept] * len(chosen), chosen, responses)
    side = {}
    if plan.neutral:
        side[SIDE_EFFECT] = cell_side_effect(
            model, tokenizer, source, concept, factor, plan.neutral, baseline.log_probs, plan.gate
        )
        side[CAPABILITY] = cell_capability_delta(
            model, tokenizer, source, concept, factor, plan.suites, baseline.accuracy, plan.gate
        )
    select = plan.instructions // 2
    return [
        {
            "method": source_method(source),
            "mode": plan.mode,
            "concept": concept,
            "concept_id": names.index(concept),
            "factor": float(factor),
            "half": "select" if k < select else "report",
            "instruction_index": k,
            "instruction": text,
            **({"prompt": prompts[k]} if prompts else {}),
            "response": response,
            **mode_scores(score.as_dict(), plan.mode),
            **side,
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


# --- side effects: kl_neutral on neutral prompts, capability_delta on SyntaxGym suites ------------
@contextmanager
def cell_edit(model, tokenizer, source, concept: str, factor: float, gate=None):
    """The LM with one cell's edit inside the block, as its generations have it: `apply` of the
    artifact at the cell's concept (where the artifact is told one), factor and gate."""
    told = artifact_concepts(source)[1]
    concept = concept if told else None
    with apply(model, source, tokenizer=tokenizer, concept=concept, factor=factor, gate=gate) as steered:
        yield steered


def cell_side_effect(model, tokenizer, source, concept: str, factor: float, neutral, baseline, gate=None) -> float:
    """kl_neutral of one cell on the `neutral` prompts (`baseline`: their unsteered log-probs): the
    edit its generations have (`apply` at the cell's concept, factor and `gate`); the prompt
    baseline has no edit, so 0."""
    if isinstance(source, PromptBaseline):
        return 0.0
    with cell_edit(model, tokenizer, source, concept, factor, gate) as steered:
        return kl_neutral(baseline, neutral_log_probs(steered, tokenizer, neutral))


def cell_capability_delta(
    model, tokenizer, source, concept: str, factor: float, suites, unsteered: float, gate=None
) -> float:
    """capability_delta of one cell: the mean suite accuracy (`suite_accuracy`) of the LM with the
    cell's edit (`cell_edit`, as its generations and kl_neutral) minus `unsteered`, the LM's own:

        capability_delta = 1/S · Σ_s acc_s(steered) − 1/S · Σ_s acc_s(unsteered)

    0 exactly where the edit changes nothing (factor 0); the prompt baseline has no edit, so 0."""
    if isinstance(source, PromptBaseline):
        return 0.0
    with cell_edit(model, tokenizer, source, concept, factor, gate) as steered:
        return suite_accuracy(steered, tokenizer, suites) - unsteered


def run_cells(plan: SteerPlan) -> list[dict]:
    """Every row of DIR/generations.jsonl: those already there, then each cell not yet complete,
    generated, judged and appended (flushed) one cell at a time."""
    path = plan.out / "generations.jsonl"
    rows = keep_whole_cells(path, read_generations(path), plan.instructions)
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
    baseline = None
    if plan.neutral and todo:
        baseline = Unsteered(
            neutral_log_probs(model, tokenizer, plan.neutral), suite_accuracy(model, tokenizer, plan.suites)
        )
    with path.open("a") as sink, Progress(len(work), "steering cells", "cell", len(work) - len(todo)) as shown:
        for source, concept, factor in todo:
            shown.note(f"{concept}, factor {factor}")
            cell = _run_cell(plan, model, tokenizer, source, concept, factor, baseline)
            sink.write("".join(json.dumps(r) + "\n" for r in cell))
            sink.flush()
            rows += cell
            shown.update()
    return rows


# --- report: resume from generations.jsonl; factors.csv, summary.csv, steering.png ----------------
def choose_and_report(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(summary rows, factor rows) from judged generations of one method.

    Per concept: mean scores (and each of SIDE_EFFECTS the rows carry) per (factor, half); the
    factor with the best mean overall on the "select" half (ties: the smaller |factor|) is chosen,
    and its "report" half is the summary. A row of `suppress` generations carries their mode."""
    cells = defaultdict(list)
    for row in rows:
        cells[(row["method"], row["concept"], float(row["factor"]), row["half"])].append(row)
    factor_rows = []
    for (method, concept, factor, half), group in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        measured = [*SCORES, *(s for s in SIDE_EFFECTS if all(s in r for r in group))]
        means = {s: float(np.mean([float(r[s]) for r in group])) for s in measured}
        mode = group[0].get("mode", MODES[0])
        factor_rows.append(
            {"method": method, **({"mode": mode} if mode != MODES[0] else {}), "concept": concept, "factor": factor}
            | {"half": half, **means, "n": len(group)}
        )
    summary = []
    by_concept = defaultdict(dict)
    for row in factor_rows:
        by_concept[(row["method"], row["concept"])][(row["factor"], row["half"])] = row
    for (method, concept), table in by_concept.items():
        selectable = sorted(f for f, h in table if h == "select")
        if not selectable:
            continue
        best = max(selectable, key=lambda f: (table[(f, "select")]["overall"], -abs(f)))
        report = table.get((best, "report"))
        if report is not None:
            measured = {s: report[s] for s in (*SCORES, *SIDE_EFFECTS) if s in report}
            moded = {"mode": report["mode"]} if "mode" in report else {}
            summary.append({"method": method, **moded, "concept": concept, "factor": best, **measured})
    return summary, factor_rows


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    """The rows as CSV with these columns (other keys are left out), written whole."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, text.getvalue())


def plot_factors(factor_rows: list[dict], path: Path) -> Path:
    """`factor_figure` written whole, or `plots.FigureNotWritten`."""
    return save_figure(factor_figure(factor_rows), path, dpi=110)


def factor_figure(factor_rows: list[dict]):
    """Mean over concepts of each score against the factor, one line per half (4 panels); with
    side effects (rows carrying capability_delta) a second row of two Pareto panels
    (`pareto_panel`): concept score against fluency and against capability_delta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pareto = any(CAPABILITY in row for row in factor_rows)
    fig = plt.figure(figsize=(14, 6.8 if pareto else 3.2))
    grid = fig.add_gridspec(2 if pareto else 1, 4)
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[0, k], sharex=axes[0]) for k in range(1, 4)]
    for ax, score in zip(axes, SCORES):
        for half, style in (("select", "o-"), ("report", "s--")):
            by_factor = defaultdict(list)
            for row in factor_rows:
                if row["half"] == half:
                    by_factor[row["factor"]].append(row[score])
            factors = sorted(by_factor)
            ax.plot(factors, [np.mean(by_factor[f]) for f in factors], style, label=half)
        ax.set_title(score)
        ax.set_xlabel("steering factor")
        ax.set_ylim(-0.05, 2.05)
    axes[0].set_ylabel("judge score (0-2), mean over concepts")
    axes[-1].legend()
    if pareto:
        points = pareto_points(factor_rows, ("concept_score", "fluency_score", CAPABILITY))
        pareto_panel(fig.add_subplot(grid[1, :2]), points, "fluency_score")
        pareto_panel(fig.add_subplot(grid[1, 2:]), points, CAPABILITY)
    fig.tight_layout()
    return fig


def read_generations(path: Path) -> list[dict]:
    """The whole lines of DIR/generations.jsonl. A line cut by an interruption (and whatever follows
    it) is reported and cut off the file, so the redone cell is appended after a whole line."""
    if not path.is_file():
        return []
    rows, kept = [], 0
    data = path.read_bytes()
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            rows.append(json.loads(line))
        except ValueError:
            warnings.warn(
                f"{path}: line {number} is incomplete or damaged; it and what follows are dropped and their "
                "cells redone",
                stacklevel=2,
            )
            with path.open("r+b") as f:
                f.truncate(kept)
            break
        kept += len(line)
    return rows


def keep_whole_cells(path: Path, rows: list[dict], instructions: int) -> list[dict]:
    """The rows of the (concept, factor) cells that have all `instructions` rows. A cell with fewer
    (its last lines cut by an interruption) is redone whole, so its rows are dropped here and the
    file rewritten (atomically) without them: no row is ever written twice."""
    count = Counter((row["concept"], float(row["factor"])) for row in rows)
    kept = [row for row in rows if count[(row["concept"], float(row["factor"]))] >= instructions]
    if len(kept) < len(rows):
        warnings.warn(
            f"{path}: {len(rows) - len(kept)} rows of cells cut short are dropped; those cells are redone",
            stacklevel=2,
        )
        write_atomically(path, "".join(json.dumps(row) + "\n" for row in kept))
    return kept


def write_report(out: Path, rows: list[dict], cells: set[tuple[str, float]]) -> list[dict]:
    """Choose and report from the rows of the (concept, factor) `cells` of this run (others in the
    file are left out): DIR/factors.csv and DIR/summary.csv (a `mode` column after `method` in
    `suppress` mode, last `kl_neutral` and `capability_delta` columns where the rows carry them), then
    DIR/steering.png (a figure not written is `plots.FigureNotWritten`, the CSVs kept); the summary rows."""
    rows = [r for r in rows if (r["concept"], float(r["factor"])) in cells]
    summary, factor_rows = choose_and_report(rows)
    moded = ["mode"] if any("mode" in r for r in factor_rows) else []
    measured = [s for s in SIDE_EFFECTS if any(s in r for r in factor_rows)]
    write_csv(out / "factors.csv", factor_rows, [FACTOR_COLUMNS[0], *moded, *FACTOR_COLUMNS[1:], *measured])
    write_csv(out / "summary.csv", summary, [SUMMARY_COLUMNS[0], *moded, *SUMMARY_COLUMNS[1:], *measured])
    plot_factors(factor_rows, out / "steering.png")
    return summary


# --- the evaluation: plan, run, report ------------------------------------------------------------
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
    method: str | None = None,
    concept_dir: str | None = None,
    mode: str = "steer",
    side_effects: bool = False,
    capability_suites: str | None = None,
    gate: bool | float | None = None,
) -> list[dict]:
    """Run (or resume) the steering evaluation; returns the summary rows.

    Args:
        artifact: what steers, one or a list: any artifact `lit-interventions generate` applies (a
            concept dictionary, an intervention that edits the LM alone, a LoReFT / LoRA run
            directory or .ckpt, a hub id). A dictionary is evaluated on its concepts, any other
            artifact on the one concept its config names.
        dictionary, checkpoint: other spellings of `artifact` (give exactly one of the three).
        method: 'prompt' for AxBench's prompt baseline, which takes no artifact: the concept asked
            for in the prompt (`prompt_baseline_input`), the LM unedited, one generation per
            instruction (factor column 0); None (default) steers with the artifact.
        concept_dir: the prompt baseline's concept set, a directory in the AxBench layout (its
            metadata.jsonl; default: the built-in concepts).
        lm: the LM to steer (default: the model the artifacts were trained on; must match it;
            the prompt baseline needs it).
        concepts: names or ids among the artifacts' concepts (the prompt baseline: the concept
            set's), or 'all'.
        factors: steering factors (default the paper's 14), each run for every artifact: a
            dictionary's α = factor × max activation; any other edit f* is scaled, h + factor·(f* − h).
            Not used by the prompt baseline.
        instructions: N instructions per concept: the first N//2 choose the factor, the rest report.
        instruction_file: a JSON list or a text file of instructions (default: the AxBench data module's).
        max_new_tokens, temperature, top_k: generation (AxBench: 128, 1.0 and transformers' default
            top_k 50; top_k 0 samples from every token).
        batch_size: generation batch size.
        judge: the judge config, {backend: offline|openai|local, ...options} (see metrics/judge.py;
            default offline); `compare: {backend: ...}` scores beside it with a second judge.
        out: output directory. seed: instruction sampling and generation seed.
        device_map, quantization: a steered LM larger than one device (`lit_interventions.core.sharding`):
            e.g. "auto" and "4bit".
        trust_remote_code: import a class path an artifact names that is not registered (only for
            artifacts whose source you trust: importing runs its code).
        mode: 'steer' (default: toward the concept) or 'suppress' (AxBench's suppression: the
            prompt asks for the concept, `prompt_baseline_input`, and each factor f is applied as −f).
        side_effects: measure each cell's side effects with its edit: kl_neutral (`side_effects.kl_neutral`) on
            the built-in neutral prompts and capability_delta (`cell_capability_delta`) on SyntaxGym
            suites; `kl_neutral` and `capability_delta` columns in factors.csv and summary.csv, and
            two Pareto panels in steering.png.
        capability_suites: the suites of capability_delta, a directory of SyntaxGym *.json or one
            suite file (default: our built-in three, `data/syntaxgym/`); only with side_effects.
        gate: conditional steering of a concept dictionary (`inference.gate`): true (τ per concept
            chosen on the eval split), a threshold τ, or None (default: the edit at every token).
    """
    plan = plan_steer_eval(**locals())  # every argument above, by name: nothing else is bound yet
    rows = run_cells(plan)
    cells = {(c, float(f)) for names in plan.cells_of.values() for c in names for f in plan.factors}
    return write_report(plan.out, rows, cells)


def main(args=None) -> None:
    """`lit-interventions steer`: the evaluation from the command line (a --judge dict), then the
    mean overall, and with a second judge (`compare`) both judges side by side."""
    given = {}

    def customize(parser):
        parser.add_function_arguments(run_steer_eval, as_positional=False, skip={"judge"})
        parser.add_argument(
            "--judge",
            type=dict,
            default={"backend": "offline"},
            help="judge backend and options: {backend: offline} (default: proxies under gemma-3-270m, no endpoint), "
            "{backend: openai, base_url: ..., model: ..., api_key_env: ...}; add compare: {backend: ...} to score "
            "beside it with a second judge (both reported, with their Spearman rank correlation)",
        )

    def evaluate(**kwargs):
        given.update(kwargs)
        return run_steer_eval(**kwargs)

    with report_figures():  # steering.png not written: one line, the CSVs kept
        summary = run_cli(evaluate, __doc__, args, customize, errors=(ValueError, FileNotFoundError, ConnectionError))
    if summary:
        print(f"mean overall over {len(summary)} concepts: {np.mean([r['overall'] for r in summary]):.3f}")
    if isinstance(given.get("judge"), dict) and isinstance(given["judge"].get("compare"), dict):
        names = (given["judge"].get("backend", "openai"), given["judge"]["compare"].get("backend", "openai"))
        print("\n".join(agreement_lines(read_generations(Path(given["out"]) / "generations.jsonl"), names)))
