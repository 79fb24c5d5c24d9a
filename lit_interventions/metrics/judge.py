"""The AxBench steering judge: concept, instruction relevance and fluency, each rated 0, 1 or 2.

overall = harmonic mean of the three = 3 / (1/c + 1/i + 1/f), and 0 when any of them is 0
(AxBench §4 "Steering"). A generation is judged with three separate prompts, as in AxBench:
the concept prompt and the fluency prompt see the response alone, the instruction prompt sees
the instruction and the response. Each prompt asks for a short reason, then `Rating: [[N]]`.

Prompts (`prompt_style`): "axbench" (default) gives AxBench's instructions (paraphrased, same
criteria: the concept prompt ignores grammar and coherence; the instruction prompt judges topical
relatedness only; the fluency prompt judges fluency alone, disregarding completeness, relevance,
coherence with any broader context and informativeness); "ours" is our earlier wording (its
fluency prompt also judges coherence). Parsing (`parsing`): "axbench" (default) reads the text
after the LAST "Rating:" up to the line end, brackets and quotes stripped, as AxBench's
`_get_rating_from_completion`; "lenient" takes the first `[[N]]`, then `Rating: N`, then a bare
number (kinder to small local judges that ramble on and rate again).

Backends (`make_judge(backend=..., **options)`):
- `openai`: any OpenAI-compatible `/chat/completions` endpoint over plain HTTP (urllib).
- `offline` (the steering study's default): no prompts; each score is a documented proxy under an
  independent reference LM (default the embedded `gemma-3-270m`), mapped to 0-2 by frozen cut
  points: a concept detector trained on the concept's data (held-out AUROC reported, a concept
  below the bar refused), the reply's perplexity, and log p(reply | instruction) − log p(reply)
  per token (`judge_offline.py`). A proxy, not the paper's GPT-4o-mini judge. Needs no network.
- `local`: the same prompts answered in-process by a local chat LM (default the embedded
  `smollm2-135m-instruct`), parsed the same way. A smoke test only: a 135M chat model does not
  discriminate (`docs/results.md`).

`compare: {backend: ..., ...}` in any judge's options adds a second judge that scores the same
generations: the first one's scores are the row's, the other's are kept beside them and their
Spearman rank correlation is reported (`judge_compare.py`).

A reply that cannot be parsed scores 0 and is logged (warning), as AxBench does.

This module picks the backend (`make_judge`); the parts live in
`judge_prompts.py` (prompts, parsing, overall score), `judge_base.py` (`Judge`, `JudgeScore`),
`judge_openai.py` (the HTTP client and its reply cache), `judge_local.py` (the local chat LM),
`judge_offline.py` (the proxies) and `judge_compare.py` (two judges side by side).
"""

from __future__ import annotations

from lit_interventions.metrics.judge_base import Judge
from lit_interventions.metrics.judge_compare import ComparedJudge
from lit_interventions.metrics.judge_local import LocalJudge
from lit_interventions.metrics.judge_offline import OfflineJudge
from lit_interventions.metrics.judge_openai import OpenAIJudge
from lit_interventions.metrics.judge_prompts import PARSINGS, PROMPT_STYLES

__all__ = ["JUDGES", "make_judge"]

JUDGES: dict[str, type[Judge]] = {"openai": OpenAIJudge, "offline": OfflineJudge, "local": LocalJudge}


def make_judge(backend: str = "openai", **options) -> Judge:
    """A judge from its config: `{backend: openai, base_url: ..., model: ..., api_key_env: ...}`;
    `prompt_style` (axbench | ours) and `parsing` (axbench | lenient) for the prompt backends;
    `compare: {backend: ..., ...}`: a second judge beside it (`ComparedJudge`)."""
    if backend not in JUDGES:
        raise ValueError(f"judge backend={backend!r} is unknown; choose one of {sorted(JUDGES)}")
    compare = options.pop("compare", None)
    if compare is not None:
        if not isinstance(compare, dict) or "compare" in compare:
            raise ValueError(f"judge compare={compare!r} must be one judge's config, e.g. {{backend: openai, ...}}")
        other = make_judge(**compare)
        return ComparedJudge(make_judge(backend, **options), other)
    prompt_style = options.pop("prompt_style", "axbench")
    parsing = options.pop("parsing", "axbench")
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"judge prompt_style={prompt_style!r}; valid: {', '.join(PROMPT_STYLES)}")
    if parsing not in PARSINGS:
        raise ValueError(f"judge parsing={parsing!r}; valid: {', '.join(PARSINGS)}")
    try:
        judge = JUDGES[backend](**options)
    except TypeError as err:
        raise ValueError(f"bad options for judge backend {backend!r}: {err}") from err
    judge.prompt_style, judge.parsing = prompt_style, parsing
    return judge
