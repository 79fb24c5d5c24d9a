"""The endpoint client (`core/chat_endpoint.py`, behind the `openai` judge and `concepts
--base_url`) against a fake endpoint on 127.0.0.1 that misbehaves on purpose, one scripted reply
per connection: a reply trickled a byte at a time, no reply at all, a reply larger than the cap
(announced, or chunked without a length), a reply shorter than its Content-Length, and a 401 that
echoes the request's headers. Every wait in the fake endpoint is bounded, and an alarm fails a
test that runs past TEST_LIMIT seconds."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from datamodules.concepts_generators import EndpointGenerator
from lit_interventions.core.chat_endpoint import ChatRequestError, redact
from lit_interventions.metrics.judge import make_judge
from tests.helpers import time_limit

TEST_LIMIT = 60  # seconds, per test
KEY = "sk-test-0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def bounded():
    """Fail (not hang) a test that runs past TEST_LIMIT seconds."""
    with time_limit(TEST_LIMIT):
        yield


def _reply(body: bytes, status: str = "200 OK", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    return head.encode() + body


def completion(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def _send(conn: socket.socket, data: bytes, pause: float = 0.0) -> bool:
    try:
        conn.sendall(data)
    except OSError:  # the client has gone
        return False
    time.sleep(pause)
    return True


def ok(text: str = "Rating: [[2]]"):
    return lambda conn, request: _send(conn, _reply(completion(text)))


def trickle(conn, request):
    """Headers at once, then one byte of the body every 0.2 s (for at most 30 s)."""
    if _send(conn, _reply(b"", length=1000)):
        for _ in range(150):
            if not _send(conn, b" ", pause=0.2):
                return


def silent(conn, request):
    """Read the request, answer nothing (for at most 30 s, or until the client leaves)."""
    conn.settimeout(30)
    try:
        conn.recv(1)
    except OSError:
        pass


def short(conn, request):
    """Announce 100 bytes, send 10, close."""
    _send(conn, _reply(b'{"choices"', length=100))


def chunked_flood(conn, request):
    """A chunked reply without a length: 1 KiB chunks, up to 64 KiB."""
    if _send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"):
        for _ in range(64):
            if not _send(conn, b"400\r\n" + b"[" * 1024 + b"\r\n", pause=0.01):
                return


def echo_headers(status: str):
    """The request's head echoed back in the body, as a misconfigured proxy does."""
    return lambda conn, request: _send(conn, _reply(request.split(b"\r\n\r\n")[0], status))


class FakeEndpoint:
    """A TCP server on 127.0.0.1 answering its n-th connection with `behaviours[n]` (the last one
    repeats); `requests` holds the raw requests it read."""

    def __init__(self, behaviours):
        self.behaviours, self.requests = list(behaviours), []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            behaviour = self.behaviours[min(len(self.requests), len(self.behaviours) - 1)]
            self.requests.append(None)
            threading.Thread(target=self._serve, args=(conn, len(self.requests) - 1, behaviour), daemon=True).start()

    def _serve(self, conn, index, behaviour):
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.requests[index] = data
            behaviour(conn, data)

    def close(self):
        self.closed = True
        self.sock.close()


@pytest.fixture
def endpoint():
    made = []

    def start(*behaviours):
        made.append(FakeEndpoint(behaviours))
        return made[-1]

    yield start
    for fake in made:
        fake.close()


def _judge(fake: FakeEndpoint, **options):
    return make_judge("openai", base_url=fake.base_url, model="m", cache=None, backoff=0.0, **options)


def test_a_trickled_or_missing_reply_ends_at_the_total_deadline(endpoint):
    fake = endpoint(trickle)
    started = time.monotonic()
    with pytest.raises(ChatRequestError) as err:
        _judge(fake, timeout=1.0, retries=0).ask(["Rate this."])
    assert time.monotonic() - started < 5  # the trickle alone would last 30 s
    assert str(err.value) == f"judge endpoint {fake.base_url}/chat/completions did not answer within 1 s"
    assert err.value.retry
    fake = endpoint(silent)
    generator = EndpointGenerator(fake.base_url, "m", timeout=1.0, retries=1, backoff=0.0)
    started = time.monotonic()
    with pytest.raises(ChatRequestError, match=r"did not answer within 1 s \(after 2 attempts\)$"):
        generator.generate(["Write."], [0])
    assert time.monotonic() - started < 6 and len(fake.requests) == 2


def test_a_reply_past_the_cap_is_refused_as_it_arrives(endpoint):
    fake = endpoint(lambda conn, request: _send(conn, _reply(b"[" * 5000)), chunked_flood, ok())
    judge = _judge(fake, timeout=10.0, retries=3)
    judge.max_reply_bytes = 2000
    for announced in (True, False):  # refused at its Content-Length; counted as its chunks arrive
        with pytest.raises(ChatRequestError) as err:
            judge.ask(["Rate this."])
        said = re.fullmatch(
            rf"judge endpoint {judge.url} sent a reply of (\d+) bytes or more; at most 2000 are read", str(err.value)
        )
        size = int(said.group(1))
        assert size == 5000 if announced else 2000 < size <= 2000 + 8 * 1024
        assert not err.value.retry  # not asked again
    assert len(fake.requests) == 2 and judge.ask(["Rate this."]) == ["Rating: [[2]]"]


def test_a_reply_cut_short_is_asked_again(endpoint, caplog):
    fake = endpoint(short, short, ok("fine"))
    assert _judge(fake, retries=2).ask(["Rate this."]) == ["fine"] and len(fake.requests) == 3
    assert "sent an incomplete reply (peer closed connection without sending complete message body" in caplog.text
    fake = endpoint(short)
    with pytest.raises(ChatRequestError, match=r"sent an incomplete reply .* \(after 2 attempts\)$"):
        _judge(fake, retries=1).ask(["Rate this."])


def test_no_message_shows_the_key(endpoint, monkeypatch, caplog):
    monkeypatch.setenv("LIT_TEST_KEY", KEY)

    def bare_key(conn, request):  # the key's value alone, and a token after a lower-case "bearer"
        return _send(conn, _reply(json.dumps({"echo": KEY, "h": "bearer abc.def"}).encode()))

    fake = endpoint(echo_headers("401 Unauthorized"), echo_headers("503 Service Unavailable"), bare_key)
    judge = _judge(fake, api_key_env="LIT_TEST_KEY", retries=0)
    with pytest.raises(ChatRequestError) as err:
        judge.ask(["Rate this."])
    assert b"Authorization: Bearer " + KEY.encode() in fake.requests[0]  # the key was sent
    message = str(err.value)
    assert message.startswith(f"judge endpoint {judge.url} answered HTTP 401: POST /v1/chat/completions HTTP/1.1")
    assert "Bearer [redacted]" in message and KEY not in message and KEY[:12] not in message
    judge.retries = 1
    with pytest.raises(ChatRequestError) as err:  # a 503 is retried and logged; then no completion
        judge.ask(["Rate this."])
    message = str(err.value)
    assert message.endswith(
        """sent no chat completion: {'echo': '[redacted]', 'h': 'Bearer [redacted]'} (after 2 attempts)"""
    )
    assert KEY[:12] not in caplog.text + message and "Bearer [redacted]" in caplog.text
    assert redact(f"x {KEY} Bearer abc, y", (KEY,)) == "x [redacted] Bearer [redacted], y"


def test_an_unreachable_endpoint_is_named(endpoint):
    fake = endpoint(ok())
    fake.close()
    time.sleep(0.3)
    with pytest.raises(ChatRequestError, match=rf"{fake.base_url}/chat/completions is unreachable: ConnectError"):
        _judge(fake, retries=0).check()
