"""The chat models that write concept data: a local chat LM (default the embedded
`smollm2-135m-instruct`) or any OpenAI-compatible endpoint.

Both answer `generate(prompts, seeds)`: one user turn each, the replies in order. `identity()` is
what names the generator in the cache keys and the provenance record (the local LM's weights
sha256; the endpoint's URL and model), `sampling` the settings every reply is drawn with.
A local LM draws a batch of replies with torch seeded by the batch's first seed; an endpoint gets
each prompt's seed in its request (`seed`, which OpenAI-compatible servers may honour or ignore).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from lit_interventions.core.chat_endpoint import ChatEndpoint
from lit_interventions.core.lm import load_lm, load_tokenizer, weights_record
from lit_interventions.core.progress import TokenSteps, stage
from lit_interventions.metrics.judge_local import chat_prompt, generate_replies

DEFAULT_GENERATOR = "smollm2-135m-instruct"


class Generator:
    """A chat model that answers user turns; `generated` counts the replies it has drawn."""

    generated = 0

    def __init__(self, max_new_tokens: int = 96, temperature: float = 0.7, top_p: float = 0.9):
        self.sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        self.generated = 0

    def identity(self) -> dict:
        """What names this generator in the cache keys and in generation.json."""
        raise NotImplementedError

    def generate(self, prompts: list[str], seeds: list[int]) -> list[str]:
        raise NotImplementedError


class LocalGenerator(Generator):
    """A local chat LM (an embedded name, a .gguf file, a model directory or a hub id), loaded on
    the first `generate`: replies in the tokenizer's chat template, batched with left padding
    (`metrics.judge_local.generate_replies`), sampled at `temperature` (0: greedy)."""

    def __init__(self, lm: str = DEFAULT_GENERATOR, dtype: str = "float32", max_length: int = 1024, **sampling):
        super().__init__(**sampling)
        self.lm, self.dtype, self.max_length = lm, dtype, max_length
        self.weights = weights_record(lm)  # hashes the weights file, loads nothing
        self.model = self.tokenizer = None

    def identity(self) -> dict:
        record = {"kind": "local", "lm": self.lm, **self.weights}
        if self.model is not None and getattr(self.model.config, "_commit_hash", None):
            record["revision"] = self.model.config._commit_hash  # a hub id's snapshot
        return record

    def cache_identity(self) -> dict:
        """The part of `identity` that keys the cache: known before the model loads."""
        return {"kind": "local", "lm": self.lm, **self.weights, "dtype": self.dtype}

    def generate(self, prompts: list[str], seeds: list[int]) -> list[str]:
        if self.model is None:
            self.model, self.tokenizer = load_lm(self.lm, self.dtype), load_tokenizer(self.lm)
        temperature = self.sampling["temperature"]
        options = (
            {"do_sample": True, "temperature": temperature, "top_p": self.sampling["top_p"]}
            if temperature > 0
            else {"do_sample": False}
        )
        torch.manual_seed(seeds[0])
        texts = [chat_prompt(self.tokenizer, p) for p in prompts]
        steps = self.sampling["max_new_tokens"]
        with stage(steps, "generated tokens", "token") as shown:  # below the build's progress
            replies = generate_replies(
                self.model,
                self.tokenizer,
                texts,
                steps,
                batch_size=len(texts),
                max_length=self.max_length,
                streamer=TokenSteps(shown, steps),
                **options,
            )
        self.generated += len(replies)
        return replies


class EndpointGenerator(ChatEndpoint, Generator):
    """Any OpenAI-compatible `/chat/completions` endpoint (`core.chat_endpoint`), `workers`
    requests at a time; the key, if any, from the environment variable `api_key_env`."""

    role = "generator endpoint"
    log = logging.getLogger("lit_interventions.concepts")

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        workers: int = 4,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 0.5,
        **sampling,
    ):
        Generator.__init__(self, **sampling)
        self.setup_endpoint(base_url, api_key_env, timeout, retries, backoff)
        self.base_url, self.model, self.workers = base_url, model, workers

    def identity(self) -> dict:
        return {"kind": "endpoint", "base_url": self.base_url, "model": self.model}

    def cache_identity(self) -> dict:
        return self.identity()

    def _ask(self, prompt: str, seed: int) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.sampling["temperature"],
            "top_p": self.sampling["top_p"],
            "max_tokens": self.sampling["max_new_tokens"],
            "seed": seed,
        }
        return self._post_with_retries(body)

    def generate(self, prompts: list[str], seeds: list[int]) -> list[str]:
        with ThreadPoolExecutor(self.workers) as pool:
            replies = list(pool.map(self._ask, prompts, seeds))
        self.generated += len(replies)
        return replies
