"""The `openai` judge backend: any OpenAI-compatible `/chat/completions` endpoint over HTTP
(`core/chat_endpoint.py`: the request under a total deadline, its retries and the key from an
environment variable), with an on-disk cache of the replies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lit_interventions.core.chat_endpoint import ChatEndpoint, ChatRequestError
from lit_interventions.core.model_cache import cache_dir
from lit_interventions.metrics.judge_base import Judge

__all__ = ["JudgeRequestError", "OpenAIJudge", "judge_cache_dir"]

log = logging.getLogger("lit_interventions.metrics.judge")  # one logger for the judge, whichever module logs

JudgeRequestError = ChatRequestError  # the endpoint answered; `retry` says whether asking again may help


def judge_cache_dir() -> Path:
    """Where judge replies are kept: $LIT_INTERVENTIONS_JUDGE_CACHE, else <model cache>/judge."""
    return Path(os.environ.get("LIT_INTERVENTIONS_JUDGE_CACHE") or cache_dir() / "judge")


class OpenAIJudge(ChatEndpoint, Judge):
    """Any OpenAI-compatible chat endpoint: POST {base_url}/chat/completions (JSON) through
    `core.chat_endpoint` (httpx; a total deadline, a cap on the reply, the key never shown).

    Args:
        base_url: e.g. `https://api.openai.com/v1` or `http://127.0.0.1:8000/v1`.
        model: the model name the endpoint expects.
        api_key_env: name of the environment variable holding the key (None: no key, for local
            servers). A named variable that is unset is an error.
        temperature, max_tokens: sampling of the judge's replies. AxBench's judge: temperature 0.7
            and no cap on the reply's length (max_tokens None: the request names none).
        timeout: seconds for each request as a whole (connecting, sending, the whole reply);
            workers: concurrent requests.
        retries: further attempts after a failure that may pass (unreachable, timed out, HTTP
            408/429/5xx), waiting `backoff`·2^attempt seconds (or the server's Retry-After).
        cache: a directory where each reply is kept, keyed by the sha256 of the request (URL and
            body), so a rerun asks only what it has not asked before; "auto" (default):
            `$LIT_INTERVENTIONS_JUDGE_CACHE` or `<LIT_INTERVENTIONS_CACHE>/judge`; None: no cache.
    """

    name = "openai"
    role = "judge endpoint"
    log = log

    def __init__(
        self,
        base_url: str = "https://api.openai.com/v1",
        model: str = "gpt-4o-mini",
        api_key_env: str | None = None,
        temperature: float = 0.7,
        max_tokens: int | None = None,
        timeout: float = 120.0,
        workers: int = 4,
        retries: int = 3,
        backoff: float = 0.5,
        cache: str | None = "auto",
    ):
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= 1, or None for no cap")
        if workers < 1:
            raise ValueError(f"workers={workers!r} must be at least 1")
        self.setup_endpoint(base_url, api_key_env, timeout, retries, backoff)
        self.model, self.temperature, self.max_tokens, self.workers = model, temperature, max_tokens, workers
        self.cache = None if cache is None else (judge_cache_dir() if cache == "auto" else Path(cache))

    def _cache_path(self, body: dict) -> Path | None:
        """Where the reply to `body` is kept: <cache>/<sha256[:2]>/<sha256>.json of the URL and
        body, or None without a cache."""
        if self.cache is None:
            return None
        key = hashlib.sha256(json.dumps({"url": self.url, "body": body}, sort_keys=True).encode()).hexdigest()
        return self.cache / key[:2] / f"{key}.json"

    def _chat(self, prompt: str, max_tokens: int | None = None, use_cache: bool = True) -> str:
        """The reply to one user prompt: the cached one if it is there and readable, else asked
        (`_post_with_retries`) and kept in the cache."""
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": self.temperature}
        if (max_tokens or self.max_tokens) is not None:
            body["max_tokens"] = max_tokens or self.max_tokens
        cached = self._cache_path(body) if use_cache else None
        if cached is not None and cached.is_file():
            try:
                return json.loads(cached.read_text())["reply"]
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("judge cache entry %s is unreadable; asking again", cached)
        reply = self._post_with_retries(body)
        if cached is not None:
            self._keep(cached, body, reply)
        return reply

    def _keep(self, cached: Path, body: dict, reply: str) -> None:
        """Write the reply to the cache atomically (a temporary file, then a rename); a failure is
        logged, not raised."""
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"request": body, "url": self.url, "reply": reply}))
            os.replace(tmp, cached)
        except OSError as err:
            log.warning("judge: cannot write the reply cache %s: %s", cached, err)

    def check(self) -> None:
        """One cheap request (max_tokens 1, never from the cache); raises ConnectionError naming
        the URL if it fails."""
        self._chat("Reply with the number 1.", max_tokens=1, use_cache=False)

    def ask(self, prompts: list[str]) -> list[str]:
        """The replies to the prompts, in order, `workers` requests at a time."""
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self._chat, prompts))
