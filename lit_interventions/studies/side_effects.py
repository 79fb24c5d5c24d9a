"""The side effects of a steering edit, on prompts and a benchmark unrelated to the concept, and
the trade-off of a concept score against them (`lit-interventions steer --side_effects true`).

    kl_neutral        = 1/N · Σ_i 1/T_i · Σ_t KL(p(·|x_i,≤t) ‖ q(·|x_i,≤t))   (p unsteered, q steered)
    capability_delta  = 1/S · Σ_s acc_s(steered) − 1/S · Σ_s acc_s(unsteered)  (SyntaxGym suites s)

Each measure is computed here on an LM as given; the steering study applies the cell's edit
around it (`steer.cell_edit`). `pareto_points`, `pareto_front` and `pareto_panel` draw the concept
score against fluency or capability_delta, one point per (method, factor).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lit_interventions.core.sharding import input_device
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR
from lit_interventions.studies.syntaxgym.score import evaluate_suite_forward
from lit_interventions.studies.syntaxgym.suites import Suite, load_suite, suite_paths

# our own 3 suites in the SyntaxGym format (agreement across a PP, reflexive number, NPI `ever`)
CAPABILITY_SUITES = BUILTIN_DIR.parent / "syntaxgym"
SUITE_BATCH = 16  # SyntaxGym sentences per forward pass


NEUTRAL_PROMPTS = BUILTIN_DIR / "neutral_prompts.json"  # our own 20 neutral sentences of kl_neutral


def side_effect_inputs(capability_suites, side_effects: bool) -> tuple[dict, list[Suite]]:
    """(the data files to digest, the SyntaxGym suites of capability_delta): with side effects the
    neutral prompts and the suites of `capability_suites` (`side_effects.read_suites`; None: the
    built-in ones), else nothing, and the option refused in one line."""
    if not side_effects:
        if capability_suites is not None:
            raise ValueError(f"--capability_suites={capability_suites!r} is measured only with --side_effects true")
        return {}, []
    suites = read_suites(capability_suites)
    files = {"neutral_prompts": NEUTRAL_PROMPTS} | {f"capability_suite:{path.name}": path for path in suites}
    return files, list(suites.values())


@dataclass(frozen=True)
class Unsteered:
    """The references of the side effects, from the unsteered LM once a run: the neutral prompts'
    log-probs (`neutral_log_probs`) and the mean suite accuracy (`suite_accuracy`)."""

    log_probs: list[torch.Tensor]
    accuracy: float


# --- kl_neutral ----------------------------------------------------------------------------------
def neutral_log_probs(model, tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """log p(· | x_1..x_t) at every position t = 1..T of each prompt: the prompt tokenized as its
    tokenizer does by default (its special tokens, e.g. BOS, included; no chat template), one
    forward pass a prompt (no padding); float32 [T, vocabulary] tensors on the CPU."""
    device, out = input_device(model), []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)
            out.append(torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1).cpu())
    return out


def kl_neutral(unsteered: list[torch.Tensor], steered: list[torch.Tensor]) -> float:
    """The mean KL divergence of the unsteered next-token distribution p from the steered q, over
    the N neutral prompts, each averaged over every one of its T_i positions (`neutral_log_probs`):

        kl_neutral = 1/N · Σ_i 1/T_i · Σ_{t=1..T_i} KL(p(·|x_i,≤t) ‖ q(·|x_i,≤t)),
        KL(p ‖ q) = Σ_v p(v) · (log p(v) − log q(v))      (nats; in float64)

    0 exactly where the edit changes nothing (factor 0)."""
    per_prompt = [
        torch.nn.functional.kl_div(q.double(), p.double(), reduction="none", log_target=True).sum(-1).mean()
        for p, q in zip(unsteered, steered)
    ]
    return float(torch.stack(per_prompt).mean())


# --- capability_delta ----------------------------------------------------------------------------
def read_suites(where: str | Path | None) -> dict[Path, Suite]:
    """{file: suite} of capability_delta, each read and checked (`syntaxgym.suites.load_suite`):
    `where` is a directory of SyntaxGym *.json suites or one suite file (None: CAPABILITY_SUITES).
    A FileNotFoundError or ValueError line naming `--capability_suites` otherwise."""
    path = CAPABILITY_SUITES if where is None else where
    if not isinstance(path, (str, Path)) or not str(path) or not Path(path).exists():
        raise FileNotFoundError(
            f"--capability_suites={where!r} not found: give a directory of SyntaxGym *.json suites or one suite "
            "file (default: the built-in suites)"
        )
    return {file: load_suite(file) for file in suite_paths([str(path)])}


def suite_accuracy(model, tokenizer, suites: list[Suite]) -> float:
    """The mean over `suites` of SyntaxGym suite accuracy (an item is correct when every prediction
    holds on its region surprisals; a suite's accuracy is the mean over its items), every suite
    counted; scored through the LM's own forward (`syntaxgym.score.evaluate_suite_forward`), so
    an LM under `apply` is scored with its edit."""
    return float(np.mean([evaluate_suite_forward(s, model, tokenizer, SUITE_BATCH).accuracy for s in suites]))


# --- the Pareto panels of steering.png -----------------------------------------------------------
def pareto_points(factor_rows: list[dict], measures: tuple[str, ...]) -> list[dict]:
    """One point per (method, mode, factor) of factors.csv's rows: each of `measures`, the mean over
    that factor's rows (every concept, both halves)."""
    groups = defaultdict(list)
    for row in factor_rows:
        groups[(row["method"], row.get("mode", "steer"), row["factor"])].append(row)
    return [
        {"method": method, "mode": mode, "factor": factor}
        | {m: float(np.mean([float(r[m]) for r in rows])) for m in measures}
        for (method, mode, factor), rows in sorted(groups.items())
    ]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """The indices of the points (x, y) no other point dominates (both coordinates at least as
    large, one larger): the best trade-offs where larger is better on both axes."""
    return [i for i, (x, y) in enumerate(points) if not any(a >= x and b >= y and (a > x or b > y) for a, b in points)]


def pareto_panel(ax, points: list[dict], other: str, score: str = "concept_score") -> None:
    """`score` (y) against `other` (x: fluency_score or capability_delta), one point per (method,
    factor) labelled by its factor, and their Pareto front (`pareto_front`: a larger `other` is
    better, and a larger concept score in `steer` mode, a smaller one in `suppress` mode)."""
    for method in sorted({p["method"] for p in points}):
        mine = [p for p in points if p["method"] == method]
        ax.scatter([p[other] for p in mine], [p[score] for p in mine], label=method)
        for p in mine:
            ax.annotate(f"{p['factor']:g}", (p[other], p[score]), xytext=(3, 3), textcoords="offset points")
    sign = [-1.0 if p["mode"] == "suppress" else 1.0 for p in points]
    front = [points[i] for i in pareto_front([(p[other], s * p[score]) for p, s in zip(points, sign)])]
    front.sort(key=lambda p: p[other])
    ax.plot([p[other] for p in front], [p[score] for p in front], ":x", color="gray", label="Pareto front")
    ax.set_title(f"{score} against {other} (labels: factor)")
    ax.set_xlabel(f"{other} (mean over concepts)")
    ax.set_ylabel(f"{score} (0-2, mean over concepts)")
    ax.legend(fontsize=8)
