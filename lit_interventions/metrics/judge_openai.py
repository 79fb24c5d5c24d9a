"""The `openai` judge backend: any OpenAI-compatible `/chat/completions` endpoint over plain HTTP
(urllib), with retries on failures that may pass and an on-disk cache of the replies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lit_interventions.core.lm import cache_dir
from lit_interventions.metrics.judge_base import Judge

log = logging.getLogger("lit_interventions.metrics.judge")  # one logger for the judge, whichever module logs

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
        temperature, max_tokens: sampling of the judge's replies. AxBench's judge: temperature 0.7
            and no cap on the reply's length (max_tokens None: the request names none).
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
        temperature: float = 0.7,
        max_tokens: int | None = None,
        timeout: float = 120.0,
        workers: int = 4,
        retries: int = 3,
        backoff: float = 0.5,
        cache: str | None = "auto",
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= 1, or None for no cap")
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

    def _post_with_retries(self, body: dict) -> str:
        """`_post`, asked again up to `retries` times while the failure may pass, waiting
        min(Retry-After or backoff·2^attempt, 60) seconds; the last failure names the attempts."""
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
