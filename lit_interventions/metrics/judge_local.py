"""The `local` judge backend and the chat generation it shares with the steering evaluation: a
user turn in the tokenizer's chat template, batched replies with left padding, and `LocalJudge`,
which rates with a local chat LM (a greedy reply, or the expected rating under its next-token
probabilities)."""

from __future__ import annotations

import torch

from lit_interventions.core.forward import logits_at
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.sharding import input_device
from lit_interventions.metrics.judge_base import Judge


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
        """Greedy replies ("generate"), or "Rating: [[E[r]]]" with the expected rating ("probability")."""
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
