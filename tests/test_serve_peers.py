"""`lit-interventions serve` under clients that misbehave, run as a user runs it: the command in a
subprocess on 127.0.0.1 (port 0), on the tiny llama with a three-concept dictionary, started and
stopped by its PID. Each forward pass of the served LM sleeps SLOW_STEP seconds and counts itself
in a file, so a long request is long on any machine and the test sees whether the LM still
generates. Clients that leave free their slot and stop their row, SIGTERM and SIGINT on a busy
server end it in one line with exit status 0, clients never see a file path, too-deep JSON is a
400, and a request naming no concept is served with none. Every test is bounded: sockets have
timeouts, loops have deadlines, and an alarm fails a test that runs past TEST_LIMIT seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from tests.helpers import ROOT, run_command, time_limit

TEST_LIMIT = 180  # seconds, per test
PROMPT = "The dog is here."
SERVE = """
import os, runpy, sys, time
from transformers.models.llama import modeling_llama

step, counter, calls = float(os.environ["SLOW_STEP"]), os.environ["FORWARDS"], [0]
forward = modeling_llama.LlamaForCausalLM.forward

def counted(self, *args, **kwargs):
    calls[0] += 1
    with open(counter, "w") as f:
        f.write(str(calls[0]))
    time.sleep(step)
    return forward(self, *args, **kwargs)

modeling_llama.LlamaForCausalLM.forward = counted
sys.argv = ["lit-interventions", *sys.argv[1:]]
runpy.run_module("lit_interventions", run_name="__main__")
"""


@pytest.fixture(autouse=True)
def bounded():
    """Fail (not hang) a test that runs past TEST_LIMIT seconds."""
    with time_limit(TEST_LIMIT):
        yield


@pytest.fixture(scope="module")
def dictionary_dir(tmp_path_factory, tiny_lm_dir):
    """A saved three-concept dictionary for the tiny llama, in a directory named "dictionary"."""
    vectors = torch.nn.functional.normalize(torch.randn(3, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    dictionary = Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([2.0, 3.0, 1.0]),
        concepts=["dogs", "giving", "rent"],
        model=tiny_lm_dir("llama"),
        layer=1,
        method="diffmean",
    )
    return str(dictionary.save_pretrained(tmp_path_factory.mktemp("peers") / "dictionary"))


class Served:
    """A running `serve` process: its base URL, its PID, and how many forward passes it made."""

    def __init__(self, process: subprocess.Popen, url: str, forwards: Path):
        self.process, self.url, self.forwards_file = process, url, forwards
        self.address = tuple(url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1))
        self.address = (self.address[0], int(self.address[1]))

    @property
    def forwards(self) -> int:
        text = self.forwards_file.read_text() if self.forwards_file.exists() else ""
        return int(text) if text.strip().isdigit() else 0

    def stop(self, signum: int = signal.SIGTERM, wait: float = 60.0) -> tuple[int, str]:
        """Send `signum` to the PID; (exit status, stderr) once it has ended."""
        os.kill(self.process.pid, signum)
        _, stderr = self.process.communicate(timeout=wait)
        return self.process.returncode, stderr


@pytest.fixture
def serve(dictionary_dir, tmp_path):
    """start(*options, slow=...) -> Served: the command serving the dictionary on port 0."""
    started = []

    def start(*options: str, slow: float = 0.0) -> Served:
        forwards = tmp_path / f"forwards-{len(started)}"
        command = [sys.executable, "-c", SERVE, "serve", "--artifact", dictionary_dir, "--port", "0", *options]
        env = {**os.environ, "SLOW_STEP": str(slow), "FORWARDS": str(forwards)}
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(process)
        line = process.stdout.readline().strip()
        assert line.startswith("serving ") and " at http://127.0.0.1:" in line, line
        return Served(process, line.rpartition(" at ")[2], forwards)

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


def _post(url: str, body, path: str = "/completions", timeout: float = 60.0) -> tuple[int, dict]:
    """(status, payload) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _abandon(served: Served, body: dict, wait: float = 0.5) -> None:
    """Send a request, then close the connection after `wait` seconds without reading a reply."""
    data = json.dumps(body).encode()
    with socket.create_connection(served.address, timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        time.sleep(wait)


def _wait_for(condition, within: float) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_clients_that_leave_free_their_slots_and_stop_their_rows(serve):
    # 100 tokens take >= 10 s; a slot is waited for 3 s: two abandoned requests that kept their
    # slots would turn the next one away (503). One row at a time: the second waits in the queue.
    served = serve("--max_concurrent", "2", "--timeout", "3", "--max_batch", "1", "--max_new_tokens", "100", slow=0.1)
    long = {"prompt": PROMPT, "max_tokens": 100, "concept": "dogs"}
    for _ in range(2):
        _abandon(served, long)
    assert _wait_for(lambda: served.forwards > 0, 30)  # the first one generated
    status, payload = _post(served.url, {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and payload["usage"]["completion_tokens"] == 2, payload
    made = served.forwards
    assert made < 30  # the abandoned rows stopped at once (one would run 100 steps)
    time.sleep(1.0)
    assert served.forwards == made  # nothing generates for nobody
    code, stderr = served.stop()
    assert code == 0 and "Traceback" not in stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_busy_server_stops_in_one_line_with_status_0(serve, dictionary_dir, tiny_lm_dir, signum):
    served = serve("--max_new_tokens", "100", "--max_batch", "2", slow=0.1)
    replies, streamed = [], []

    def ask():
        replies.append(_post(served.url, {"prompt": PROMPT, "max_tokens": 100, "concept": "dogs"}))

    def stream():
        data = json.dumps({"prompt": PROMPT, "max_tokens": 100, "concept": "dogs", "stream": True}).encode()
        with socket.create_connection(served.address, timeout=60) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
            )
            while chunk := sock.recv(65536):
                streamed.append(chunk)

    threads = [threading.Thread(target=work, daemon=True) for work in (ask, ask, stream, ask)]
    for thread in threads:
        thread.start()
    assert _wait_for(lambda: served.forwards > 2, 30)  # a batch is generating, a request waits
    started = time.monotonic()
    code, stderr = served.stop(signum)
    assert code == 0 and time.monotonic() - started < 30
    for thread in threads:
        thread.join(10)
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == f"stopped serving {tiny_lm_dir('llama')} with {dictionary_dir} ({name})"
    assert "Traceback" not in stderr and "terminate called" not in stderr and "CancelledError" not in stderr
    assert len(replies) == 3  # each client got an answer: the server is shutting down
    for status, payload in replies:
        assert status == 503 and payload["error"]["message"] == "the server is shutting down; retry later"
    events = b"".join(streamed).split(b"\r\n\r\n", 1)[1].decode()
    assert '"message": "the server is shutting down; retry later"' in events and "data: [DONE]" in events


def test_clients_see_names_not_paths_and_too_deep_json_is_a_400(serve, dictionary_dir, tiny_lm_dir):
    served = serve("--max_new_tokens", "4")
    with urllib.request.urlopen(served.url + "/models", timeout=30) as response:
        text = response.read().decode()
    card = json.loads(text)["data"][0]
    assert card["id"] == Path(tiny_lm_dir("llama")).name and card["artifacts"] == ["dictionary"]
    assert str(Path(dictionary_dir).parent) not in text and tiny_lm_dir("llama") not in text
    status, payload = _post(served.url, {"prompt": PROMPT, "concept": "cats"})
    assert status == 400 and payload["error"]["param"] == "concept"
    assert payload["error"]["message"] == (
        "bad request: concept: dictionary: concept='cats'; give one of 'dogs', 'giving', 'rent' or an index 0..2"
    )
    deep = b"[" * 10_000 + b"]" * 10_000
    nested = b'{"prompt": "x", "stop": ' + b"[" * 70 + b'"a"' + b"]" * 70 + b"}"  # parses; too deep all the same
    for body in (deep, nested):
        status, payload = _post(served.url, body)
        assert status == 400 and payload["error"] == {
            "message": "bad request: body: nests lists and objects more than 64 deep",
            "type": "invalid_request_error",
            "param": "body",
        }
    assert _post(served.url, {"prompt": PROMPT, "max_tokens": 2})[0] == 200  # and it still serves
    code, stderr = served.stop()
    assert code == 0 and "Traceback" not in stderr


def test_a_request_naming_no_concept_is_served_with_none(serve):
    served = serve("--max_new_tokens", "6")  # a three-concept dictionary and no --concept
    status, plain = _post(served.url, {"prompt": PROMPT, "max_tokens": 6})
    assert status == 200, plain
    _, unsteered = _post(served.url, {"prompt": PROMPT, "max_tokens": 6, "steering": False})
    _, steered = _post(served.url, {"prompt": PROMPT, "max_tokens": 6, "concept": "dogs", "factor": 8.0})
    assert plain["choices"][0]["text"] == unsteered["choices"][0]["text"] != steered["choices"][0]["text"]
    assert served.stop()[0] == 0


def test_serve_judge_shows_clients_the_lm_by_its_name_not_its_path(tiny_lm_dir):
    lm = tiny_lm_dir("llama")  # a local directory: clients see its own name, e.g. "tiny-llama0"
    command = [sys.executable, "-m", "lit_interventions", "serve-judge", "--lm", lm, "--port", "0"]
    process = subprocess.Popen(
        [*command, "--max_new_tokens", "3"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline().strip()
        assert line.startswith(f"serving {lm} at http://127.0.0.1:"), line  # the operator sees the path
        url = line.rpartition(" at ")[2].removesuffix("/chat/completions")
        with urllib.request.urlopen(url + "/models", timeout=30) as response:
            models = response.read().decode()
        assert json.loads(models)["data"] == [{"id": Path(lm).name, "object": "model", "owned_by": "local"}]
        status, reply = _post(url, {"messages": [{"role": "user", "content": PROMPT}]}, "/chat/completions")
        assert status == 200 and reply["model"] == Path(lm).name
        for text in (models, json.dumps(reply)):
            assert lm not in text and str(Path(lm).parent) not in text
    finally:
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in stderr


def test_a_second_serve_on_a_port_in_use_is_one_line_before_anything_loads(serve, dictionary_dir, tmp_path):
    served = serve("--max_new_tokens", "4")
    port = served.address[1]
    missing = str(tmp_path / "no-such-lm")  # loading it would be another error: the port is checked first
    for command in (
        ("serve", "--artifact", dictionary_dir, "--port", str(port)),
        ("serve-judge", "--lm", missing, "--port", str(port)),
    ):
        second = run_command(*command, timeout=120)
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr.splitlines() == [
            f"error: --port={port}: 127.0.0.1:{port} is in use (another server listens there); "
            "stop that one or choose another --port (0: a free one)"
        ]
    assert _post(served.url, {"prompt": PROMPT, "max_tokens": 2})[0] == 200  # the first one serves on
    code, stderr = served.stop()
    assert code == 0 and "Traceback" not in stderr
