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
- `local`: the same prompts answered in-process by a local chat LM (default the embedded
  `smollm2-135m-instruct`), parsed the same way. Needs no network.

A reply that cannot be parsed scores 0 and is logged (warning), as AxBench does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lit_interventions.core.lm import cache_dir, load_lm, load_tokenizer
from lit_interventions.core.sharding import input_device
from lit_interventions.core.sites import logits_at

log = logging.getLogger(__name__)

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


@dataclass
class JudgeScore:
    concept_score: float
    instruct_score: float
    fluency_score: float
    overall: float
    replies: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class Judge:
    """A backend answers prompts (`ask`); the judging, parsing and scoring are shared."""

    name = ""
    prompt_style = "axbench"  # see the module doc; make_judge(prompt_style=..., parsing=...) sets them
    parsing = "axbench"

    def check(self) -> None:
        """Fail early (before any generation) when the backend cannot answer."""

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


RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)  # worth asking again; other 4xx are our fault


class JudgeRequestError(ConnectionError):
    """The endpoint answered; `retry` says whether asking again may help (busy, down, timed out)."""

    def __init__(self, message: str, retry: bool, wait: float | None = None):
        super().__init__(message)
        self.retry, self.wait = retry, wait


def judge_cache_dir() -> Path:
    """Where judge replies are kept: $LIT_INTERVENTIONS_JUDGE_CACHE, else <model cache>/judge."""
    return Path(os.environ.get("LIT_INTERVENTIONS_JUDGE_CACHE") or cache_dir() / "judge")


class OpenAIJudge(Judge):
    """Any OpenAI-compatible chat endpoint: POST {base_url}/chat/completions (JSON), plain urllib.

    Args:
        base_url: e.g. `https://api.openai.com/v1` or `http://127.0.0.1:8000/v1`.
        model: the model name the endpoint expects.
        api_key_env: name of the environment variable holding the key (None: no key, for local
            servers). A named variable that is unset is an error.
        temperature, max_tokens: sampling of the judge's replies (AxBench: temperature 0).
        timeout: seconds per request; workers: concurrent requests.
        retries: further attempts after a failure that may pass (unreachable, timed out, HTTP
            408/429/5xx), waiting `backoff`·2^attempt seconds (or the server's Retry-After).
        cache: a directory where each reply is kept, keyed by the sha256 of the request (URL and
            body), so a rerun asks only what it has not asked before; "auto" (default):
            `$LIT_INTERVENTIONS_JUDGE_CACHE` or `<LIT_INTERVENTIONS_CACHE>/judge`; None: no cache.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str = "https://api.openai.com/v1",
        model: str = "gpt-4o-mini",
        api_key_env: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 256,
        timeout: float = 120.0,
        workers: int = 4,
        retries: int = 3,
        backoff: float = 0.5,
        cache: str | None = "auto",
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
        if workers < 1:
            raise ValueError(f"workers={workers!r} must be at least 1")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an integer >= 0")
        if not backoff >= 0:
            raise ValueError(f"backoff={backoff!r} must be >= 0 seconds")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.timeout, self.workers, self.retries, self.backoff = timeout, workers, retries, backoff
        self.cache = None if cache is None else (judge_cache_dir() if cache == "auto" else Path(cache))
        self.headers = {"Content-Type": "application/json"}
        if api_key_env:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(
                    f"api_key_env={api_key_env!r}: that environment variable is not set "
                    "(set it, or use api_key_env: null for a server without keys)"
                )
            self.headers["Authorization"] = f"Bearer {key}"

    def _post(self, body: dict) -> str:
        """One request; JudgeRequestError on failure (naming the URL)."""
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            wait = err.headers.get("Retry-After") if err.headers else None
            wait = float(wait) if wait and wait.strip().replace(".", "", 1).isdigit() else None
            raise JudgeRequestError(
                f"judge endpoint {self.url} answered HTTP {err.code}: {detail}",
                retry=err.code in RETRY_STATUS,
                wait=wait,
            ) from err
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise JudgeRequestError(f"judge endpoint {self.url} is unreachable: {reason}", retry=True) from err
        except ValueError as err:  # not JSON
            raise JudgeRequestError(
                f"judge endpoint {self.url} sent a reply that is not JSON: {err}", retry=True
            ) from err
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            raise JudgeRequestError(
                f"judge endpoint {self.url} sent no chat completion: {str(payload)[:300]}", retry=False
            ) from err

    def _cache_path(self, body: dict) -> Path | None:
        if self.cache is None:
            return None
        key = hashlib.sha256(json.dumps({"url": self.url, "body": body}, sort_keys=True).encode()).hexdigest()
        return self.cache / key[:2] / f"{key}.json"

    def _chat(self, prompt: str, max_tokens: int | None = None, use_cache: bool = True) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": max_tokens or self.max_tokens,
        }
        cached = self._cache_path(body) if use_cache else None
        if cached is not None and cached.is_file():
            try:
                return json.loads(cached.read_text())["reply"]
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("judge cache entry %s is unreadable; asking again", cached)
        for attempt in range(self.retries + 1):
            try:
                reply = self._post(body)
                break
            except JudgeRequestError as err:
                if not err.retry or attempt == self.retries:
                    if attempt:
                        raise JudgeRequestError(f"{err} (after {attempt + 1} attempts)", err.retry) from err
                    raise
                wait = min(err.wait if err.wait is not None else self.backoff * 2**attempt, 60.0)
                log.warning("judge: %s; retrying in %.1f s (%d of %d)", err, wait, attempt + 1, self.retries)
                time.sleep(wait)
        if cached is not None:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}")
                tmp.write_text(json.dumps({"request": body, "url": self.url, "reply": reply}))
                os.replace(tmp, cached)
            except OSError as err:
                log.warning("judge: cannot write the reply cache %s: %s", cached, err)
        return reply

    def check(self) -> None:
        """One cheap request (max_tokens 1, never from the cache); raises ConnectionError naming
        the URL if it fails."""
        self._chat("Reply with the number 1.", max_tokens=1, use_cache=False)

    def ask(self, prompts: list[str]) -> list[str]:
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self._chat, prompts))


def chat_prompt(tokenizer, prompt: str) -> str:
    """The user turn in the tokenizer's chat template (plain text when it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return f"User: {prompt}\nAssistant:"


@torch.no_grad()
def generate_replies(
    model,
    tokenizer,
    texts: list[str],
    max_new_tokens: int,
    batch_size: int = 8,
    max_length: int | None = None,
    **sampling,
) -> list[str]:
    """Replies to prompts already in chat format, batched with left padding. A prompt longer than
    `max_length` tokens loses its start, never the assistant header at its end that the reply
    follows. Only the new tokens are decoded. `sampling`: passed to `generate` (default greedy)."""
    templated = bool(getattr(tokenizer, "chat_template", None))  # the template holds the BOS
    side, cut = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side = tokenizer.truncation_side = "left"
    try:
        replies = []
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=not templated,
                truncation=max_length is not None,
                max_length=max_length,
            ).to(input_device(model))
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **(sampling or {"do_sample": False}),
            )
            replies += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return replies
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = side, cut


def greedy_replies(
    model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8, max_length: int | None = None
) -> list[str]:
    """Greedy chat replies of a local LM to user prompts."""
    texts = [chat_prompt(tokenizer, p) for p in prompts]
    return generate_replies(model, tokenizer, texts, max_new_tokens, batch_size, max_length)


class LocalJudge(Judge):
    """The AxBench judge prompts answered in-process by a local chat LM. Needs no network.

    How it approximates the LLM judge: identical prompts, only a far smaller judge. Two ways to
    read its rating:
    - `rating: generate` (greedy reply, parsed like the `openai` backend). A 135M chat model
      follows the "Rating: [[N]]" format only part of the time; unparsed replies count 0, so
      scores are biased low (on smollm2, 104 of 144 replies were unparseable).
    - `rating: probability` (the default): the reply is forced to start "Rating: [[" and the
      score is the expected rating under the LM's next-token probabilities of "0", "1", "2",
      E[r] = Σ p(r)·r / Σ p(r). Always a number in [0, 2], and no explanation is generated first
      (the API judge reasons before rating; this one cannot). smollm2-135m gives about 1.0 to
      everything this way, word salad included: it is not able to judge.
    Either way its ratings track surface cues (a repeated concept word, a short reply) much more
    than meaning: use it for smoke tests and relative comparisons on one model, not for numbers
    to set beside the paper's.
    """

    name = "local"
    RATINGS = ("generate", "probability")

    def __init__(
        self,
        lm: str = "smollm2-135m-instruct",
        rating: str = "probability",
        max_new_tokens: int = 64,
        batch_size: int = 8,
        max_length: int | None = 1024,
        dtype: str = "float32",
    ):
        if rating not in self.RATINGS:
            raise ValueError(f"rating={rating!r}; choose one of {', '.join(self.RATINGS)}")
        self.model, self.tokenizer = load_lm(lm, dtype), load_tokenizer(lm)
        self.lm, self.rating, self.max_new_tokens = lm, rating, max_new_tokens
        self.batch_size, self.max_length = batch_size, max_length

    def ask(self, prompts: list[str]) -> list[str]:
        if self.rating == "generate":
            return greedy_replies(
                self.model, self.tokenizer, prompts, self.max_new_tokens, self.batch_size, self.max_length
            )
        ratings = expected_ratings(self.model, self.tokenizer, prompts, self.batch_size, self.max_length)
        return [f"Rating: [[{r:.4f}]]" for r in ratings]


@torch.no_grad()
def expected_ratings(
    model, tokenizer, prompts: list[str], batch_size: int = 8, max_length: int | None = None
) -> list[float]:
    """E[r] = Σ p(r)·r / Σ p(r) over r ∈ {0, 1, 2}: the LM's next-token probabilities of the three
    digits right after the assistant turn "Rating: [[" (left padding, logits at the last token)."""
    digits = []
    for d in "012":
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the judge's tokenizer splits the rating {d!r} into {len(ids)} tokens")
        digits.append(ids[0])
    templated = bool(getattr(tokenizer, "chat_template", None))  # the template holds the BOS
    side, cut = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side = tokenizer.truncation_side = "left"  # a long prompt loses its start, not "Rating: [["
    try:
        ratings = []
        for start in range(0, len(prompts), batch_size):
            texts = [chat_prompt(tokenizer, p) + "Rating: [[" for p in prompts[start : start + batch_size]]
            enc = tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                add_special_tokens=not templated,
                truncation=max_length is not None,
                max_length=max_length,
            ).to(input_device(model))
            last = torch.full((len(texts),), enc["input_ids"].shape[1] - 1, device=enc["input_ids"].device)
            logits = logits_at(model, enc["input_ids"], enc["attention_mask"], last)  # (batch, vocab)
            probs = logits.float()[:, digits].softmax(-1)  # (batch, 3), renormalised over the digits
            ratings += (probs @ torch.tensor([0.0, 1.0, 2.0], device=probs.device)).tolist()
        return ratings
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = side, cut


JUDGES: dict[str, type[Judge]] = {"openai": OpenAIJudge, "local": LocalJudge}


def make_judge(backend: str = "openai", **options) -> Judge:
    """A judge from its config: `{backend: openai, base_url: ..., model: ..., api_key_env: ...}`;
    `prompt_style` (axbench | ours) and `parsing` (axbench | lenient) for any backend."""
    if backend not in JUDGES:
        raise ValueError(f"judge backend={backend!r} is unknown; choose one of {sorted(JUDGES)}")
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
