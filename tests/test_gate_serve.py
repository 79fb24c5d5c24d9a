"""Per-request conditional steering in `lit-interventions serve`: a request's `gate` field gives
the reply `generate_pair` gives with that gate, alone or batched with rows gated otherwise; a bad
gate is a 400 naming the field. The tiny llama and its three-concept dictionary of test_serve."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.forward import read_layers
from lit_interventions.core.positions import encode_text
from lit_interventions.inference.generate import generate_pair
from lit_interventions.interventions.additive import concept_latents
from lit_interventions.serving.completion_request import steering_of
from lit_interventions.serving.steered_lm import SteeredLM
from tests.test_serve import _post, dictionary_dir, lm_and_tokenizer, running  # noqa: F401 (fixtures)

PROMPT = "The dog is here. The dog gives the keys"


@pytest.fixture(scope="module")
def gated_server(dictionary_dir, lm_and_tokenizer):  # noqa: F811
    """(steered LM, client, server): default concept "giving" at factor 0.03 (α = 0.09), no gate by default."""
    lm, tokenizer = lm_and_tokenizer
    steered = SteeredLM(dictionary_dir, lm, tokenizer=tokenizer, max_new_tokens=10, concept="giving", factor=0.03)
    with running(steered) as (client, server):
        yield steered, client, server


def _middle_tau(lm_and_tokenizer, dictionary_dir) -> float:  # noqa: F811
    """τ halfway between the two middle latents of "giving" over the prompt's tokens."""
    lm, tokenizer = lm_and_tokenizer
    dictionary = Dictionary.load(dictionary_dir + "/dictionary.safetensors")
    enc = encode_text(tokenizer, PROMPT)
    hidden = read_layers(lm, [1], enc["input_ids"], enc["attention_mask"])[1][0]
    z = concept_latents(hidden, dictionary.vectors[1], "linear").sort().values
    return float(z[len(z) // 2 - 1 : len(z) // 2 + 1].mean())


def _ask(client, gate) -> str:
    extra = {} if gate == "default" else {"gate": gate}
    return client.completions.create(model="t", prompt=PROMPT, max_tokens=10, extra_body=extra).choices[0].text


def test_a_requests_gate_gives_generate_pairs_gated_reply(gated_server, lm_and_tokenizer, dictionary_dir):  # noqa: F811
    steered, client, _ = gated_server
    lm, tokenizer = lm_and_tokenizer
    tau = _middle_tau(lm_and_tokenizer, dictionary_dir)

    def pair(gate):
        return generate_pair(
            lm,
            tokenizer,
            dictionary_dir,
            PROMPT,
            concept="giving",
            factor=0.03,
            max_new_tokens=10,
            chat=False,
            gate=gate,
        )

    gated, ungated = pair(tau), pair(None)
    assert ungated["steered"] != ungated["unsteered"]
    assert gated["steered"] not in (ungated["steered"], ungated["unsteered"])  # the gate shut some tokens only
    assert _ask(client, tau) == gated["steered"]
    assert _ask(client, "default") == _ask(client, None) == _ask(client, False) == ungated["steered"]
    assert _ask(client, 1e6) == ungated["unsteered"]  # never open: the LM as it is
    assert _ask(client, -1e6) == ungated["steered"]  # always open: the ungated edit
    # rows gated differently in one generate each get their own reply
    before = steered.batcher.batches
    steered.batcher.wait = 10.0
    try:
        with ThreadPoolExecutor(3) as pool:  # the three requests at once
            together = list(pool.map(lambda gate: _ask(client, gate), [tau, None, 1e6], timeout=60))
    finally:
        steered.batcher.wait = 0.01
    assert together == [gated["steered"], ungated["steered"], ungated["unsteered"]]
    assert steered.batcher.batches <= before + 2  # batched (at most the first one alone)


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"prompt": "x", "gate": "soon"}', "must be true, false, null or a finite threshold, got 'soon'"),
        (b'{"prompt": "x", "gate": [1]}', "must be true, false, null or a finite threshold, got [1]"),
        (b'{"prompt": "x", "gate": true}', "records training data None, not the built-in concepts"),
    ],
)
def test_a_bad_gate_is_a_400_naming_the_field(gated_server, body, says):
    got, payload = _post(gated_server[2], body)
    assert got == 400 and payload["error"]["param"] == "gate" and says in payload["error"]["message"]


def test_the_servers_default_gate_applies_to_requests_naming_none(dictionary_dir, lm_and_tokenizer):  # noqa: F811
    """`gate=` (serve --gate) is the gate of a request naming none; one naming its own keeps it."""
    lm, tokenizer = lm_and_tokenizer
    steered = SteeredLM(dictionary_dir, lm, tokenizer=tokenizer, concept="giving", factor=6.0, gate="1e6")
    try:
        assert steered.gate == 1e6
        assert steered.check(steering_of({}, "giving", 6.0, steered.gate)).gate == 1e6
        assert steered.check(steering_of({"gate": False}, "giving", 6.0, steered.gate)).gate is None
        assert steered.check(steering_of({"gate": 0.5}, "giving", 6.0, steered.gate)).gate == 0.5
    finally:
        steered.close()
    with pytest.raises(ValueError, match="gate=nan is not a finite number"):
        SteeredLM(dictionary_dir, lm, tokenizer=tokenizer, gate=float("nan"))
