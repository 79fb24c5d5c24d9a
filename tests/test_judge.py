"""The steering judge: harmonic mean, reply parsing, and the openai backend against a real
OpenAI-compatible server on loopback serving a local LM."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from lit_interventions.metrics.judge import make_judge
from lit_interventions.metrics.judge_local import generate_replies
from lit_interventions.metrics.judge_openai import OpenAIJudge
from lit_interventions.metrics.judge_prompts import PROMPTS, harmonic_mean, parse_rating
from lit_interventions.serving.http_server import serve_in_background
from lit_interventions.serving.judge_server import make_server
from tests.helpers import free_port as _free_port


def test_harmonic_mean_by_hand():
    assert harmonic_mean(2, 2, 2) == pytest.approx(2.0)
    assert harmonic_mean(1, 2, 2) == pytest.approx(3 / (1 + 0.5 + 0.5))  # 1.5
    assert harmonic_mean(1, 1, 2) == pytest.approx(3 / 2.5)  # 1.2
    assert harmonic_mean(0.5, 1, 2) == pytest.approx(3 / (2 + 1 + 0.5))
    assert harmonic_mean(0, 2, 2) == 0.0 and harmonic_mean(2, 2, 0) == 0.0


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The concept appears twice.\nRating: [[2]]", 2.0),
        ("Rating: [[ 1 ]]", 1.0),
        ("reason... Rating: [[0]] and later Rating: [[2]]", 0.0),  # the first rating wins
        ("**Rating:** 1", 1.0),
        ("Rating: 2\nmore text", 2.0),
        ("rating of 1.5", 1.5),
        ("2", 2.0),
        (" 1. ", 1.0),
        ("Rating: [[3]]", None),  # out of range
        ("The concept is absent.", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_rating_lenient(reply, expected):
    assert parse_rating(reply, "lenient") == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The concept appears twice.\nRating: [[2]]", 2.0),
        ("Rating: [[ 1 ]]", 1.0),
        ("reason... Rating: [[0]] and later Rating: [[2]]", 2.0),  # AxBench: the LAST "Rating:" wins
        ("Rating: [[1]]\nOn reflection:\nRating: [[0]]", 0.0),
        ("Rating: 2.\nmore text", 2.0),
        ('Rating: "1"', 1.0),
        ("**Rating:** 1", 1.0),  # "** 1": asterisks stripped
        ("rating of 1.5", None),  # no "Rating:"
        ("2", None),
        ("Rating: [[3]]", None),  # out of range
        ("", None),
        (None, None),
    ],
)
def test_parse_rating_as_axbench_takes_the_last_rating(reply, expected):
    assert parse_rating(reply) == expected


def test_default_prompts_carry_axbench_criteria():
    from lit_interventions.metrics.judge_prompts import OUR_PROMPTS, PROMPT_STYLES

    assert PROMPTS is PROMPT_STYLES["axbench"]
    fluency = PROMPTS["fluency"].lower()
    assert "disregarding its completeness, its relevance, its coherence" in fluency
    assert "coherence" in OUR_PROMPTS["fluency"].lower() and "disregard" not in OUR_PROMPTS["fluency"].lower()
    assert "regardless of grammar, coherence or informativeness" in PROMPTS["instruct"]
    assert "not at grammar or logical coherence" in PROMPTS["concept"]
    for aspect, fields in (
        ("concept", ("{concept}", "{response}")),
        ("instruct", ("{instruction}", "{response}")),
        ("fluency", ("{response}",)),
    ):
        assert all(f in PROMPTS[aspect] for f in fields) and "Rating: [[score]]" in PROMPTS[aspect]


def test_make_judge_sets_prompt_style_and_parsing():
    from lit_interventions.metrics.judge import make_judge
    from lit_interventions.metrics.judge_prompts import OUR_PROMPTS

    judge = make_judge("openai", base_url="http://127.0.0.1:1/v1", model="x", prompt_style="ours", parsing="lenient")
    assert (judge.prompt_style, judge.parsing) == ("ours", "lenient")
    seen = []
    judge.ask = lambda prompts: seen.extend(prompts) or ["Rating: [[0]] then Rating: [[2]]"] * len(prompts)
    scores = judge.score(["dogs"], ["Say hi"], ["Hi dog"])
    assert seen[2] == OUR_PROMPTS["fluency"].format(concept="dogs", instruction="Say hi", response="Hi dog")
    assert scores[0].fluency_score == 0.0  # lenient: the first rating
    judge = make_judge("openai", base_url="http://127.0.0.1:1/v1", model="x")
    judge.ask = lambda prompts: ["Rating: [[0]] then Rating: [[2]]"] * len(prompts)
    assert judge.score(["dogs"], ["Say hi"], ["Hi dog"])[0].fluency_score == 2.0  # AxBench: the last
    with pytest.raises(ValueError, match="prompt_style"):
        make_judge("openai", prompt_style="mine")


class _Canned(OpenAIJudge):
    def __init__(self, replies):
        super().__init__(base_url="http://127.0.0.1:1/v1", model="x")
        self.replies = replies

    def ask(self, prompts):
        assert len(prompts) == len(self.replies)
        return self.replies


def test_score_combines_three_prompts_and_unparseable_is_zero(caplog):
    judge = _Canned(["Rating: [[2]]", "Rating: [[1]]", "Rating: [[2]]", "no idea", "Rating: [[2]]", "Rating: [[2]]"])
    first, second = judge.score(["dogs", "dogs"], ["Write a poem.", "Write a poem."], ["a dog", "a cat"])
    assert (first.concept_score, first.instruct_score, first.fluency_score) == (2, 1, 2)
    assert first.overall == pytest.approx(1.5)
    assert second.concept_score == 0 and second.overall == 0
    assert "unparseable concept rating" in caplog.text and "no idea" in caplog.text


def test_prompts_carry_concept_instruction_and_response():
    seen = []

    class Spy(_Canned):
        def ask(self, prompts):
            seen.extend(prompts)
            return ["Rating: [[1]]"] * len(prompts)

    Spy([]).score(["golden retrievers"], ["Describe Paris."], ["The Seine flows."])
    concept, instruct, fluency = seen
    assert "golden retrievers" in concept and "The Seine flows." in concept and "Describe Paris." not in concept
    assert "Describe Paris." in instruct and "The Seine flows." in instruct and "golden retrievers" not in instruct
    assert "The Seine flows." in fluency and "golden retrievers" not in fluency and "Rating: [[" in fluency


def test_unreachable_endpoint_fails_check_naming_the_url():
    port = _free_port()  # nothing listens there
    judge = make_judge("openai", base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout=5)
    with pytest.raises(ConnectionError, match=f"http://127.0.0.1:{port}/v1/chat/completions"):
        judge.check()


def test_bad_judge_config_raises(monkeypatch):
    with pytest.raises(ValueError, match="backend='gpt'"):
        make_judge("gpt")
    with pytest.raises(ValueError, match="base_url"):
        make_judge("openai", base_url="127.0.0.1:8000")
    monkeypatch.delenv("LIT_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="LIT_TEST_NO_SUCH_KEY"):
        make_judge("openai", api_key_env="LIT_TEST_NO_SUCH_KEY")
    with pytest.raises(ValueError, match="bad options"):
        make_judge("openai", temprature=0.0)


@pytest.fixture
def loopback(request, tmp_path, monkeypatch):
    """(base_url, lm) of a judge server on a free loopback port, serving the given LM. Judge
    replies are cached under tmp_path."""
    monkeypatch.setenv("LIT_INTERVENTIONS_JUDGE_CACHE", str(tmp_path / "judge-cache"))
    servers = []

    def start(lm, max_new_tokens=8):
        server = make_server(lm, "127.0.0.1", 0, max_new_tokens=max_new_tokens)
        serve_in_background(server)
        servers.append(server)
        host, port = server.server_address[:2]
        return f"http://{host}:{port}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_openai_judge_against_loopback_server_with_tiny_lm(loopback, tiny_lm_dir, caplog):
    lm = tiny_lm_dir("llama")
    base_url = loopback(lm, max_new_tokens=6)
    # the raw HTTP exchange has the OpenAI shape
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "The dog is here."}], "max_tokens": 4})
    request = urllib.request.Request(
        base_url + "/chat/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        payload = json.loads(response.read())
    assert payload["object"] == "chat.completion" and payload["model"] == "tiny"
    assert isinstance(payload["choices"][0]["message"]["content"], str)
    assert payload["usage"]["completion_tokens"] <= 4 and payload["usage"]["prompt_tokens"] > 0
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(base_url + "/chat/completions", data=b'{"messages": []}'))
    assert err.value.code == 400
    with urllib.request.urlopen(base_url + "/models", timeout=30) as response:
        assert json.loads(response.read())["data"] == [{"id": Path(lm).name, "object": "model", "owned_by": "local"}]

    judge = make_judge("openai", base_url=base_url, model="tiny", max_tokens=6, workers=2)
    judge.check()
    scores = judge.score(["dogs", "dogs"], ["Write about a dog.", "Describe Paris."], ["The dog is here.", "Paris."])
    assert len(scores) == 2
    for score in scores:  # a random tiny model says junk: every reply reaches the parser and scores 0
        assert set(score.replies) == {"concept", "instruct", "fluency"}
        assert all(isinstance(r, str) for r in score.replies.values())
        expected = [parse_rating(score.replies[a]) or 0.0 for a in ("concept", "instruct", "fluency")]
        assert [score.concept_score, score.instruct_score, score.fluency_score] == expected
        assert score.overall == harmonic_mean(*expected)
    assert "unparseable" in caplog.text


@pytest.mark.slow
def test_openai_judge_against_loopback_smollm2(loopback, caplog):
    base_url = loopback("smollm2-135m-instruct", max_new_tokens=40)
    # the server/client loop is under test, not the prompts: a 135M model follows our shorter
    # prompts' "[[N]]" format; AxBench's (the default) it often answers out of range ("Rating: 3.5")
    judge = make_judge(
        "openai",
        base_url=base_url,
        model="smollm2-135m-instruct",
        max_tokens=40,
        prompt_style="ours",
        parsing="lenient",
    )
    judge.check()
    scores = judge.score(
        ["dogs", "the ocean"],
        ["Write a short poem about the sea."] * 2,
        [
            "The waves roll in; a dog barks on the shore and a puppy runs along the sand.",
            "The ocean is deep and blue, and its waves crash on the shore.",
        ],
    )
    ratings = [parse_rating(r, parsing="lenient") for s in scores for r in s.replies.values()]
    assert sum(r is not None for r in ratings) >= 1, [s.replies for s in scores]
    print("smollm2 ratings:", ratings)


def test_local_probability_judge_is_the_expected_rating(tiny_lm_dir, tokenizer):
    """`rating: probability`: E[r] over the next-token probabilities of "0", "1", "2" after
    "Rating: [[", computed here by hand from one unpadded forward per prompt."""
    import torch

    from lit_interventions.metrics.judge import make_judge
    from lit_interventions.metrics.judge_local import LocalJudge, chat_prompt

    judge = make_judge("local", lm=tiny_lm_dir("llama"))
    assert isinstance(judge, LocalJudge) and judge.rating == "probability"
    scores = judge.score(["dogs", "dogs"], ["Write a poem.", "Tell me a story."], ["The dog is here.", "give the dog"])
    digits = [tokenizer(d, add_special_tokens=False)["input_ids"][0] for d in "012"]
    prompts = [
        PROMPTS[a].format(concept="dogs", instruction=i, response=r)
        for i, r in (("Write a poem.", "The dog is here."), ("Tell me a story.", "give the dog"))
        for a in ("concept", "instruct", "fluency")
    ]
    for k, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer(chat_prompt(tokenizer, prompt) + "Rating: [[")["input_ids"]])
        with torch.no_grad():
            probs = judge.model(ids).logits[0, -1, digits].softmax(-1)
        expected = (probs * torch.tensor([0.0, 1.0, 2.0])).sum().item()
        score = scores[k // 3]
        got = (score.concept_score, score.instruct_score, score.fluency_score)[k % 3]
        assert got == pytest.approx(expected, abs=1e-3)
        assert 0.0 < got < 2.0
    assert scores[0].overall == pytest.approx(
        harmonic_mean(scores[0].concept_score, scores[0].instruct_score, scores[0].fluency_score)
    )
    with pytest.raises(ValueError, match="rating='vote'"):
        make_judge("local", lm=tiny_lm_dir("llama"), rating="vote")


def test_long_prompts_lose_their_start_not_the_assistant_header(tiny_lm, tokenizer):
    """The reply follows the end of the prompt, so truncation to `max_length` cuts the front."""
    model = tiny_lm("llama")
    seen = []
    generate = model.generate

    def record(**kwargs):
        seen.append(kwargs["input_ids"])
        return generate(**kwargs)

    model.generate = record
    try:
        text = " dog" * 20 + " Assistant:"
        replies = generate_replies(model, tokenizer, [text, " dog"], max_new_tokens=2, max_length=6)
    finally:
        del model.generate
    end = tokenizer(" Assistant:", add_special_tokens=False)["input_ids"]
    assert seen[0].shape[1] == 6 and seen[0][0, -len(end) :].tolist() == end
    assert len(replies) == 2 and tokenizer.truncation_side == "right"  # restored
