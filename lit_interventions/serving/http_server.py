"""A bounded HTTP/1.1 server for any ASGI app: uvicorn (h11) with limits on slow and numerous clients.

What uvicorn gives as it is, and what `GuardedH11Protocol` adds:

- idle keep-alive: uvicorn's `timeout_keep_alive` closes a connection that sends nothing for that
  long after a response (`ServerLimits.keep_alive_timeout`);
- header size: h11's `max_incomplete_event_size` (uvicorn's `h11_max_incomplete_event_size`) caps the
  bytes buffered of an unfinished request line and headers (`max_header_bytes`; over it: 431). A
  head that arrives whole in one read (asyncio reads up to 256 KiB) is parsed as it is;
- a header deadline: uvicorn has none (its keep-alive timer starts only after a first response and
  stops at the next byte, so a client sending a byte a second is held forever). The guard closes a
  connection whose request line and headers are not complete within `header_timeout` seconds of
  its opening or of its previous response;
- connection caps: uvicorn's `limit_concurrency` answers 503 only once a request's headers are in,
  so it does not stop clients that never finish them. The guard refuses a connection at once (503,
  then closed) past `max_connections` open in total or `max_connections_per_client` from one
  address;
- malformed requests: uvicorn's 400 says "Invalid HTTP request received."; the guard's names h11's
  reason ("bad Content-Length") in the JSON error shape of the apps here.

Body deadlines, body sizes and request slots are the app's (`json_api.read_body`): the ASGI app
sees the request once its headers are in. `HTTPServer` binds its socket at construction (port 0:
a free one, see `server_address`), or takes one bound before (`listen`), and serves with
`serve_forever()` (blocking) or `serve_in_background(server)`; `shutdown()` (or SIGTERM/SIGINT to `serve_forever` in the main
thread) stops it with uvicorn's graceful shutdown: no new connections, and the open requests get
up to `shutdown_timeout` seconds to end. `on_stop` (called on the event loop as the shutdown
begins) lets the app end its requests at once; a request task that uvicorn still has to cancel at
the end of the graceful period ends quietly, without a traceback. Any ASGI app can be served, e.g.
a Starlette app with more routes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

__all__ = ["GuardedH11Protocol", "HTTPServer", "ServerLimits", "error_payload", "listen", "serve_in_background"]


def error_payload(status: int, message: str, field: str | None = None) -> dict:
    """An OpenAI-style error body: invalid_request_error below 500, server_error from 500."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": field}}


@dataclass(frozen=True)
class ServerLimits:
    """The server's bounds on connections (seconds, counts, bytes); see the module docstring."""

    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 64
    max_connections_per_client: int = 16
    max_header_bytes: int = 16 * 1024
    shutdown_timeout: float = 5.0

    def __post_init__(self):
        for name in ("header_timeout", "keep_alive_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0")
        for name in ("max_connections", "max_connections_per_client", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")


class _Connection(h11.Connection):
    """An h11 connection that keeps the last protocol error it raised (for the 400 reply)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as err:
            self.error = err
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and connection caps (`limits`, set on a
    subclass by `HTTPServer`)."""

    limits = ServerLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.config.h11_max_incomplete_event_size or self.limits.max_header_bytes)
        self._deadline = None
        self._awaiting = None  # the cycle (request) current when the deadline was set

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        mine = sum(1 for c in self.connections if c.client and c.client[0] == host)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(f"the server has {self.limits.max_connections} connections open; retry later")
        elif mine > self.limits.max_connections_per_client:
            self._refuse(f"{host} has {self.limits.max_connections_per_client} connections open; retry later")
        else:
            self._arm()

    def _refuse(self, message: str) -> None:
        """Write a 503 before any request (h11 cannot: no request yet) and close."""
        self.connections.discard(self)
        body = json.dumps(error_payload(503, message)).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _arm(self) -> None:
        """Start the header deadline for the next request."""
        self._disarm()
        self._awaiting = self.cycle
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        """The request line and headers did not arrive in time: close without a reply."""
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._awaiting:  # a new request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete  # no pipelined request started
        if idle and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """The reply to a request h11 cannot parse: its reason, as a JSON error, then close."""
        error = self.conn.error
        status = getattr(error, "error_status_hint", 400) if error else 400
        reason = str(error) if error and str(error) else msg
        body = json.dumps(error_payload(status, f"bad request: {reason}")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_stop` as its shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] | None):
        super().__init__(config)
        self.on_stop = on_stop

    async def shutdown(self, sockets=None) -> None:
        if self.on_stop is not None:
            self.on_stop()
        await super().shutdown(sockets)


class _QuietWhenStopping:
    """An ASGI app whose request tasks, cancelled by uvicorn at the end of a graceful shutdown,
    end without the traceback uvicorn would log for them."""

    server: uvicorn.Server | None = None

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if self.server is None or not self.server.should_exit:
                raise


def listen(host: str, port: int, max_connections: int = ServerLimits.max_connections) -> socket.socket:
    """A TCP socket listening on (host, port), IPv4 or IPv6 as the host is, with a backlog of
    2 × `max_connections`; an OSError when the port is taken (EADDRINUSE) or the host is not this
    machine's."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, not one in use
        sock.bind((host, port))
        sock.listen(2 * max_connections)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HTTPServer:
    """`app` (ASGI) served by uvicorn on (host, port) under `limits`; bound, not yet serving.
    `on_stop`: called on the server's event loop when its shutdown begins (see the module doc).
    `sock`: a socket already listening (`listen`), served instead of binding (host, port)."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
        on_stop: Callable[[], None] | None = None,
        sock: socket.socket | None = None,
    ):
        self.limits = limits or ServerLimits()
        backlog = 2 * self.limits.max_connections
        self.socket = sock if sock is not None else listen(host, port, self.limits.max_connections)
        self.server_address = self.socket.getsockname()
        protocol = type("Protocol", (GuardedH11Protocol,), {"limits": self.limits})
        guarded = _QuietWhenStopping(app)
        config = uvicorn.Config(
            guarded,
            interface="asgi3",
            http=protocol,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            backlog=backlog,
            timeout_keep_alive=self.limits.keep_alive_timeout,
            timeout_graceful_shutdown=self.limits.shutdown_timeout,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
        )
        self.uvicorn = guarded.server = _Server(config, on_stop)
        self._started, self._stopped = threading.Event(), threading.Event()

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self.uvicorn.server_state.connections)

    def serve_forever(self) -> None:
        """Serve until `shutdown()` (or SIGINT/SIGTERM when run in the main thread)."""
        self._started.set()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving (open requests get up to `limits.shutdown_timeout` s) and wait for it."""
        self.uvicorn.should_exit = True
        if self._started.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket."""
        self.socket.close()


def serve_in_background(server: HTTPServer) -> threading.Thread:
    """Serve in a daemon thread (started); stop with `server.shutdown()`."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread
