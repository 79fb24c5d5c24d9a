"""The judge server's HTTP side: one request handler for GET /v1/models and POST
/v1/chat/completions, bounded by a semaphore of slots, replying in the OpenAI shapes (errors as
{"error": {message, type, param}}). The server itself (`make_server`): `judge_server.py`."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler

from lit_interventions.serving.chat_request import BadRequest, validate_request

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
MODEL_PATHS = ("/v1/models", "/models")


def completion(model: str, reply: str, n_prompt: int, n_reply: int, finish: str) -> dict:
    """The `chat.completion` reply body: one choice, with the token counts in `usage`."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_reply,
            "total_tokens": n_prompt + n_reply,
        },
    }


class ChatHandler(BaseHTTPRequestHandler):
    """Serves `chat` (an object with `name`, `max_new_tokens` and `complete(messages, max_tokens)`).

    A request holds one of `slots` while its body is read and its reply generated; `timeout`
    (seconds) bounds the wait for a slot, and the socket's reads (StreamRequestHandler sets it on
    the socket: a stalled client is cut off). `handler_class` binds the four to a subclass."""

    chat = None
    max_body_bytes = 1 << 20
    timeout = 30.0
    slots: threading.Semaphore

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        """Write a JSON reply; a client that went away closes the connection instead."""
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away
            self.close_connection = True

    def _error(self, status: int, message: str, field: str | None = None, headers: dict | None = None) -> None:
        """An OpenAI-style error reply: invalid_request_error below 500, server_error from 500."""
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "param": field}}, headers)

    def do_GET(self):
        """GET /v1/models: the one model; any other path is 404."""
        if self.path.rstrip("/") in MODEL_PATHS:
            self._send(
                200, {"object": "list", "data": [{"id": self.chat.name, "object": "model", "owned_by": "local"}]}
            )
        else:
            self._error(404, f"unknown path {self.path}")

    def _read_body(self) -> bytes:
        """The body, Content-Length bytes of it: 411 without the header, 413 over `max_body_bytes`
        (not read), 408 when it does not arrive within `timeout`, 400 when it is short."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest("Content-Length", "header is required", status=411)
        if not length.strip().isdigit():
            raise BadRequest("Content-Length", f"must be a non-negative integer, got {length[:40]!r}")
        size = int(length)
        if size > self.max_body_bytes:
            raise BadRequest("body", f"is {size} bytes; at most {self.max_body_bytes}", status=413)
        try:
            body = self.rfile.read(size)
        except TimeoutError as err:
            raise BadRequest(
                "body", f"not received within {self.timeout:g} s (Content-Length {size})", status=408
            ) from err
        if len(body) < size:
            raise BadRequest("body", f"has {len(body)} bytes, not the {size} of its Content-Length")
        return body

    def _read_request(self) -> tuple[list[dict], int, str | None]:
        """(messages, max tokens, model name) of the body, parsed as JSON and checked field by field."""
        body = self._read_body()
        try:
            request = json.loads(body)
        except (UnicodeDecodeError, ValueError) as err:
            raise BadRequest("body", f"is not valid JSON ({err})") from err
        return validate_request(request, self.chat.max_new_tokens)

    def _answer(self) -> tuple[str, str, int, int, str] | None:
        """Inside a slot: (model, reply, prompt tokens, completion tokens, finish reason), or None
        once an error reply (a bad request, a failed generation) has been sent."""
        try:
            messages, limit, model = self._read_request()
        except BadRequest as err:
            self.close_connection = True
            self._error(err.status, f"bad request: {err}", err.field)
            return None
        try:
            reply, n_prompt, n_reply, finish = self.chat.complete(messages, limit)
        except Exception as err:  # noqa: BLE001 - the client gets a reply, not a dropped connection
            self._error(500, f"generation failed: {type(err).__name__}: {str(err)[:300]}")
            return None
        return model or self.chat.name, reply, n_prompt, n_reply, finish

    def do_POST(self):
        """POST /v1/chat/completions: 404 on another path, 503 (Retry-After: 1) when no slot frees
        up within `timeout`; else the request is answered in a slot and the completion sent after."""
        if self.path.rstrip("/") not in CHAT_PATHS:
            self.close_connection = True
            return self._error(404, f"unknown path {self.path}; use /v1/chat/completions")
        if not self.slots.acquire(timeout=self.timeout):  # bounded: bodies are read and generations run in a slot
            self.close_connection = True
            return self._error(503, "the server is busy; retry later", headers={"Retry-After": "1"})
        try:
            answer = self._answer()
        finally:
            self.slots.release()
        if answer is not None:
            self._send(200, completion(*answer))

    def log_message(self, format, *args):  # quiet: one line per request is noise in tests
        pass


def handler_class(chat, max_body_bytes: int, timeout: float, slots: threading.Semaphore) -> type[ChatHandler]:
    """A `ChatHandler` subclass serving `chat`, with its body limit, timeout and slots."""
    return type(
        "Handler", (ChatHandler,), {"chat": chat, "max_body_bytes": max_body_bytes, "timeout": timeout, "slots": slots}
    )
