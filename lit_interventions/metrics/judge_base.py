"""The judge's shared part: a backend answers prompts (`Judge.ask`); `Judge.score` builds the three
prompts of each generation, parses the replies and scores them (`JudgeScore`). The backends:
`judge_openai.py` (an OpenAI-compatible endpoint), `judge_local.py` (a local chat LM) and
`judge_offline.py` (proxies under a reference LM, which scores without prompts)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from lit_interventions.metrics.judge_prompts import ASPECTS, PROMPT_STYLES, harmonic_mean, parse_rating

log = logging.getLogger("lit_interventions.metrics.judge")  # one logger for the judge, whichever module logs


@dataclass
class JudgeScore:
    """The three 0-2 ratings of one generation, their harmonic mean and the judge's raw replies."""

    concept_score: float
    instruct_score: float
    fluency_score: float
    overall: float
    replies: dict[str, str] = field(default_factory=dict)
    compared: dict = field(default_factory=dict)  # a second judge's scores (`judge_compare.py`), if any

    def as_dict(self) -> dict:
        """Its fields; `compared` only where a second judge scored."""
        out = asdict(self)
        if not out["compared"]:
            del out["compared"]
        return out


class Judge:
    """A backend answers prompts (`ask`); the judging, parsing and scoring are shared."""

    name = ""
    prompt_style = "axbench"  # see the module doc; make_judge(prompt_style=..., parsing=...) sets them
    parsing = "axbench"

    def check(self) -> None:
        """Fail early (before any generation) when the backend cannot answer."""

    def prepare(self, concepts: list[str]) -> None:
        """Get ready to judge these concepts, or refuse one (a ValueError line) before any
        generation; the prompt judges need nothing (the `offline` judge trains its detectors)."""

    def ask(self, prompts: list[str]) -> list[str]:
        raise NotImplementedError

    def score(self, concepts: list[str], instructions: list[str], responses: list[str]) -> list[JudgeScore]:
        """One JudgeScore per (concept, instruction, response)."""
        if not len(concepts) == len(instructions) == len(responses):
            raise ValueError("concepts, instructions and responses must have the same length")
        templates = PROMPT_STYLES[self.prompt_style]
        prompts = [
            templates[aspect].format(concept=c, instruction=i, response=r)
            for c, i, r in zip(concepts, instructions, responses)
            for aspect in ASPECTS
        ]
        replies = self.ask(prompts)
        results = []
        for k in range(len(responses)):
            raw = dict(zip(ASPECTS, replies[3 * k : 3 * k + 3]))
            ratings = {}
            for aspect, reply in raw.items():
                value = parse_rating(reply, self.parsing)
                if value is None:
                    log.warning(
                        "judge %s: unparseable %s rating, counted as 0: %r", self.name, aspect, (reply or "")[:200]
                    )
                ratings[aspect] = value or 0.0
            c, i, f = ratings["concept"], ratings["instruct"], ratings["fluency"]
            results.append(JudgeScore(c, i, f, harmonic_mean(c, i, f), raw))
        return results
