"""What every server command shares: where it listens and its limits, as one set of options
(`add_server_options`), one check of them (`check_server_options`), the `ServerLimits` they make
(`server_limits`), serving until stopped (`serve_until_stopped`), and the name clients see of a
model or an artifact (`public_name`: never a local path). The judge server (`serve-judge`) and
the steered server (`serve`) both use them."""

from __future__ import annotations

import errno
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from lit_interventions.cli.parsing import fail
from lit_interventions.core.signals import Stopped, consume_pending
from lit_interventions.serving.chat_request import is_int, is_number
from lit_interventions.serving.http_server import HTTPServer, ServerLimits, listen

# the options that become make_server's keyword arguments
LIMITS = (
    "max_body_bytes",
    "timeout",
    "max_concurrent",
    "header_timeout",
    "keep_alive_timeout",
    "max_connections",
    "max_connections_per_client",
)


def public_name(where: str) -> str:
    """What clients are told an LM or an artifact is: the name of a local directory or file
    (its last component), never its path; an embedded model's name or a hub id as it is."""
    path = Path(where).expanduser()
    return path.resolve().name if path.exists() else where


def add_server_options(parser, max_concurrent: int) -> None:
    """--host, --port and the limits (defaults: loopback, port 8000, `max_concurrent` slots)."""
    add = parser.add_argument
    add("--host", type=str, default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=8000, help="port (0: a free one)")
    add("--max_body_bytes", type=int, default=1 << 20, help="larger bodies get 413")
    add("--timeout", type=float, default=30.0, help="seconds to wait for a free slot and for a body")
    add("--max_concurrent", type=int, default=max_concurrent, help="requests served at once (others wait)")
    add(
        "--header_timeout",
        type=float | None,
        default=None,
        help="seconds for a request line and headers to arrive (default: the smaller of 10 and --timeout)",
    )
    add("--keep_alive_timeout", type=float, default=5.0, help="seconds an idle connection is kept")
    add("--max_connections", type=int, default=64, help="connections open at once (others: 503)")
    add("--max_connections_per_client", type=int, default=16, help="connections open at once from one address")


def check_server_options(ns, positive: tuple[str, ...] = ()) -> None:
    """One error line for the first bad server option (and for the command's own `positive`
    integer options), before anything loads."""
    if not 0 <= ns.port <= 65535:
        fail(f"--port={ns.port} is not a port (0..65535)")
    for name in (*positive, "max_body_bytes", "max_concurrent", "max_connections", "max_connections_per_client"):
        if getattr(ns, name) < 1:
            fail(f"--{name}={getattr(ns, name)} must be a positive integer")
    for name in ("timeout", "header_timeout", "keep_alive_timeout"):
        value = getattr(ns, name)
        if value is not None and not 0 < value < float("inf"):
            fail(f"--{name}={value} must be > 0 seconds")


def open_port(ns) -> socket.socket:
    """The socket the command serves on, bound and listening at --host and --port before anything
    loads (and held while it does); a port another process holds, or a host that is not this
    machine's, is one error line (exit status 2)."""
    try:
        return listen(ns.host, ns.port, ns.max_connections)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            fail(
                f"--port={ns.port}: {ns.host}:{ns.port} is in use (another server listens there); "
                "stop that one or choose another --port (0: a free one)"
            )
        fail(f"cannot listen on {ns.host}:{ns.port}: {err.strerror or err}")


def limit_options(ns) -> dict:
    """The limits of the parsed options, as make_server's keyword arguments."""
    return {name: getattr(ns, name) for name in LIMITS}


def server_limits(
    max_body_bytes: int,
    max_concurrent: int,
    timeout: float,
    header_timeout: float | None,
    keep_alive_timeout: float,
    max_connections: int,
    max_connections_per_client: int,
) -> ServerLimits:
    """The connection limits of a server, each checked (a ValueError naming the first bad one);
    `header_timeout` None: the smaller of 10 s and `timeout`."""
    for name, value in (("max_body_bytes", max_body_bytes), ("max_concurrent", max_concurrent)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not is_number(timeout) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0")
    return ServerLimits(
        header_timeout=min(10.0, timeout) if header_timeout is None else header_timeout,
        keep_alive_timeout=keep_alive_timeout,
        max_connections=max_connections,
        max_connections_per_client=max_connections_per_client,
    )


def serve_until_stopped(server: HTTPServer, what: str, path: str, close: Callable[[], None] | None = None) -> None:
    """Print `serving WHAT at http://HOST:PORT/PATH`, serve until SIGTERM or SIGINT (a server's
    normal stop: one line, `stopped serving ...`, and exit status 0), then close the server (and
    `close()`)."""
    host, port = server.server_address[:2]
    print(f"serving {what} at http://{host}:{port}{path}", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, Stopped):
        signum = consume_pending()
        name = signal.Signals(signum).name if signum else "SIGINT"
        print(f"stopped serving {what} ({name})", file=sys.stderr, flush=True)
    finally:
        server.server_close()
        if close is not None:
            close()
