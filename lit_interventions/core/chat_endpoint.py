"""One OpenAI-compatible `/chat/completions` endpoint over plain HTTP (urllib): the request, the
retries on failures that may pass, and the API key read from a named environment variable. The
judge (`metrics/judge_openai.py`) and the concept-data generator (`datamodules/concepts_generators.py`)
both ask through it."""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request

RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)  # worth asking again; other 4xx are our fault


class ChatRequestError(ConnectionError):
    """The endpoint answered; `retry` says whether asking again may help (busy, down, timed out)."""

    def __init__(self, message: str, retry: bool, wait: float | None = None):
        super().__init__(message)
        self.retry, self.wait = retry, wait


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


class ChatEndpoint:
    """POST {base_url}/chat/completions (JSON) with retries.

    Subclasses set `url`, `headers`, `timeout`, `retries` and `backoff` (`setup_endpoint`), and
    name the endpoint in their errors (`role`) and log through `log`."""

    role = "chat endpoint"
    log = logging.getLogger("lit_interventions.core.chat_endpoint")

    def setup_endpoint(
        self, base_url: str, api_key_env: str | None, timeout: float, retries: int, backoff: float
    ) -> None:
        """Check and keep the connection settings (one ValueError naming a bad one)."""
        check_base_url(base_url)
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an integer >= 0")
        if not backoff >= 0:
            raise ValueError(f"backoff={backoff!r} must be >= 0 seconds")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.headers = auth_headers(api_key_env)

    def _post(self, body: dict) -> str:
        """One request; ChatRequestError on failure (naming the URL)."""
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            wait = err.headers.get("Retry-After") if err.headers else None
            wait = float(wait) if wait and wait.strip().replace(".", "", 1).isdigit() else None
            raise ChatRequestError(
                f"{self.role} {self.url} answered HTTP {err.code}: {detail}",
                retry=err.code in RETRY_STATUS,
                wait=wait,
            ) from err
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ChatRequestError(f"{self.role} {self.url} is unreachable: {reason}", retry=True) from err
        except ValueError as err:  # not JSON
            raise ChatRequestError(f"{self.role} {self.url} sent a reply that is not JSON: {err}", retry=True) from err
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            raise ChatRequestError(
                f"{self.role} {self.url} sent no chat completion: {str(payload)[:300]}", retry=False
            ) from err

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
