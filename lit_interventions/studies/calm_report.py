"""The CALM study's report: a results row per task × method × property, a summary row per task ×
method (competence, the baselines, targeted success, collateral damage, the LM's accuracy), the
run's config, and the files DIR/results.csv, DIR/summary.csv and DIR/summary.json."""

from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from pathlib import Path

from lit_interventions.core.files import write_atomically
from lit_interventions.studies.calm_data import POSITION
from lit_interventions.studies.calm_plan import CalmArgs, CalmPlan


def result_row(task: str, method: str, prop: str, t: Counter) -> dict:
    """The results.csv row of one (task, method, property): its tally as rates."""
    return {
        "task": task,
        "method": method,
        "property": prop,
        "causal": prop == task,
        "n": t["n"],
        "target_success": t["target_success"] / t["n"],
        "probe_acc_before": t["acc_before"] / max(1, t["known"]),
        "probe_acc_after": t["acc_after"] / max(1, t["known"]),
        "collateral_acc_before": t["collateral_before"] / max(1, t["collateral_n"]),
        "collateral_acc_after": t["collateral_after"] / max(1, t["collateral_n"]),
        "top1_changed": t["top1_changed"] / t["n"],
        "mean_topk_overlap": t["overlap"] / t["n"],
    }


def summary_row(
    task: str,
    method: str,
    scores: dict,
    mine: list[dict],
    *,
    n_properties: int,
    lm_correct: int,
    n_examples: int,
    answer_vocabulary: int,
    epsilon: float,
    epsilon_abs: float,
) -> dict:
    """The summary.csv row of one (task, method): its Competence `scores`, the two baselines (a
    random model: 1/|Z|; doing nothing: (|Z| − 1)/|Z|), the means over its results rows `mine`,
    the LM's accuracy on the task's examples, the answer vocabulary's size and ε."""
    return {
        "task": task,
        "method": method,
        "competence": scores["competence"],
        "competence_causal": scores["causal"],
        "competence_environmental": scores["environmental"],
        "random_model": 1 / n_properties,
        "do_nothing": (n_properties - 1) / n_properties,
        "target_success": _mean(r["target_success"] for r in mine),
        "collateral_acc_before": _mean(r["collateral_acc_before"] for r in mine),
        "collateral_acc_after": _mean(r["collateral_acc_after"] for r in mine),
        "lm_accuracy": lm_correct / n_examples,
        "n_examples": n_examples,
        "answer_vocabulary": answer_vocabulary,
        "epsilon": epsilon,
        "epsilon_abs": epsilon_abs,
    }


def run_config(args: CalmArgs, plan: CalmPlan, prompts: dict, eps: float, scale: float) -> dict:
    """The run's config as summary.json keeps it: the site, the data, the attacks and the probes."""
    return {
        "lm": args.lm,
        "layer": plan.layer,
        "hidden_size": plan.d,
        "site": POSITION,
        "entity_type": args.entity_type,
        "ravel_dir": args.ravel_dir,
        "properties": plan.properties,
        "tasks": plan.tasks,
        "methods": [{"name": m.name, "class_path": m.class_path, "init_args": m.init_args} for m in plan.methods],
        "epsilon": args.epsilon,
        "epsilon_relative": args.epsilon_relative,
        "epsilon_abs": eps,
        "site_scale": scale,
        "alpha": (args.alpha if args.alpha is not None else eps / 10),
        "steps": args.steps,
        "k_max": args.k_max,
        "probe": args.probe,
        "probe_epochs": args.probe_epochs,
        "entities": {s: len(v) for s, v in plan.split_of.items()},
        "prompts": {s: len(v) for s, v in prompts.items()},
        "templates": plan.templates,
        "seed": args.seed,
    }


def _mean(values) -> float:
    """The mean, NaN when there is no value."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def write_results(out_dir: Path, results: list[dict], summary: list[dict], config: dict, probes: dict) -> None:
    """DIR/results.csv, DIR/summary.csv, and DIR/summary.json (config, probes, summary, results),
    each written whole (a temporary file renamed over it)."""
    for name, rows in (("results.csv", results), ("summary.csv", summary)):
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(Path(out_dir) / name, text.getvalue())
    payload = {"config": config, "probes": probes, "summary": summary, "results": results}
    write_atomically(Path(out_dir) / "summary.json", json.dumps(payload, indent=2) + "\n")
