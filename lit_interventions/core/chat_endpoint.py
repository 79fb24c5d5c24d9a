"""One OpenAI-compatible `/chat/completions` endpoint over HTTP (httpx): the request, the retries on
failures that may pass, and the API key read from a named environment variable. The judge
(`metrics/judge_openai.py`) and the concept-data generator (`datamodules/concepts_generators.py`)
both ask through it.

Each request is bounded as a whole: connecting, sending, and the reply's headers and body all
within `timeout` seconds (a total deadline, not one per socket read, so an endpoint that trickles
its reply cannot hold a worker), and the reply's body is read up to `max_reply_bytes` (a larger
one is refused as it arrives, never held whole). A reply cut short (the connection closed before
its Content-Length is in) is a failure that may pass, and is asked again. Every message built from
a reply has the API key's value and any `Bearer` token replaced by `[redacted]`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import ssl
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)  # worth asking again; other 4xx are our fault
MAX_REPLY_BYTES = 8 << 20  # a chat completion is a few KiB; a reply past this is refused
REDACTED = "[redacted]"
_BEARER = re.compile(r"\bBearer\s+[^\s\"',;]+", re.IGNORECASE)


class ChatRequestError(ConnectionError):
    """The endpoint answered; `retry` says whether asking again may help (busy, down, timed out)."""

    def __init__(self, message: str, retry: bool, wait: float | None = None):
        super().__init__(message)
        self.retry, self.wait = retry, wait


class _ReplyTooLarge(Exception):
    """The reply's body passed the cap (`size`: the bytes announced, or read so far)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def check_base_url(base_url: str) -> str:
    """`base_url` if it is an http(s) URL; else a one-line ValueError naming it."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
    return base_url


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """The request headers: JSON, and `Authorization: Bearer <key>` from the environment variable
    named `api_key_env` (None: no key, for local servers). A named variable that is unset is an
    error naming it; the key itself is never read from anywhere else."""
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(
                f"api_key_env={api_key_env!r}: that environment variable is not set "
                "(set it, or use api_key_env: null for a server without keys)"
            )
        headers["Authorization"] = f"Bearer {key}"
    return headers


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with each of `secrets` and any `Bearer <token>` replaced by REDACTED."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _BEARER.sub(f"Bearer {REDACTED}", text)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """The system's certificate store, as urllib uses it (one context for every request)."""
    return ssl.create_default_context()


def _run(coroutine):
    """Run `coroutine` to its end on a new event loop: in this thread, or in a helper thread when
    this one runs a loop already (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _retry_after(headers: httpx.Headers) -> float | None:
    wait = headers.get("Retry-After")
    return float(wait) if wait and wait.strip().replace(".", "", 1).isdigit() else None


class ChatEndpoint:
    """POST {base_url}/chat/completions (JSON) with retries.

    Subclasses set `url`, `headers`, `timeout`, `retries` and `backoff` (`setup_endpoint`), and
    name the endpoint in their errors (`role`) and log through `log`. `max_reply_bytes` caps a
    reply's body."""

    role = "chat endpoint"
    log = logging.getLogger("lit_interventions.core.chat_endpoint")
    max_reply_bytes = MAX_REPLY_BYTES

    def setup_endpoint(
        self, base_url: str, api_key_env: str | None, timeout: float, retries: int, backoff: float
    ) -> None:
        """Check and keep the connection settings (one ValueError naming a bad one)."""
        check_base_url(base_url)
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an integer >= 0")
        if not backoff >= 0:
            raise ValueError(f"backoff={backoff!r} must be >= 0 seconds")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.headers = auth_headers(api_key_env)

    @property
    def secrets(self) -> tuple[str, ...]:
        """What no message may show: the API key's value."""
        bearer = self.headers.get("Authorization", "")
        return (bearer.removeprefix("Bearer "),) if bearer else ()

    async def _exchange(self, body: dict) -> tuple[int, httpx.Headers, bytes]:
        """(status, headers, body) of one POST; `_ReplyTooLarge` once the body passes the cap."""
        limit = self.max_reply_bytes
        async with httpx.AsyncClient(timeout=self.timeout, verify=_ssl_context()) as client:
            data = json.dumps(body).encode()
            async with client.stream("POST", self.url, content=data, headers=self.headers) as response:
                announced = response.headers.get("Content-Length", "")
                if announced.isdigit() and int(announced) > limit:
                    raise _ReplyTooLarge(int(announced))
                reply = bytearray()
                async for chunk in response.aiter_bytes():
                    reply += chunk
                    if len(reply) > limit:
                        raise _ReplyTooLarge(len(reply))
                return response.status_code, response.headers, bytes(reply)

    def _fail(self, what: str, retry: bool, wait: float | None = None) -> ChatRequestError:
        return ChatRequestError(redact(f"{self.role} {self.url} {what}", self.secrets), retry, wait)

    def _post(self, body: dict) -> str:
        """One request, all of it within `timeout` seconds; ChatRequestError on failure (naming
        the URL, secrets redacted)."""
        try:
            status, headers, reply = _run(asyncio.wait_for(self._exchange(body), self.timeout))
        except (asyncio.TimeoutError, httpx.TimeoutException) as err:
            raise self._fail(f"did not answer within {self.timeout:g} s", retry=True) from err
        except _ReplyTooLarge as err:
            raise self._fail(
                f"sent a reply of {err.size} bytes or more; at most {self.max_reply_bytes} are read", retry=False
            ) from None
        except httpx.RemoteProtocolError as err:  # cut short, or not HTTP
            raise self._fail(f"sent an incomplete reply ({err})", retry=True) from err
        except httpx.HTTPError as err:
            raise self._fail(f"is unreachable: {type(err).__name__}: {err}", retry=True) from err
        text = reply.decode(errors="replace")
        if not 200 <= status < 300:  # redacted whole, then cut: no part of a key is left
            text = redact(text, self.secrets)
            raise self._fail(f"answered HTTP {status}: {text[:300]}", status in RETRY_STATUS, _retry_after(headers))
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError) as err:
            raise self._fail(f"sent a reply that is not JSON ({type(err).__name__}: {err})", retry=True) from None
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            shown = redact(str(payload), self.secrets)[:300]
            raise self._fail(f"sent no chat completion: {shown}", retry=False) from err

    def _post_with_retries(self, body: dict) -> str:
        """`_post`, asked again up to `retries` times while the failure may pass, waiting
        min(Retry-After or backoff·2^attempt, 60) seconds; the last failure names the attempts."""
        for attempt in range(self.retries + 1):
            try:
                reply = self._post(body)
                break
            except ChatRequestError as err:
                if not err.retry or attempt == self.retries:
                    if attempt:
                        raise ChatRequestError(f"{err} (after {attempt + 1} attempts)", err.retry) from err
                    raise
                wait = min(err.wait if err.wait is not None else self.backoff * 2**attempt, 60.0)
                self.log.warning(
                    "%s: %s; retrying in %.1f s (%d of %d)", self.role, err, wait, attempt + 1, self.retries
                )
                time.sleep(wait)
        return reply
