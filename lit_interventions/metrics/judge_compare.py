"""Two judges side by side: `ComparedJudge` scores every generation with both (the first one's
scores are the row's; the other's go under `compared`), and `judge_agreement` gives each score's
mean under both and their Spearman rank correlation over the generations,

    ρ = Pearson correlation of the ranks (ties: their mean rank) = `scipy.stats.spearmanr`,

NaN where either judge gives every generation the same score. Made by `make_judge(...,
compare={backend: ..., ...})` (metrics/judge.py)."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import spearmanr

from lit_interventions.metrics.judge_base import Judge, JudgeScore

__all__ = ["SCORES", "ComparedJudge", "agreement_lines", "judge_agreement"]

SCORES = ("concept_score", "instruct_score", "fluency_score", "overall")


class ComparedJudge(Judge):
    """`primary` scores; `other` scores the same generations, kept in each JudgeScore's `compared`."""

    def __init__(self, primary: Judge, other: Judge):
        self.primary, self.other = primary, other
        self.name = primary.name
        self.batch_size = getattr(primary, "batch_size", None) or getattr(primary, "workers", None) or 1

    def check(self) -> None:
        self.primary.check()
        self.other.check()

    def prepare(self, concepts: list[str]) -> None:
        self.primary.prepare(concepts)
        self.other.prepare(concepts)

    def score(self, concepts: list[str], instructions: list[str], responses: list[str]) -> list[JudgeScore]:
        ours = self.primary.score(concepts, instructions, responses)
        theirs = self.other.score(concepts, instructions, responses)
        for mine, other in zip(ours, theirs):
            mine.compared = {"judge": self.other.name, **{s: getattr(other, s) for s in SCORES}}
            mine.compared["replies"] = other.replies
        return ours


def judge_agreement(rows: list[dict]) -> list[dict]:
    """Per score, over the rows that carry a `compared` judge's scores: {score, n, the first
    judge's mean, the other's mean, spearman}; [] when no row carries them."""
    rows = [r for r in rows if isinstance(r.get("compared"), dict)]
    if not rows:
        return []
    table = []
    for score in SCORES:
        ours = np.array([float(r[score]) for r in rows])
        theirs = np.array([float(r["compared"][score]) for r in rows])
        constant = len(rows) < 2 or ours.min() == ours.max() or theirs.min() == theirs.max()
        rho = math.nan if constant else float(spearmanr(ours, theirs).statistic)
        table.append({"score": score, "n": len(rows), "ours": ours.mean(), "theirs": theirs.mean(), "spearman": rho})
    return table


def agreement_lines(rows: list[dict], names: tuple[str, str]) -> list[str]:
    """`judge_agreement` as printed lines: each score's means under both judges and their ρ."""
    table = judge_agreement(rows)
    if not table:
        return []
    lines = [f"judges side by side over {table[0]['n']} generations: {names[0]} | {names[1]} | Spearman ρ"]
    for row in table:
        lines.append(f"  {row['score']:<15} {row['ours']:.3f} | {row['theirs']:.3f} | {row['spearman']:.3f}")
    return lines
