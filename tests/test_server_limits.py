"""The judge server's limits on slow and numerous clients, on 127.0.0.1 with a tiny random-init
chat LM: trickling request heads are cut off at the header deadline, connections past the caps
(per address, in all) are refused with 503, idle keep-alive connections are closed, and a normal
request still gets 200 afterwards. Every test is bounded: sockets have timeouts, loops have
deadlines, and an alarm fails a test that runs past TEST_LIMIT seconds."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from lit_interventions.serving.http_server import ServerLimits, serve_in_background
from lit_interventions.serving.judge_server import make_server
from tests.helpers import time_limit

TEST_LIMIT = 60  # seconds, per test
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 8
BODY = json.dumps({"messages": [{"role": "user", "content": "The dog is here."}], "max_tokens": 3}).encode()
REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


@pytest.fixture(autouse=True)
def bounded():
    """Fail (not hang) a test that runs past TEST_LIMIT seconds."""
    with time_limit(TEST_LIMIT):
        yield


@pytest.fixture
def serve(tiny_lm_dir):
    """start(**options) -> server: a judge server of the tiny llama on 127.0.0.1, port 0, serving."""
    servers = []

    def start(**options):
        server = make_server(tiny_lm_dir("llama"), "127.0.0.1", 0, max_new_tokens=3, **options)
        serve_in_background(server)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _connect(server, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(server.server_address[:2], timeout=10, source_address=(source, 0))


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response read off `sock` (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _closed_after(sock: socket.socket, limit: float) -> tuple[float | None, bytes]:
    """(seconds until the server closed `sock`, or None when still open after `limit`; the bytes
    it sent before closing)."""
    started, got = time.monotonic(), b""
    while time.monotonic() - started < limit:
        if select.select([sock], [], [], 0.05)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                return time.monotonic() - started, got
            got += chunk
    return None, got


def _chat(server) -> tuple[int, dict]:
    """(status, payload) of a normal chat request on a new connection."""
    with _connect(server) as sock:
        sock.sendall(REQUEST)
        status, _, body = _response(sock)
    return status, json.loads(body)


def _trickle(socks: list[socket.socket], limit: float) -> list[tuple[float | None, bytes]]:
    """Send one byte of HEAD a second on each socket until the server closes it or `limit` seconds
    pass: per socket, (seconds until closed or None, the bytes the server sent)."""
    started = time.monotonic()
    closed: list[tuple[float | None, bytes] | None] = [None] * len(socks)
    k = 0
    while time.monotonic() - started < limit and any(c is None for c in closed):
        for i, sock in enumerate(socks):
            if closed[i] is not None:
                continue
            try:
                if select.select([sock], [], [], 0)[0] and not sock.recv(65536, socket.MSG_PEEK):
                    closed[i] = (time.monotonic() - started, b"")
                    continue
                sock.send(HEAD[k : k + 1])
            except OSError:
                closed[i] = (time.monotonic() - started, b"")
        k += 1
        time.sleep(max(0.0, k - (time.monotonic() - started)))
    return [c if c is not None else (None, b"") for c in closed]


def test_trickling_clients_are_cut_off_at_the_header_deadline(serve):
    server = serve(header_timeout=2.0)
    assert server.limits.header_timeout == 2.0
    socks = [_connect(server) for _ in range(12)]
    try:
        cut = _trickle(socks, limit=2.0 + 4.0)  # the deadline and slack
    finally:
        for sock in socks:
            sock.close()
    assert all(seconds is not None for seconds, _ in cut), cut  # 12 of 12 cut off
    assert all(got == b"" for _, got in cut)  # closed without a reply
    assert min(seconds for seconds, _ in cut) >= 1.5  # at the deadline, not at once
    status, payload = _chat(server)
    assert status == 200 and payload["object"] == "chat.completion"
    assert payload["usage"]["completion_tokens"] <= 3 and isinstance(payload["choices"][0]["message"]["content"], str)


def test_a_silent_connection_and_a_trickled_second_request_are_cut_off(serve):
    """uvicorn alone holds both: its keep-alive timer starts only after a response, and a byte
    stops it."""
    server = serve(header_timeout=2.0, keep_alive_timeout=30.0)
    with _connect(server) as silent, _connect(server) as kept:
        kept.sendall(REQUEST)
        assert _response(kept)[0] == 200  # a response: kept alive, the header deadline restarts
        seconds, got = _closed_after(silent, 6.0)
        assert seconds is not None and got == b""
        cut = _trickle([kept], limit=6.0)
        assert cut[0][0] is not None and cut[0][0] >= 1.0
    assert _chat(server)[0] == 200


def test_connections_past_the_caps_are_refused_with_503(serve):
    server = serve(max_connections=5, max_connections_per_client=3, header_timeout=20.0)
    held = [_connect(server) for _ in range(3)]
    try:
        with _connect(server) as extra:  # a 4th from 127.0.0.1
            seconds, got = _closed_after(extra, 5.0)
        assert seconds is not None and got.startswith(b"HTTP/1.1 503 ")
        payload = json.loads(got.partition(b"\r\n\r\n")[2])
        assert payload["error"]["message"] == "127.0.0.1 has 3 connections open; retry later"
        assert b"retry-after: 1" in got
        held += [_connect(server, "127.0.0.2") for _ in range(2)]  # another address: 5 in all
        for sock in held[3:]:
            assert _closed_after(sock, 0.5)[0] is None  # accepted, still open
        with _connect(server, "127.0.0.2") as sixth:
            seconds, got = _closed_after(sixth, 5.0)
        assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["message"] == (
            "the server has 5 connections open; retry later"
        )
        held.pop().close()
        held.pop().close()
        deadline = time.monotonic() + 5
        while server.connections > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections == 3
        with _connect(server, "127.0.0.2") as sock:  # room again: served
            sock.sendall(REQUEST)
            assert _response(sock)[0] == 200
    finally:
        for sock in held:
            sock.close()


def test_an_idle_keep_alive_connection_is_closed(serve):
    server = serve(keep_alive_timeout=1.0, header_timeout=20.0)
    with _connect(server) as sock:
        for _ in range(2):  # two requests on one connection: it is kept alive between them
            sock.sendall(REQUEST)
            status, headers, _ = _response(sock)
            assert status == 200 and "connection" not in headers
        seconds, got = _closed_after(sock, 10.0)
    assert seconds is not None and got == b""
    assert seconds < 20.0  # the keep-alive timeout closed it, not the header deadline
    assert server.connections == 0


def test_malformed_heads_are_json_errors_naming_the_reason(serve):
    server = serve()
    with _connect(server) as sock:  # an unfinished head over max_header_bytes (16 KiB): 431 at once
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000)
        status, headers, body = _response(sock)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"] == {
        "message": "bad request: Receive buffer too long",
        "type": "invalid_request_error",
        "param": None,
    }
    with _connect(server) as sock:  # a chunked body has no Content-Length: 411
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        status, _, body = _response(sock)
    assert status == 411 and json.loads(body)["error"]["param"] == "Content-Length"
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = _response(sock)
    assert status == 404 and json.loads(body)["error"]["message"] == "unknown path /v1/nothing"
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models/ HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = _response(sock)
    assert status == 200 and json.loads(body)["data"][0]["object"] == "model"


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("header_timeout", 0, "header_timeout=0 must be a number of seconds > 0"),
        ("keep_alive_timeout", float("inf"), "keep_alive_timeout=inf must be a number of seconds > 0"),
        ("max_connections", 0, "max_connections=0 must be an integer >= 1"),
        ("max_connections_per_client", 2.5, "max_connections_per_client=2.5 must be an integer >= 1"),
    ],
)
def test_bad_limits_are_refused_before_a_model_loads(option, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        make_server("no-such-model", "127.0.0.1", 0, **{option: value})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ServerLimits(**{option: value})
