"""A small OpenAI-compatible chat server for a local LM: POST /v1/chat/completions.

    lit-interventions serve-judge --lm smollm2-135m-instruct --port 8000
    # then: judge: {backend: openai, base_url: http://127.0.0.1:8000/v1, model: smollm2-135m-instruct}

Greedy generation with the LM's chat template (`User: ...\\nAssistant:` when it has none), one
generation at a time (a lock); the HTTP server is threaded, with at most `max_concurrent`
requests past their headers at once (the others wait up to `timeout` seconds, then get 503), so
memory stays bounded. Answers the subset of the API the judge uses: `messages`, `max_tokens` (or
`max_completion_tokens`; capped by --max_new_tokens), and the usual response shape with
`choices[0].message.content` and `usage`. GET /v1/models lists the one model.

Every field is checked (type and range): a bad one is a 400 reply naming it. A body over
`max_body_bytes` is 413 (without reading it), a missing Content-Length 411, a client that sends
less than it announced or stalls is cut off after `timeout` seconds (408).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from lit_interventions.cli.parsing import PROG, Parser, fail, resolve_configs
from lit_interventions.core.lm import check_dtype, load_lm, load_tokenizer

ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 256


class BadRequest(ValueError):
    """A request field of the wrong type or out of range: `field` names it."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _content(value, field: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": str} parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{field}[{k}]", 'must be {"type": "text", "text": "..."} (only text is supported)')
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(field, f"must be a string (or a list of text parts), got {type(value).__name__}")


def validate_request(request, max_new_tokens: int) -> tuple[list[dict], int, str | None]:
    """(messages as {role, content: str}, max tokens to generate, model name) of a chat request;
    BadRequest naming the first bad field. Fields the server does not use are ignored, but the
    known ones must have their OpenAI type and range."""
    if not isinstance(request, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(request).__name__}")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest("messages", f"has {len(messages)} entries; at most {MAX_MESSAGES}")
    clean = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{k}]", f"must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{k}].role", f"must be one of {', '.join(ROLES)}, got {role!r}"[:200])
        if "content" not in message:
            raise BadRequest(f"messages[{k}].content", "is missing")
        clean.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(message["content"], f"messages[{k}].content"),
            }
        )
    limit = max_new_tokens
    for field in ("max_tokens", "max_completion_tokens"):
        value = request.get(field)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise BadRequest(field, f"must be an integer >= 1, got {value!r}"[:200])
        limit = min(limit, value)
    for field, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("frequency_penalty", -2.0, 2.0),
        ("presence_penalty", -2.0, 2.0),
    ):
        value = request.get(field)
        if value is not None and not (_is_number(value) and low <= value <= high):
            raise BadRequest(field, f"must be a number in [{low:g}, {high:g}], got {value!r}"[:200])
    if request.get("n") is not None and request.get("n") != 1:
        raise BadRequest("n", f"only n=1 is supported, got {request.get('n')!r}"[:200])
    if request.get("stream") not in (None, False):
        raise BadRequest("stream", "streaming is not supported; send stream: false")
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"must be a string, got {type(model).__name__}")
    stop = request.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise BadRequest("stop", "must be a string or a list of strings")
    return clean, limit, model


class ChatLM:
    """Greedy chat completions of one local LM."""

    def __init__(self, lm: str = "smollm2-135m-instruct", max_new_tokens: int = 256, dtype: str = "float32"):
        self.name, self.max_new_tokens = lm, max_new_tokens
        self.model, self.tokenizer = load_lm(lm, dtype), load_tokenizer(lm)
        self.lock = threading.Lock()

    def _prompt(self, messages: list[dict]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"

    @torch.no_grad()
    def complete(self, messages: list[dict], max_tokens: int | None = None) -> tuple[str, int, int, str]:
        """(reply, prompt tokens, completion tokens, finish reason)."""
        limit = min(max_tokens or self.max_new_tokens, self.max_new_tokens)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        enc = self.tokenizer(self._prompt(messages), return_tensors="pt", add_special_tokens=not templated)
        room = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if room:  # keep the prompt's end and room for the reply
            keep = max(1, room - limit)
            enc = {k: v[:, -keep:] for k, v in enc.items()}
        with self.lock:
            out = self.model.generate(
                **{k: v.to(self.model.device) for k, v in enc.items()},
                do_sample=False,
                max_new_tokens=limit,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[0, enc["input_ids"].shape[1] :]
        finish = "stop" if len(new) < limit or new[-1].item() == self.tokenizer.eos_token_id else "length"
        return self.tokenizer.decode(new, skip_special_tokens=True), enc["input_ids"].shape[1], len(new), finish


def _handler(chat, max_body_bytes: int, timeout: float, slots: threading.Semaphore):
    class Handler(BaseHTTPRequestHandler):
        def setup(self):
            self.timeout = timeout  # StreamRequestHandler sets it on the socket: a stalled client is cut off
            super().setup()

        def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
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
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind, "param": field}}, headers)

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [{"id": chat.name, "object": "model", "owned_by": "local"}]})
            else:
                self._error(404, f"unknown path {self.path}")

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise BadRequest("Content-Length", "header is required", status=411)
            if not length.strip().isdigit():
                raise BadRequest("Content-Length", f"must be a non-negative integer, got {length[:40]!r}")
            size = int(length)
            if size > max_body_bytes:
                raise BadRequest("body", f"is {size} bytes; at most {max_body_bytes}", status=413)
            try:
                body = self.rfile.read(size)
            except TimeoutError as err:
                raise BadRequest(
                    "body", f"not received within {timeout:g} s (Content-Length {size})", status=408
                ) from err
            if len(body) < size:
                raise BadRequest("body", f"has {len(body)} bytes, not the {size} of its Content-Length")
            return body

        def do_POST(self):
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self.close_connection = True
                return self._error(404, f"unknown path {self.path}; use /v1/chat/completions")
            if not slots.acquire(timeout=timeout):  # bounded: bodies are read and generations run in a slot
                self.close_connection = True
                return self._error(503, "the server is busy; retry later", headers={"Retry-After": "1"})
            try:
                try:
                    body = self._read_body()
                    try:
                        request = json.loads(body)
                    except (UnicodeDecodeError, ValueError) as err:
                        raise BadRequest("body", f"is not valid JSON ({err})") from err
                    messages, limit, model = validate_request(request, chat.max_new_tokens)
                except BadRequest as err:
                    self.close_connection = True
                    return self._error(err.status, f"bad request: {err}", err.field)
                try:
                    reply, n_prompt, n_reply, finish = chat.complete(messages, limit)
                except Exception as err:  # noqa: BLE001 - the client gets a reply, not a dropped connection
                    return self._error(500, f"generation failed: {type(err).__name__}: {str(err)[:300]}")
            finally:
                slots.release()
            self._send(
                200,
                {
                    "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model or chat.name,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}
                    ],
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": n_reply,
                        "total_tokens": n_prompt + n_reply,
                    },
                },
            )

        def log_message(self, format, *args):  # quiet: one line per request is noise in tests
            pass

    return Handler


def make_server(
    lm: str = "smollm2-135m-instruct",
    host: str = "127.0.0.1",
    port: int = 0,
    max_new_tokens: int = 256,
    dtype: str = "float32",
    max_body_bytes: int = 1 << 20,
    timeout: float = 30.0,
    max_concurrent: int = 4,
    chat=None,
) -> ThreadingHTTPServer:
    """A server bound to (host, port) (port 0: a free one; see `server.server_address`), not yet
    serving. `chat`: any object with `name`, `max_new_tokens` and `complete(messages, max_tokens)`
    (default: a `ChatLM` of `lm`)."""
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("max_body_bytes", max_body_bytes),
        ("max_concurrent", max_concurrent),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not _is_number(timeout) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0")
    chat = chat if chat is not None else ChatLM(lm, max_new_tokens, dtype)
    slots = threading.BoundedSemaphore(max_concurrent)
    server = ThreadingHTTPServer((host, port), _handler(chat, max_body_bytes, timeout, slots))
    server.daemon_threads = True
    return server


def serve_in_background(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


def parser():
    from jsonargparse import ActionConfigFile

    parser = Parser(description=__doc__.split("\n\n")[0], prog=f"{PROG} serve-judge", default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--lm", type=str, default="smollm2-135m-instruct", help="the chat model (what load_lm accepts)")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="cap on the tokens of a reply")
    parser.add_argument("--dtype", type=str, default="float32")
    parser.add_argument("--max_body_bytes", type=int, default=1 << 20, help="larger bodies get 413")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a stalled client is cut off")
    parser.add_argument("--max_concurrent", type=int, default=4, help="requests served at once (others wait)")
    return parser


def main(args=None) -> None:
    """`lit-interventions serve-judge`."""
    ns = parser().parse_args(resolve_configs(args))
    if not 0 <= ns.port <= 65535:
        fail(f"--port={ns.port} is not a port (0..65535)")
    for name in ("max_new_tokens", "max_body_bytes", "max_concurrent"):
        if getattr(ns, name) < 1:
            fail(f"--{name}={getattr(ns, name)} must be a positive integer")
    if not ns.timeout > 0:
        fail(f"--timeout={ns.timeout} must be > 0 seconds")
    try:
        check_dtype(ns.dtype)
    except ValueError as err:
        fail(str(err))
    server = make_server(
        ns.lm, ns.host, ns.port, ns.max_new_tokens, ns.dtype, ns.max_body_bytes, ns.timeout, ns.max_concurrent
    )
    host, port = server.server_address[:2]
    print(f"serving {ns.lm} at http://{host}:{port}/v1/chat/completions", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
