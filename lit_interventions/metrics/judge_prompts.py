"""The AxBench judge's prompts and its rating arithmetic: the three prompts per generation
(concept, instruction relevance, fluency) in two wordings ("axbench", "ours"), reading the 0-2
rating out of a reply ("axbench" or "lenient" parsing) and the harmonic-mean overall score.
The judge itself (backends, `make_judge`): `lit_interventions/metrics/judge.py`."""

from __future__ import annotations

import re

ASPECTS = ("concept", "instruct", "fluency")

_FORMAT = (
    'After your explanation, give your rating in exactly this format: "Rating: [[score]]", for example "Rating: [[1]]".'
)
_AXBENCH_FORMAT = 'Give your rating in exactly this format: "Rating: [[score]]".'
AXBENCH_PROMPTS = {
    "concept": (
        "[System]\nAs an impartial judge, decide whether the concept given below is present in the sentence "
        "fragment. Look only at whether the concept is clearly incorporated, not at grammar or logical "
        "coherence.\n\nFirst give a short explanation of whether the concept is clearly incorporated, pointing "
        "to references to it in the fragment and noting minimal or awkward ones. Then rate the concept's "
        "relevance from 0 to 2: 0 means the concept is not present at all, 1 means it is somewhat present but "
        "minimally or awkwardly incorporated, 2 means it is more fully and effectively incorporated, with "
        "stronger and more natural integration. " + _AXBENCH_FORMAT + "\n\n[Concept Start]\n{concept}\n"
        "[Concept End]\n\n[Sentence Fragment Start]\n{response}\n[Sentence Fragment End]\n"
    ),
    "instruct": (
        "[System]\nAs an impartial judge, decide whether the sentence fragment below is related to the "
        "instruction. Look only at how related it is in topic, regardless of grammar, coherence or "
        "informativeness.\n\nFirst give a brief explanation of whether the sentence is related to the "
        "instruction, pointing to references related to it. Then rate the instruction relevance from 0 to 2: "
        "0 means the sentence is unrelated to the instruction, 1 means it is somewhat related but only minimally "
        "or indirectly relevant in topic, 2 means it is more clearly and directly related to the instruction. "
        + _AXBENCH_FORMAT
        + "\n\n[Instruction Start]\n{instruction}\n[Instruction End]\n\n"
        "[Sentence Fragment Start]\n{response}\n[Sentence Fragment End]\n"
    ),
    "fluency": (
        "[System]\nAs an impartial judge, evaluate the fluency of the sentence fragment below. Look only at "
        "fluency, disregarding its completeness, its relevance, its coherence with any broader context and its "
        "informativeness.\n\nFirst briefly describe the fluency of the sentence, noting unnatural phrasing, "
        "awkward transitions, grammatical errors or repetitive structures that may hinder readability. Then "
        "rate the fluency from 0 to 2: 0 means not fluent and highly unnatural (e.g. incomprehensible or "
        "repetitive), 1 means somewhat fluent but with noticeable errors or awkward phrasing, 2 means fluent "
        "and almost perfect. " + _AXBENCH_FORMAT + "\n\n[Sentence Fragment Start]\n{response}\n"
        "[Sentence Fragment End]\n"
    ),
}
OUR_PROMPTS = {
    "concept": (
        "You are a strict, impartial judge. Decide whether the concept below appears in the text fragment. "
        "Judge only whether the concept is clearly present; ignore grammar and coherence. First explain in one "
        "or two sentences where the concept shows up, if anywhere. Then rate it from 0 to 2: 0 means the "
        "concept is absent, 1 means it is present only weakly or awkwardly, 2 means it is clearly and naturally "
        "present. " + _FORMAT + "\n\n[Concept Start]\n{concept}\n[Concept End]\n\n"
        "[Fragment Start]\n{response}\n[Fragment End]"
    ),
    "instruct": (
        "You are a strict, impartial judge. Decide whether the text fragment below answers the instruction. "
        "Judge only relevance to the instruction; ignore grammar and coherence, and accept a fragment that "
        "stops early. First explain in one or two sentences how the fragment relates to the instruction. Then "
        "rate it from 0 to 2: 0 means unrelated to the instruction, 1 means loosely related, 2 means it "
        "clearly addresses the instruction. " + _FORMAT + "\n\n[Instruction Start]\n{instruction}\n"
        "[Instruction End]\n\n[Fragment Start]\n{response}\n[Fragment End]"
    ),
    "fluency": (
        "You are a strict, impartial judge. Rate how fluent the text fragment below is: grammar, natural "
        "wording and coherence. Do not penalise a fragment for stopping mid-sentence. First explain in one or "
        "two sentences. Then rate it from 0 to 2: 0 means not fluent (broken, repetitive or meaningless), 1 "
        "means partly fluent, 2 means fluent. " + _FORMAT + "\n\n[Fragment Start]\n{response}\n[Fragment End]"
    ),
}
PROMPT_STYLES = {"axbench": AXBENCH_PROMPTS, "ours": OUR_PROMPTS}
PROMPTS = AXBENCH_PROMPTS  # the default
PARSINGS = ("axbench", "lenient")

_PATTERNS = [
    re.compile(r"\[\[\s*\**\s*(\d+(?:\.\d+)?)\s*\**\s*\]\]"),  # Rating: [[2]]
    re.compile(
        r"rating\W{0,6}(?:(?:of|is)\W{1,3})?(\d+(?:\.\d+)?)", re.IGNORECASE
    ),  # Rating: 2, **Rating**: 2, rating of 2
    re.compile(r"^\W*(\d+(?:\.\d+)?)\W*$"),  # the reply is just the number
]


def parse_rating(reply: str | None, parsing: str = "axbench") -> float | None:
    """The 0-2 rating in a judge's reply, or None if there is none (numbers outside 0..2 are not
    ratings). "axbench": the text after the last "Rating:" to the end of its line, with brackets,
    a final period, quotes and asterisks stripped, must be a number (AxBench's parsing).
    "lenient": the first `[[N]]` wins (small judges ramble on and rate again); then `Rating: N`;
    then a reply that is only a number."""
    if parsing not in PARSINGS:
        raise ValueError(f"parsing={parsing!r}; valid: {', '.join(PARSINGS)}")
    if not reply:
        return None
    if parsing == "axbench":
        if "Rating:" not in reply:
            return None
        text = reply.split("Rating:")[-1].strip().split("\n")[0].strip()
        text = text.replace("[", "").replace("]", "").rstrip(".").strip('"').strip("'").strip("*").strip()
        try:
            value = float(text)
        except ValueError:
            return None
        return value if 0.0 <= value <= 2.0 else None
    for pattern in _PATTERNS:
        found = pattern.findall(reply.strip())
        if found:
            value = float(found[0])
            return value if 0.0 <= value <= 2.0 else None
    return None


def harmonic_mean(concept: float, instruct: float, fluency: float) -> float:
    """overall = 3 / (1/c + 1/i + 1/f); 0 if any score is 0."""
    scores = (concept, instruct, fluency)
    if any(s <= 0 for s in scores):
        return 0.0
    return len(scores) / sum(1.0 / s for s in scores)


def mode_scores(scores: dict, mode: str) -> dict:
    """A generation's scores as its row keeps them: the judge's ratings, and in `suppress` mode the
    overall of AxBench's `LMJudgeEvaluator` on `AlpacaEvalSuppress`, the harmonic mean of the
    concept's absence and the other two, H(2 − concept, instruction, fluency) (a second judge's
    alike); the concept rating itself stays as rated."""
    if mode != "suppress":
        return scores
    absent = 2.0 - scores["concept_score"]
    suppressed = dict(scores, overall=harmonic_mean(absent, scores["instruct_score"], scores["fluency_score"]))
    if scores.get("compared"):
        suppressed["compared"] = mode_scores(scores["compared"], mode)
    return suppressed
