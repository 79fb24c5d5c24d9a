"""A small OpenAI-compatible chat server for a local LM: POST /v1/chat/completions.

    python -m lit_interventions.judge_server --lm smollm2-135m-instruct --port 8000
    # then: judge: {backend: openai, base_url: http://127.0.0.1:8000/v1, model: smollm2-135m-instruct}

Greedy generation with the LM's chat template (`User: ...\\nAssistant:` when it has none), one
request at a time (a lock; the HTTP server itself is threaded). Answers the subset of the API the
judge uses: `messages`, `max_tokens` (capped by --max_new_tokens), and the usual response shape
with `choices[0].message.content` and `usage`. GET /v1/models lists the one model.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from lit_interventions.lm import load_lm, load_tokenizer


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
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        enc = self.tokenizer(self._prompt(messages), return_tensors="pt", add_special_tokens=not templated)
        room = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if room:  # keep the prompt's end and room for the reply
            keep = max(1, room - limit)
            enc = {k: v[:, -keep:] for k, v in enc.items()}
        with self.lock:
            out = self.model.generate(**{k: v.to(self.model.device) for k, v in enc.items()}, do_sample=False,
                                      max_new_tokens=limit, pad_token_id=self.tokenizer.pad_token_id)  # fmt: skip
        new = out[0, enc["input_ids"].shape[1]:]
        finish = "stop" if len(new) < limit or new[-1].item() == self.tokenizer.eos_token_id else "length"
        return self.tokenizer.decode(new, skip_special_tokens=True), enc["input_ids"].shape[1], len(new), finish


def _handler(chat: ChatLM):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [{"id": chat.name, "object": "model", "owned_by": "local"}]})
            else:
                self._error(404, f"unknown path {self.path}")

        def do_POST(self):
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                return self._error(404, f"unknown path {self.path}; use /v1/chat/completions")
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                messages = request["messages"]
                if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                    raise ValueError("messages must be a non-empty list of {role, content}")
            except (ValueError, KeyError, TypeError) as err:
                return self._error(400, f"bad request: {err}")
            reply, n_prompt, n_reply, finish = chat.complete(messages, request.get("max_tokens"))
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": request.get("model", chat.name),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply},
            })  # fmt: skip

        def log_message(self, format, *args):  # quiet: one line per request is noise in tests
            pass

    return Handler


def make_server(lm: str = "smollm2-135m-instruct", host: str = "127.0.0.1", port: int = 0,
                max_new_tokens: int = 256, dtype: str = "float32") -> ThreadingHTTPServer:  # fmt: skip
    """A server bound to (host, port) (port 0: a free one; see `server.server_address`), not yet serving."""
    server = ThreadingHTTPServer((host, port), _handler(ChatLM(lm, max_new_tokens, dtype)))
    server.daemon_threads = True
    return server


def serve_in_background(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


def main(args=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm", default="smollm2-135m-instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    ns = parser.parse_args(args)
    server = make_server(ns.lm, ns.host, ns.port, ns.max_new_tokens, ns.dtype)
    host, port = server.server_address[:2]
    print(f"serving {ns.lm} at http://{host}:{port}/v1/chat/completions", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
