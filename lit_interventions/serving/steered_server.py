"""An OpenAI-compatible server for a frozen LM with artifacts applied: /v1/chat/completions,
/v1/completions and /v1/models.

    lit-interventions serve --artifact checkpoints/axbench/builtin-diffmean --concept 3 --factor 4
    # then: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").chat.completions.create(
    #     model="smollm2-135m-instruct", messages=[...], extra_body={"concept": 1, "factor": 6})

A request may name its `concept` (a name or an index), its `factor`, its `gate` (true, a
threshold, or false: a dictionary's edit only where the concept's latent > τ, `inference.gate`)
and `steering` (false: the LM unedited); the defaults are --concept, --factor and --gate. Greedy decoding unless `temperature` > 0;
`max_tokens` (capped by --max_new_tokens), `stop`, `stream` (server-sent events) and
`stream_options.include_usage` as OpenAI has them. Concurrent requests with the same sampling
settings are batched, up to --max_batch rows in one `transformers` `generate` (each row with its
own steering); a batch waits at most --batch_wait_ms for its rows.

The limits are the judge server's (`judge_server`): loopback unless --host says otherwise, a body
over --max_body_bytes is 413, one not in within --timeout seconds 408, malformed JSON or a bad
field 400 naming it, at most --max_concurrent requests hold a slot (the others wait up to
--timeout, then 503), and the connection caps and deadlines of `http_server.ServerLimits`. The
port is bound before anything loads: one in use is one error line (exit status 2).

This module holds the server (`make_server`) and its command line; the model and its batching
live in `steered_lm.py` and `batcher.py`, the routes in `steered_routes.py`, the request checks in
`completion_request.py`.
"""

from __future__ import annotations

import asyncio
import math
import socket

from lit_interventions.cli.parsing import PROG, Parser, fail, resolve_configs
from lit_interventions.core.lm import check_device, check_dtype
from lit_interventions.inference.cli import add_artifact_options, add_gate_option, checked_gate, command_artifacts
from lit_interventions.serving.http_server import HTTPServer
from lit_interventions.serving.json_api import json_app
from lit_interventions.serving.server_options import (
    add_server_options,
    check_server_options,
    limit_options,
    open_port,
    serve_until_stopped,
    server_limits,
)
from lit_interventions.serving.steered_lm import SteeredLM
from lit_interventions.serving.steered_routes import steered_routes

__all__ = ["main", "make_server", "parser"]


def make_server(
    steered: SteeredLM,
    host: str = "127.0.0.1",
    port: int = 0,
    max_body_bytes: int = 1 << 20,
    timeout: float = 30.0,
    max_concurrent: int = 16,
    header_timeout: float | None = None,
    keep_alive_timeout: float = 5.0,
    max_connections: int = 64,
    max_connections_per_client: int = 16,
    sock: socket.socket | None = None,
) -> HTTPServer:
    """A server of `steered` bound to (host, port) (port 0: a free one; see
    `server.server_address`), or on `sock` (a socket already listening, `http_server.listen`),
    not yet serving (`serve_forever()`, or `serve_in_background(server)`; stop with
    `shutdown()`, then `steered.close()`). As the
    server stops, the requests waiting, queued or generating end at once with 503
    (`SteeredLM.stop`). `header_timeout` None: the smaller of 10 s and `timeout`."""
    limits = server_limits(
        max_body_bytes,
        max_concurrent,
        timeout,
        header_timeout,
        keep_alive_timeout,
        max_connections,
        max_connections_per_client,
    )
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        steered.stop()

    app = json_app(steered_routes(steered, max_body_bytes, timeout, max_concurrent, stopping))
    return HTTPServer(app, host, port, limits, on_stop=stop, sock=sock)


def parser() -> Parser:
    """The `serve` command line (jsonargparse, with --config)."""
    from jsonargparse import ActionConfigFile

    parser = Parser(description=__doc__.split("\n\n")[0], prog=f"{PROG} serve", default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile)
    add = parser.add_argument
    add_artifact_options(parser)
    add("--max_new_tokens", type=int, default=256, help="cap on the tokens of a reply")
    add("--max_batch", type=int, default=8, help="requests generated together in one batch")
    add("--batch_wait_ms", type=float, default=10.0, help="how long a request waits for others to batch with")
    add("--concept", type=str | None, default=None, help="the concept of requests naming none: a name or an index")
    add("--factor", type=float, default=1.0, help="the factor of requests giving none")
    add_gate_option(parser)
    add("--device", type=str, default="cpu", help="where the LM runs: cpu, cuda, cuda:1, mps")
    add_server_options(parser, max_concurrent=16)
    return parser


def check_options(ns) -> None:
    """One error line for the first bad option, before anything loads."""
    check_server_options(ns, positive=("max_new_tokens", "max_batch"))
    if not 0 <= ns.batch_wait_ms < float("inf"):
        fail(f"--batch_wait_ms={ns.batch_wait_ms} must be a number of milliseconds >= 0")
    if not math.isfinite(ns.factor):
        fail(f"--factor={ns.factor} must be a finite number")
    try:
        check_dtype(ns.dtype)
        check_device(ns.device)
    except ValueError as err:
        fail(str(err))


def main(args: list[str] | None = None) -> None:
    """`lit-interventions serve`."""
    ns = parser().parse_args(resolve_configs(args))
    check_options(ns)
    sock = open_port(ns)  # a port in use is refused before anything loads
    artifacts, lm = command_artifacts(ns.artifact, ns.lm, ns.concept, ns.trust_remote_code)
    gate = checked_gate(ns.gate, artifacts)
    try:
        steered = SteeredLM(
            artifacts,
            lm,
            max_new_tokens=ns.max_new_tokens,
            dtype=ns.dtype,
            device=ns.device,
            concept=ns.concept,
            factor=ns.factor,
            gate=gate,
            max_batch=ns.max_batch,
            batch_wait_ms=ns.batch_wait_ms,
            trust_remote_code=ns.trust_remote_code,
        )
    except ValueError as err:
        fail(str(err).splitlines()[0])
    server = make_server(steered, ns.host, ns.port, **limit_options(ns), sock=sock)
    serve_until_stopped(server, f"{steered.lm_name} with {', '.join(ns.artifact)}", "/v1", steered.close)
