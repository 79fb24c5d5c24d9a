"""`lit-interventions serve`: a tiny random-init llama with a tiny concept dictionary applied,
served on 127.0.0.1 and driven with the `openai` client. Replies equal `generate_pair`'s (greedy,
token for token), streamed replies equal unstreamed ones, concurrent requests with different
steering run in one `generate` and each get what they get alone, and bad requests and options
get one clear error."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.positions import encode_text
from lit_interventions.inference.generate import generate_pair
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.serving.http_server import serve_in_background
from lit_interventions.serving.steered_lm import SteeredLM
from lit_interventions.serving.steered_server import main as serve_main
from lit_interventions.serving.steered_server import make_server, parser
from tests.conftest import HIDDEN
from tests.helpers import ROOT, run_command

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "The dog is here."


@pytest.fixture(scope="module")
def dictionary_dir(tmp_path_factory, tiny_lm_dir):
    """A saved three-concept dictionary for the tiny llama; "rent" was never validated."""
    vectors = torch.nn.functional.normalize(torch.randn(3, 32, generator=torch.Generator().manual_seed(0)), dim=-1)
    dictionary = Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([2.0, 3.0, float("nan")]),
        concepts=["dogs", "giving", "rent"],
        model=tiny_lm_dir("llama"),
        layer=1,
        method="diffmean",
    )
    return str(dictionary.save_pretrained(tmp_path_factory.mktemp("served") / "dictionary"))


@pytest.fixture(scope="module")
def lm_and_tokenizer(tiny_lm_dir):
    """The tiny llama, and a copy of its tokenizer (shared, cached) with a chat template."""
    tokenizer = copy.deepcopy(load_tokenizer(tiny_lm_dir("llama")))
    tokenizer.chat_template = CHAT_TEMPLATE
    return load_lm(tiny_lm_dir("llama")), tokenizer


@pytest.fixture(scope="module")
def served(dictionary_dir, lm_and_tokenizer):
    """(steered LM, client, server): default concept "dogs" at factor 4, replies of at most 12 tokens."""
    lm, tokenizer = lm_and_tokenizer
    steered = SteeredLM(dictionary_dir, lm, tokenizer=tokenizer, max_new_tokens=12, concept="dogs", factor=4.0)
    with running(steered) as (client, server):
        yield steered, client, server


@contextmanager
def running(steered):
    """(openai client, server) of `steered` served on a free loopback port; shut down, and the
    steered LM closed, when the block ends."""
    server = make_server(steered, max_body_bytes=4096)
    serve_in_background(server)
    host, port = server.server_address[:2]
    try:
        yield openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=60), server
    finally:
        server.shutdown()
        server.server_close()
        steered.close()


def _pair(lm_and_tokenizer, dictionary_dir, prompt, chat, concept="dogs", factor=4.0, max_new_tokens=12):
    lm, tokenizer = lm_and_tokenizer
    return generate_pair(
        lm, tokenizer, dictionary_dir, prompt, concept=concept, factor=factor, max_new_tokens=max_new_tokens, chat=chat
    )


def test_text_completions_equal_apply_and_generate(served, lm_and_tokenizer, dictionary_dir):
    steered, client, _ = served
    pair = _pair(lm_and_tokenizer, dictionary_dir, PROMPT, chat=False, concept="giving", factor=5.0)
    assert pair["steered"] != pair["unsteered"]  # the edit changes this continuation
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"concept": "giving", "factor": 5}
    )
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert reply.choices[0].text == pair["steered"] and reply.choices[0].finish_reason == "length"
    prompt_tokens = encode_text(lm_and_tokenizer[1], PROMPT)["input_ids"].shape[1]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"steering": False})
    assert plain.choices[0].text == pair["unsteered"]
    by_index = client.completions.create(model="tiny", prompt=[PROMPT], extra_body={"concept": 1, "factor": 5.0})
    assert by_index.choices[0].text == pair["steered"]
    default = _pair(lm_and_tokenizer, dictionary_dir, PROMPT, chat=False)  # the server's: dogs at 4
    assert client.completions.create(model="tiny", prompt=PROMPT).choices[0].text == default["steered"]
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, stream=True, extra_body={"concept": "giving", "factor": 5}
    )
    chunks = list(streamed)
    assert all(c.object == "text_completion" for c in chunks) and len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == pair["steered"]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    models = client.models.list().data
    assert [m.id for m in models] == [steered.name] and models[0].concepts == ["dogs", "giving", "rent"]


def test_chat_completions_use_the_chat_template_streamed_and_not(served, lm_and_tokenizer, dictionary_dir):
    _, client, _ = served
    pair = _pair(lm_and_tokenizer, dictionary_dir, PROMPT, chat=True, concept="dogs", factor=-3.0, max_new_tokens=9)
    assert pair["chat_template"] and pair["steered"] != pair["unsteered"]
    messages = [{"role": "user", "content": PROMPT}]
    options = dict(model="tiny", messages=messages, max_tokens=9, extra_body={"factor": -3.0})
    reply = client.chat.completions.create(**options)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == pair["steered"]
    templated = lm_and_tokenizer[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_tokens = encode_text(lm_and_tokenizer[1], templated, templated=True)["input_ids"].shape[1]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 9)
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == pair["steered"]
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == prompt_tokens
    off = client.chat.completions.create(**{**options, "extra_body": {"steering": False}})
    assert off.choices[0].message.content == pair["unsteered"]


def test_a_stop_string_cuts_the_reply_before_it(served, lm_and_tokenizer, dictionary_dir):
    _, client, _ = served
    full = _pair(lm_and_tokenizer, dictionary_dir, PROMPT, chat=False)["steered"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    reply = client.completions.create(model="tiny", prompt=PROMPT, stop=["never there", stop])
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


REQUESTS = [  # (prompt, max_tokens, extra_body): concepts, factors and steering differ per row
    ("The dog is here.", 12, {"concept": "dogs", "factor": 4.0}),
    ("give", 5, {"concept": "giving", "factor": -3.0}),
    ("The dog", 12, {"steering": False}),
    ("Paris is a city where the dog lives and", 8, {"concept": 0, "factor": 8.0}),
    (" dog give dog", 12, {"concept": "giving", "factor": 10.0}),
    ("A", 3, {"steering": False, "concept": "giving"}),
    ("The keys", 12, {"factor": 0.05}),
    ("The dog is here.", 10, {"concept": "giving", "factor": 6.0}),
]


def _ask(client, prompt, max_tokens, extra):
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=extra)
    return reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason


def test_concurrent_requests_share_one_generate_and_each_get_their_own_reply(served):
    steered, client, _ = served
    before = steered.batcher.batches
    alone = [_ask(client, *request) for request in REQUESTS]
    assert steered.batcher.batches == before + len(REQUESTS)  # one generate each
    assert len({text for text, _, _ in alone}) == len(REQUESTS)
    steered.batcher.wait = 10.0  # the batch goes once all 8 are in
    try:
        together = [None] * len(REQUESTS)

        def ask(k):
            together[k] = _ask(client, *REQUESTS[k])

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(REQUESTS))]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        steered.batcher.wait = 0.01
    assert time.monotonic() - started < 10.0  # a full batch does not wait
    assert together == alone
    assert steered.batcher.batches == before + len(REQUESTS) + 1  # all 8 in one generate


def _post(server, body: bytes, path="/v1/completions") -> tuple[int, dict]:
    host, port = server.server_address[:2]
    request = urllib.request.Request(f"http://{host}:{port}{path}", data=body, headers={"Content-Type": "x"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    "body, status, param, says",
    [
        (b'{"prompt": "x", ' + b" " * 5000 + b"}", 413, "body", "is 5017 bytes; at most 4096"),
        (b'{"prompt": "x",', 400, "body", "is not valid JSON"),
        (b'{"prompt": "x", "factor": "big"}', 400, "factor", "must be a finite number, got 'big'"),
        (b'{"prompt": "x", "factor": true}', 400, "factor", "must be a finite number, got True"),
        (b'{"prompt": "x", "concept": "cats"}', 400, "concept", "concept='cats'; give one of 'dogs', 'giving', 'rent'"),
        (b'{"prompt": "x", "concept": 3}', 400, "concept", "concept=3; give one of 'dogs', 'giving', 'rent'"),
        (b'{"prompt": "x", "concept": "rent"}', 400, "concept", "concept 'rent' has no max activation"),
        (b'{"prompt": "x", "concept": -1}', 400, "concept", "must be a concept name or an index >= 0, got -1"),
        (b'{"prompt": "x", "steering": "no"}', 400, "steering", "must be true or false, got 'no'"),
        (b'{"prompt": "x", "stream": "yes"}', 400, "stream", "must be true or false, got 'yes'"),
        (b'{"prompt": [1, 2]}', 400, "prompt", "token ids are not accepted"),
        (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "has 5 strings; at most 4"),
        (b'{"prompt": "x", "logprobs": 2}', 400, "logprobs", "log probabilities are not returned"),
    ],
)
def test_bad_requests_get_a_clear_error(served, body, status, param, says):
    got, payload = _post(served[2], body)
    assert got == status and payload["error"]["param"] == param and says in payload["error"]["message"]


def test_bad_chat_fields_and_a_client_error_name_the_field(served):
    _, client, server = served
    got, payload = _post(server, b'{"messages": [], "concept": "dogs"}', path="/v1/chat/completions")
    assert got == 400 and payload["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="t", messages=[{"role": "user", "content": "x"}], extra_body={"factor": []}
        )
    assert err.value.body["param"] == "factor"
    # a request with steering off names no concept the artifacts must hold
    reply = client.completions.create(
        model="t", prompt="x", max_tokens=2, extra_body={"steering": False, "concept": "cats"}
    )
    assert reply.usage.completion_tokens == 2


def test_a_client_leaving_a_stream_stops_its_row_and_frees_its_slot(dictionary_dir, lm_and_tokenizer):
    lm, tokenizer = lm_and_tokenizer
    steered = SteeredLM(dictionary_dir, lm, tokenizer=tokenizer, max_new_tokens=100, concept="dogs")
    server = make_server(steered, max_concurrent=1, timeout=5.0)
    serve_in_background(server)
    forwards = []
    slow = lm.register_forward_pre_hook(lambda module, args: forwards.append(time.sleep(0.02)))
    try:
        body = json.dumps({"prompt": PROMPT, "stream": True, "max_tokens": 100}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(head + body)
            got = b""
            while got.count(b"data: ") < 2:
                got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in got
        time.sleep(1.0)
        stopped = len(forwards)
        time.sleep(0.5)
        assert len(forwards) == stopped < 60  # generation ended soon after the client left
        host, port = server.server_address[:2]
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=30)
        assert client.completions.create(model="t", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        slow.remove()
        server.shutdown()
        server.server_close()
        steered.close()


def test_any_artifact_that_edits_alone_is_served_and_an_interchange_is_refused(tmp_path, tiny_lm_dir, lm_and_tokenizer):
    lm, tokenizer = lm_and_tokenizer
    torch.manual_seed(5)
    save_pretrained(
        tmp_path / "loreft", LoReFTIntervention(HIDDEN, rank=3), {"model": tiny_lm_dir("llama"), "layer": 1}
    )
    steered = SteeredLM(str(tmp_path / "loreft"), lm, tokenizer=tokenizer, max_new_tokens=8)
    server = make_server(steered)
    serve_in_background(server)
    try:
        host, port = server.server_address[:2]
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=60)
        pair = generate_pair(lm, tokenizer, str(tmp_path / "loreft"), PROMPT, max_new_tokens=8, chat=False)
        assert pair["steered"] != pair["unsteered"]
        reply = client.completions.create(model="t", prompt=PROMPT, max_tokens=8)
        plain = client.completions.create(model="t", prompt=PROMPT, max_tokens=8, extra_body={"steering": False})
        assert (reply.choices[0].text, plain.choices[0].text) == (pair["steered"], pair["unsteered"])
    finally:
        server.shutdown()
        server.server_close()
        steered.close()
    save_pretrained(tmp_path / "das", RotatedSpaceIntervention(HIDDEN, 1), {"model": tiny_lm_dir("llama"), "layer": 2})
    with pytest.raises(ValueError, match="is an interchange intervention: give a source"):
        SteeredLM(str(tmp_path / "das"), lm, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an integer >= 1"):
        SteeredLM(str(tmp_path / "loreft"), lm, tokenizer=tokenizer, max_new_tokens=0)


def test_loopback_by_default(served, dictionary_dir):
    assert served[2].server_address[0] == "127.0.0.1"
    assert parser().parse_args(["--artifact", dictionary_dir]).host == "127.0.0.1"


@pytest.mark.parametrize(
    "options, says",
    [
        (["--max_batch", "0"], "error: --max_batch=0 must be a positive integer"),
        (["--batch_wait_ms", "-1"], "error: --batch_wait_ms=-1.0 must be a number of milliseconds >= 0"),
        (["--port", "70000"], "error: --port=70000 is not a port (0..65535)"),
        (["--dtype", "float13"], "error: dtype='float13'"),
        (["--device", "nonsense"], "error: device='nonsense' is not a device torch knows"),
        (["--concept", "cats"], "concept='cats'; give one of 'dogs', 'giving', 'rent' or an index 0..2"),
    ],
)
def test_bad_options_are_one_line_before_the_lm_loads(dictionary_dir, tmp_path, capsys, options, says):
    missing = str(tmp_path / "no-such-lm")  # loading it would fail with another message
    with pytest.raises(SystemExit) as exit:
        serve_main(["--artifact", dictionary_dir, "--lm", missing, *options])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and says in err


def test_the_console_script_refuses_a_bad_option_in_one_line(dictionary_dir, tmp_path):
    result = run_command(
        "serve", "--artifact", dictionary_dir, "--lm", str(tmp_path / "no-such-lm"), "--max_batch", "0"
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: --max_batch=0 must be a positive integer\n"


def test_the_command_serves_until_stopped(dictionary_dir, tiny_lm_dir):
    command = [sys.executable, "-m", "lit_interventions", "serve", "--artifact", dictionary_dir, "--port", "0"]
    process = subprocess.Popen(
        [*command, "--concept", "dogs", "--max_new_tokens", "4"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline().strip()
        head, _, url = line.rpartition(" at ")
        assert head == f"serving {tiny_lm_dir('llama')} with {dictionary_dir}" and url.startswith("http://127.0.0.1:")
        assert url.endswith("/v1") and int(url.rsplit(":", 1)[1].removesuffix("/v1")) > 0
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"factor": 4.0})
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0  # SIGTERM is a server's normal stop
    assert stderr.strip().splitlines()[-1] == f"stopped serving {tiny_lm_dir('llama')} with {dictionary_dir} (SIGTERM)"


@pytest.mark.slow
def test_a_released_dictionary_served_on_its_chat_model():
    """The embedded chat model with the released DiffMean dictionary: a served chat reply equals
    `generate`'s, steered and not, and the steering changes it."""
    artifact = str(ROOT / "checkpoints" / "axbench" / "builtin-diffmean")
    steered = SteeredLM(artifact, max_new_tokens=16, concept="references to weather and rain", factor=2.0)
    server = make_server(steered)
    serve_in_background(server)
    try:
        host, port = server.server_address[:2]
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0, timeout=300)
        pair = generate_pair(
            steered.model,
            steered.tokenizer,
            artifact,
            "Write one sentence about your day.",
            concept="references to weather and rain",
            factor=2.0,
            max_new_tokens=16,
        )
        assert pair["chat_template"] and pair["steered"] != pair["unsteered"]
        messages = [{"role": "user", "content": "Write one sentence about your day."}]
        replies = [None, None]

        def ask(k):
            extra = {} if k == 0 else {"steering": False}
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=16, extra_body=extra)
            replies[k] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert replies == [pair["steered"], pair["unsteered"]]
    finally:
        server.shutdown()
        server.server_close()
        steered.close()
