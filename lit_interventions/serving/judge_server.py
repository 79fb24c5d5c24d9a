"""A small OpenAI-compatible chat server for a local LM: POST /v1/chat/completions.

    lit-interventions serve-judge --lm smollm2-135m-instruct --port 8000
    # then: judge: {backend: openai, base_url: http://127.0.0.1:8000/v1, model: smollm2-135m-instruct}

Greedy generation with the LM's chat template (`User: ...\\nAssistant:` when it has none), one
generation at a time (a lock), in worker threads of an asyncio server (uvicorn, h11) with
Starlette routes; at most `max_concurrent` requests past their headers hold a slot at once (the
others wait up to `timeout` seconds, then get 503), so memory stays bounded. Answers the subset of
the API the judge uses: `messages`, `max_tokens` (or `max_completion_tokens`; capped by
--max_new_tokens), and the usual response shape with `choices[0].message.content` and `usage`.
GET /v1/models lists the one model by its name (`public_name`: a local directory's or a .gguf
file's own name, an embedded model's name or a hub id as given), never its path; a reply's
`model` is the request's, else that name.

Every field is checked (type and range): a bad one is a 400 reply naming it. A body over
`max_body_bytes` is 413 (without reading it), a missing Content-Length 411 (chunked bodies
included), a body not in within `timeout` seconds 408. Slow and numerous
clients are bounded by the server (`http_server.ServerLimits`): the request line and headers must
arrive within `header_timeout` seconds (default: the smaller of 10 and `timeout`) or the connection
is closed, an idle keep-alive connection is closed after `keep_alive_timeout` seconds, and
connections past `max_connections` in all or `max_connections_per_client` from one address are
refused with 503. It binds to loopback unless --host says otherwise.

This module holds the chat model (`ChatLM`), the server (`make_server`) and its command line; the
request checks live in `chat_request.py`, the routes in `chat_handler.py`, the JSON errors and
bounded body reads in `json_api.py`, and the server with its connection limits in `http_server.py`.
"""

from __future__ import annotations

import socket
import threading

import torch

from lit_interventions.cli.parsing import PROG, Parser, fail, resolve_configs
from lit_interventions.core.lm import check_dtype, load_lm, load_tokenizer
from lit_interventions.serving.chat_handler import chat_routes
from lit_interventions.serving.chat_request import chat_text, is_int
from lit_interventions.serving.http_server import HTTPServer
from lit_interventions.serving.json_api import json_app
from lit_interventions.serving.server_options import (
    add_server_options,
    check_server_options,
    limit_options,
    open_port,
    public_name,
    serve_until_stopped,
    server_limits,
)

__all__ = ["ChatLM", "main", "make_server", "parser"]


class ChatLM:
    """Greedy chat completions of one local LM; `name` is what clients see of it (never a path)."""

    def __init__(self, lm: str = "smollm2-135m-instruct", max_new_tokens: int = 256, dtype: str = "float32"):
        self.name, self.max_new_tokens = public_name(lm), max_new_tokens
        self.model, self.tokenizer = load_lm(lm, dtype), load_tokenizer(lm)
        self.lock = threading.Lock()

    @torch.no_grad()
    def complete(self, messages: list[dict], max_tokens: int | None = None) -> tuple[str, int, int, str]:
        """(reply, prompt tokens, completion tokens, finish reason)."""
        limit = min(max_tokens or self.max_new_tokens, self.max_new_tokens)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        text, templated = chat_text(self.tokenizer, messages)
        enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=not templated)
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
    header_timeout: float | None = None,
    keep_alive_timeout: float = 5.0,
    max_connections: int = 64,
    max_connections_per_client: int = 16,
    sock: socket.socket | None = None,
) -> HTTPServer:
    """A server bound to (host, port) (port 0: a free one; see `server.server_address`), not yet
    serving (`serve_forever()`, or `serve_in_background(server)`; stop with `shutdown()`). `chat`:
    any object with `name`, `max_new_tokens` and `complete(messages, max_tokens)` (default: a
    `ChatLM` of `lm`). `header_timeout` None: the smaller of 10 s and `timeout`. `sock`: a socket
    already listening (`http_server.listen`), served instead of binding (host, port)."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    limits = server_limits(
        max_body_bytes,
        max_concurrent,
        timeout,
        header_timeout,
        keep_alive_timeout,
        max_connections,
        max_connections_per_client,
    )
    chat = chat if chat is not None else ChatLM(lm, max_new_tokens, dtype)
    app = json_app(chat_routes(chat, max_body_bytes, timeout, max_concurrent))
    return HTTPServer(app, host, port, limits, sock=sock)


def parser():
    """The `serve-judge` command line (jsonargparse, with --config)."""
    from jsonargparse import ActionConfigFile

    parser = Parser(description=__doc__.split("\n\n")[0], prog=f"{PROG} serve-judge", default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--lm", type=str, default="smollm2-135m-instruct", help="the chat model (what load_lm accepts)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="cap on the tokens of a reply")
    parser.add_argument("--dtype", type=str, default="float32")
    add_server_options(parser, max_concurrent=4)
    return parser


def main(args=None) -> None:
    """`lit-interventions serve-judge`."""
    ns = parser().parse_args(resolve_configs(args))
    check_server_options(ns, positive=("max_new_tokens",))
    try:
        check_dtype(ns.dtype)
    except ValueError as err:
        fail(str(err))
    sock = open_port(ns)  # a port in use is refused before the LM loads
    server = make_server(ns.lm, ns.host, ns.port, ns.max_new_tokens, ns.dtype, **limit_options(ns), sock=sock)
    serve_until_stopped(server, ns.lm, "/v1/chat/completions")
