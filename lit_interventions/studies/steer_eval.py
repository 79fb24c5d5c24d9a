"""AxBench steering evaluation: steer, generate, judge, choose the factor on one half, report on the other.

    lit-interventions steer --config configs/steer_eval.yaml --dictionary PATH [--out DIR]
    lit-interventions steer --config configs/steer_eval.yaml --checkpoint RUN_DIR

A dictionary steers Φ(h) = h + α·w at every position of its layer, α = factor × (the concept's
max activation) (`Dictionary.steer`). A LoReFT / LoRA checkpoint has no strength: it is run once
(factor 1.0) on its own concept. Per concept, N instructions are drawn (seeded); every
(factor, instruction) is generated (left padding, the LM's chat template) and judged (concept,
instruction relevance, fluency, overall = their harmonic mean). The factor with the best mean
overall on the first half of the instructions is chosen; its scores on the other half are reported.

Writes DIR/generations.jsonl (one line per generation, with the judge's replies), DIR/factors.csv
(every factor × half), DIR/summary.csv (the reported scores per concept) and DIR/steering.png.
A rerun skips the (concept, factor) cells already in generations.jsonl.
"""

from __future__ import annotations

import csv
import json
import random
import warnings
import zlib
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import lit_interventions.datamodules.axbench as axbench
from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.cli.studies import claim_out_dir, run_cli
from lit_interventions.core.lm import hidden_size, load_config, load_lm, load_tokenizer
from lit_interventions.core.sharding import LoadOptions
from lit_interventions.metrics.judge import Judge, chat_prompt, generate_replies, make_judge
from lit_interventions.modules.steering_baselines import load_steering_checkpoint

FACTORS = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0]
SCORES = ["concept_score", "instruct_score", "fluency_score", "overall"]
SUMMARY_COLUMNS = ["method", "concept", "factor", *SCORES]
FACTOR_COLUMNS = ["method", "concept", "factor", "half", *SCORES, "n"]


def load_dictionary(path: str):
    return Dictionary.load(path)


def load_instructions(path: str | None, lm: str) -> list[str]:
    """Steering instructions: a JSON list / text file (one per line), or the AxBench data module's."""
    if path:
        text = Path(path).read_text()
        items = json.loads(text) if path.endswith(".json") else [line.strip() for line in text.splitlines()]
        return [str(i) for i in items if str(i).strip()]
    if hasattr(axbench, "load_instructions"):
        return list(axbench.load_instructions())
    return list(axbench.AxBenchDataModule(lm=lm).instructions)


class DictionarySteerer:
    """Steering with a released dictionary: h + factor·max_act·w at every position (`Dictionary.steer`)."""

    def __init__(self, dictionary):
        self.dictionary = dictionary
        card = getattr(dictionary, "card", None) or {}
        self.method = getattr(dictionary, "method", None) or card.get("method", "dictionary")
        self.model = getattr(dictionary, "model", None) or card.get("model")
        self.concepts = list(dictionary.concepts)
        self.hidden_size = int(dictionary.vectors.shape[-1])
        self.uses_factor = True

    @contextmanager
    def steer(self, lm, concept: str, factor: float):
        with self.dictionary.steer(lm, concept, factor):
            yield lm


class CheckpointSteerer:
    """A trained LoReFT / LoRA module (one concept; the factor is ignored)."""

    def __init__(self, module):
        self.module = module
        self.method = module.method
        self.model = module.hparams.lm
        concept = module.hparams.concept
        self.concepts = [concept] if concept else []
        self.hidden_size = None
        self.uses_factor = False

    @contextmanager
    def steer(self, lm, concept: str, factor: float):
        with self.module.steer(lm) as model:
            yield model


def generate(
    model, tokenizer, instructions: list[str], max_new_tokens: int, temperature: float, batch_size: int, seed: int
) -> list[str]:
    """Sampled replies to each instruction (chat template, left padding), batched."""
    torch.manual_seed(seed)
    templated = bool(getattr(tokenizer, "chat_template", None))
    room = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    texts = [chat_prompt(tokenizer, i) if templated else i for i in instructions]
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    return generate_replies(
        model,
        tokenizer,
        texts,
        max_new_tokens,
        batch_size,
        max_length=max(1, room - max_new_tokens) if room else None,
        **sampling,
    )


def choose_and_report(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(summary rows, factor rows) from judged generations of one method.

    Per concept: mean scores per (factor, half); the factor with the best mean overall on the
    "select" half (ties: the smaller factor) is chosen, and its "report" half is the summary."""
    cells = defaultdict(list)
    for row in rows:
        cells[(row["method"], row["concept"], float(row["factor"]), row["half"])].append(row)
    factor_rows = []
    for (method, concept, factor, half), group in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
        means = {s: float(np.mean([float(r[s]) for r in group])) for s in SCORES}
        factor_rows.append(
            {"method": method, "concept": concept, "factor": factor, "half": half, **means, "n": len(group)}
        )
    summary = []
    by_concept = defaultdict(dict)
    for row in factor_rows:
        by_concept[(row["method"], row["concept"])][(row["factor"], row["half"])] = row
    for (method, concept), table in by_concept.items():
        selectable = sorted(f for f, h in table if h == "select")
        if not selectable:
            continue
        best = max(selectable, key=lambda f: (table[(f, "select")]["overall"], -f))
        report = table.get((best, "report"))
        if report is not None:
            summary.append({"method": method, "concept": concept, "factor": best, **{s: report[s] for s in SCORES}})
    return summary, factor_rows


def _write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot_factors(factor_rows: list[dict], path: Path) -> Path:
    """Mean over concepts of each score against the factor, one line per half."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), sharex=True)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _concepts(value, valid: list[str]) -> list[str]:
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


def _read_generations(path: Path) -> list[dict]:
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


def run_steer_eval(
    dictionary: str | None = None,
    checkpoint: str | list[str] | None = None,
    lm: str | None = None,
    concepts: str | list[str | int] | None = "all",
    factors: list[float] | None = None,
    instructions: int = 10,
    instruction_file: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    batch_size: int = 10,
    judge: dict | Judge | None = None,
    out: str = "runs/steer_eval",
    seed: int = 0,
    device_map: str | int | dict | None = None,
    quantization: str | None = None,
) -> list[dict]:
    """Run (or resume) the steering evaluation; returns the summary rows.

    Args:
        dictionary: a released dictionary (`Dictionary.load`).
        checkpoint: a trained LoReFT / LoRA run directory (or .ckpt), or a list of them (one concept each).
        lm: the LM to steer (default: the dictionary's / checkpoint's model; must match it).
        concepts: names or ids in the dictionary, or 'all'.
        factors: steering factors (default the paper's 14); ignored for checkpoints (one run, 1.0).
        instructions: N instructions per concept: the first N//2 choose the factor, the rest report.
        instruction_file: a JSON list or a text file of instructions (default: the AxBench data module's).
        max_new_tokens, temperature: generation (the paper: 128, 1.0).
        batch_size: generation batch size.
        judge: the judge config, {backend: openai|local, ...options} (see metrics/judge.py).
        out: output directory. seed: instruction sampling and generation seed.
        device_map, quantization: a steered LM larger than one device (`lit_interventions.core.sharding`):
            e.g. "auto" and "4bit".
    """
    # --- validate everything before generating ---
    placement = LoadOptions(device_map, quantization)
    if (dictionary is None) == (checkpoint is None):
        raise ValueError("give exactly one of --dictionary PATH or --checkpoint PATH")
    factors = list(FACTORS if factors is None else factors)
    if not factors or any(not isinstance(f, (int, float)) or f < 0 for f in factors):
        raise ValueError(f"factors={factors!r} must be a non-empty list of non-negative numbers")
    if not isinstance(instructions, int) or instructions < 2:
        raise ValueError(f"instructions={instructions!r} must be an integer >= 2 (half select, half report)")
    if max_new_tokens < 1 or temperature < 0 or batch_size < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}, temperature={temperature}, batch_size={batch_size}: "
            "need max_new_tokens >= 1, temperature >= 0, batch_size >= 1"
        )
    if dictionary is not None:
        steerers = [DictionarySteerer(load_dictionary(dictionary))]
    else:
        paths = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
        steerers = [CheckpointSteerer(load_steering_checkpoint(p, lm)) for p in paths]
        factors = [1.0]
    models = {s.model for s in steerers if s.model}
    if lm is None:
        if len(models) != 1:
            raise ValueError(f"cannot tell which LM to steer (the cards name {sorted(models) or 'none'}); pass --lm")
        lm = models.pop()
    elif models - {lm}:
        raise ValueError(f"--lm {lm!r} differs from the model the steering weights were trained on: {sorted(models)}")
    d = hidden_size(load_config(lm))
    for steerer in steerers:
        if steerer.hidden_size is not None and steerer.hidden_size != d:
            raise ValueError(f"the dictionary has hidden size {steerer.hidden_size}, but {lm!r} has {d}")
    if dictionary is not None:
        cells_of = {steerers[0]: _concepts(concepts, steerers[0].concepts)}
    else:
        wanted = (
            None
            if concepts in (None, "all", ["all"])
            else set(_concepts(concepts, [s.concepts[0] for s in steerers if s.concepts]))
        )
        cells_of = {s: s.concepts for s in steerers if wanted is None or set(s.concepts) & wanted}
        if any(not s.concepts for s in steerers):
            raise ValueError("a checkpoint card names no concept; retrain with model.concept set")
    pool = load_instructions(instruction_file, lm)
    if len(pool) < instructions:
        raise ValueError(f"instructions={instructions} but only {len(pool)} instructions are available")
    if judge is None:
        judge = {"backend": "openai"}
    judge = judge if isinstance(judge, Judge) else make_judge(**judge)
    judge.check()  # e.g. the endpoint is down: stop before generating
    out = Path(out)
    method = steerers[0].method if len(steerers) == 1 else "+".join(sorted({s.method for s in steerers}))
    meta = {
        "lm": lm,
        "method": method,
        "dictionary": dictionary,
        "checkpoint": checkpoint,
        "instructions": instructions,
        "instruction_file": instruction_file,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
    }
    claim_out_dir(out, meta, what="a steering evaluation")

    # --- generate and judge, one (concept, factor) cell at a time ---
    path = out / "generations.jsonl"
    rows = _read_generations(path)
    done = defaultdict(int)
    for row in rows:
        done[(row["concept"], float(row["factor"]))] += 1
    model, tokenizer = load_lm(lm, "float32", placement.device_map, placement.quantization), load_tokenizer(lm)
    select = instructions // 2
    work = [(s, c, f) for s, names in cells_of.items() for c in names for f in factors]
    with path.open("a") as sink:
        for steerer, concept, factor in tqdm(work, desc="steering cells", unit="cell"):
            if done[(concept, float(factor))] >= instructions:
                continue
            ci = steerer.concepts.index(concept)
            chosen = random.Random(f"{seed}:{concept}").sample(pool, instructions)
            with steerer.steer(model, concept, factor) as steered:
                responses = generate(
                    steered,
                    tokenizer,
                    chosen,
                    max_new_tokens,
                    temperature,
                    batch_size,
                    seed=zlib.crc32(f"{seed}:{concept}:{factor}".encode()),
                )
            scores = judge.score([concept] * len(chosen), chosen, responses)
            cell = [
                {
                    "method": steerer.method,
                    "concept": concept,
                    "concept_id": ci,
                    "factor": float(factor),
                    "half": "select" if k < select else "report",
                    "instruction_index": k,
                    "instruction": text,
                    "response": response,
                    **score.as_dict(),
                }
                for k, (text, response, score) in enumerate(zip(chosen, responses, scores))
            ]
            sink.write("".join(json.dumps(r) + "\n" for r in cell))
            sink.flush()
            rows += cell

    # --- choose, report, plot ---
    wanted = {(c, float(f)) for names in cells_of.values() for c in names for f in factors}
    rows = [r for r in rows if (r["concept"], float(r["factor"])) in wanted]
    summary, factor_rows = choose_and_report(rows)
    _write_csv(out / "factors.csv", factor_rows, FACTOR_COLUMNS)
    _write_csv(out / "summary.csv", summary, SUMMARY_COLUMNS)
    plot_factors(factor_rows, out / "steering.png")
    return summary


def main(args=None) -> None:
    def customize(parser):
        parser.add_function_arguments(run_steer_eval, as_positional=False, skip={"judge"})
        parser.add_argument(
            "--judge",
            type=dict,
            default={"backend": "openai"},
            help="judge backend and options, e.g. {backend: openai, base_url: ..., model: ..., api_key_env: ...}",
        )

    summary = run_cli(run_steer_eval, __doc__, args, customize, errors=(ValueError, FileNotFoundError, ConnectionError))
    if summary:
        print(f"mean overall over {len(summary)} concepts: {np.mean([r['overall'] for r in summary]):.3f}")
