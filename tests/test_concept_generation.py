"""`lit-interventions concepts`: AxBench-style concept data written by a generator LM. A fake
generator (planted replies, counted calls) for the recipe, the cache and the resumption; a tiny
random-init LM for the local path, the provenance and a DiffMean fit on the output; a fake
OpenAI-compatible server for the endpoint path; the console script for the error lines."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import COLUMNS, load_concepts
from lit_interventions.datamodules.concepts_build import CACHE, GenerationCache, Settings, build_concepts
from lit_interventions.datamodules.concepts_generators import Generator
from lit_interventions.datamodules.concepts_recipe import (
    INSTRUCTIONS,
    Concept,
    parse_genre,
    read_concepts,
    read_prompts,
    split_instructions,
)
from safetensors.torch import load_file

from lit_interventions.cli.commands import run
from tests.conftest import HIDDEN

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "concepts.txt"
SCRIPT = Path(sys.executable).parent / "lit-interventions"


class Fake(Generator):
    """Replies from the prompt and the seed alone; the genre question of a concept whose name
    holds a key of `genres` gets that reply; `empty(prompt)` true: an empty reply. Raises after
    `fail_after` replies when set."""

    def __init__(self, genres=None, fail_after=None, empty=lambda prompt: False):
        super().__init__(max_new_tokens=16, temperature=0.7, top_p=0.9)
        self.genres, self.fail_after, self.empty, self.calls = genres or {}, fail_after, empty, []

    def identity(self):
        return {"kind": "fake"}

    cache_identity = identity

    def generate(self, prompts, seeds):
        self.calls.append(len(prompts))
        replies = []
        for prompt, seed in zip(prompts, seeds):
            if self.fail_after is not None and self.generated >= self.fail_after:
                raise RuntimeError("killed")
            if prompt.startswith("Sort a concept"):
                reply = next((r for k, r in self.genres.items() if k in prompt), "no idea")
            else:
                reply = "" if self.empty(prompt) else f' "reply {seed}" '
            replies.append(reply)
            self.generated += 1
        return replies


CONCEPTS = [Concept("golden retrievers", None), Concept("matrix multiplication", None), Concept("SQL joins", "code")]
PLANTED = {"golden retrievers": "Text.", "matrix multiplication": "I would say Math, not Text."}


def _build(out, generator, per_concept=5, eval_per_concept=3, concepts=CONCEPTS):
    return build_concepts(
        concepts, read_prompts(None), out, generator, Settings(per_concept, eval_per_concept, 7, 2), {"test": True}
    )


def _tables(out):
    return pd.read_parquet(out / "train_data.parquet"), pd.read_parquet(out / "latent_eval_data.parquet")


def test_rows_schema_counts_and_genres_from_planted_replies(tmp_path):
    generator = Fake(PLANTED)
    record = _build(tmp_path, generator)
    train, evaluation = _tables(tmp_path)
    assert list(train.columns) == COLUMNS and list(evaluation.columns) == COLUMNS
    assert [c["genre"] for c in record["concepts"]] == ["text", "math", "code"]
    assert [c["genre_reply"] for c in record["concepts"][:2]] == ["Text.", "I would say Math, not Text."]
    assert "genre_reply" not in record["concepts"][2]  # fixed by the list: no question asked
    counts = train.groupby(["concept_id", "category", "concept_genre"]).size().to_dict()
    assert counts == {
        (-1, "negative", "text"): 5,
        (-1, "negative", "code"): 5,
        (-1, "negative", "math"): 5,
        (0, "positive", "text"): 5,
        (1, "positive", "math"): 5,
        (2, "positive", "code"): 5,
    }
    assert set(train.loc[train.concept_id == -1, "output_concept"]) == {"EEEEE"}
    assert train.loc[train.concept_id == 1, "output_concept"].tolist() == ["matrix multiplication"] * 5
    eval_counts = evaluation.groupby(["concept_id", "category"]).size().to_dict()
    assert eval_counts == {(c, k): 3 for c in (0, 1, 2) for k in ("positive", "negative")}
    assert set(evaluation.loc[evaluation.concept_id == 2, "output_concept"]) == {"SQL joins"}
    assert set(train["dataset_category"]) == {"instruction"}
    # replies are stripped of the quotes that wrap them; inputs are our instructions of the genre
    assert all(o.startswith("reply ") for o in pd.concat([train, evaluation])["output"])
    assert set(train.loc[train.concept_id == 1, "input"]) <= set(INSTRUCTIONS["math"])
    held_out = set(evaluation.loc[evaluation.concept_id == 1, "input"])
    assert held_out <= set(INSTRUCTIONS["math"]) and not held_out & set(train["input"])
    assert generator.generated == 2 + 15 + 3 * (5 + 3 + 3) == record["generations"]["total"]
    meta = [json.loads(line) for line in (tmp_path / "metadata.jsonl").read_text().splitlines()]
    assert meta[1] == {
        "concept_id": 1,
        "concept": "matrix multiplication",
        "ref": "lit-interventions concepts",
        "concept_genres_map": {"matrix multiplication": ["math"]},
    }
    data = load_concepts(tmp_path)
    assert data.concepts == [c.name for c in CONCEPTS] and data.genres == ["text", "math", "code"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [CACHE, "generation.json", "latent_eval_data.parquet", "metadata.jsonl", "train_data.parquet"]
    )


@pytest.mark.parametrize(
    "reply, genre",
    [
        ("Code", "code"),
        ("Math.", "math"),
        ("Mathematics", "math"),
        ("<NONE>", "text"),
        ("I think code, not text", "code"),
        ("text or maybe code", "text"),
        ("encoded", "text"),
        ("", "text"),
    ],
)
def test_genre_is_the_first_genre_word_of_the_reply(reply, genre):
    assert parse_genre(reply) == genre


def test_a_rerun_generates_nothing_and_writes_the_same_rows(tmp_path):
    _build(tmp_path, Fake(PLANTED))
    first = _tables(tmp_path)
    again = Fake(PLANTED)
    record = _build(tmp_path, again)
    assert again.generated == 0 and again.calls == []
    assert record["generations"] == {"total": 50, "generated": 0, "cached": 50}
    for before, after in zip(first, _tables(tmp_path)):
        pd.testing.assert_frame_equal(before, after)
    more = Fake(PLANTED)  # one setting changed: new keys, every reply drawn again
    build_concepts(CONCEPTS, read_prompts(None), tmp_path, more, Settings(5, 3, 8, 2), {})
    assert more.generated == 50


def test_an_interrupted_run_resumes_to_the_rows_of_an_uninterrupted_one(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _build(whole, Fake(PLANTED))
    with pytest.raises(RuntimeError, match="killed"):
        _build(broken, Fake(PLANTED, fail_after=20))  # in the middle of a batch of 2
    assert sorted(p.name for p in broken.iterdir()) == [CACHE]  # no output file, no temporary file
    assert len((broken / CACHE).read_text().splitlines()) == 19  # the batch that failed is not kept
    (broken / ".train_data.parquet.999.tmp").write_text("half")  # a run killed while writing its outputs
    resumed = Fake(PLANTED)
    _build(broken, resumed)
    assert not (broken / ".train_data.parquet.999.tmp").exists()
    assert resumed.generated == 50 - 19
    for a, b in zip(_tables(whole), _tables(broken)):
        pd.testing.assert_frame_equal(a, b)


def test_a_torn_cache_line_is_cut_off_and_only_its_reply_drawn_again(tmp_path):
    _build(tmp_path, Fake(PLANTED))
    cache = tmp_path / CACHE
    text = cache.read_text()
    cache.write_text(text[: len(text) - 10])  # the last line torn mid-write
    assert GenerationCache(cache).replies.__len__() == 49
    again = Fake(PLANTED)
    _build(tmp_path, again)
    assert again.generated == 1  # the torn reply's batch: the last, of 1
    assert len(cache.read_text().splitlines()) == 50 and cache.read_text().endswith("\n")


def test_empty_replies_are_dropped_and_counted(tmp_path):
    train_math = split_instructions(read_prompts(None), 7)["math"][0]
    # empty: the pool's reply to the first math instruction, and concept 1's positive on the second
    empty = lambda prompt: prompt == train_math[0] or (train_math[1] in prompt and "matrix" in prompt)  # noqa: E731
    record = _build(tmp_path, Fake(PLANTED, empty=empty))
    train, evaluation = _tables(tmp_path)
    assert record["pool"] == {"code": 5, "math": 4, "text": 5, "dropped_empty": 1}
    assert [(c["train_positive"], c["dropped_empty"]) for c in record["concepts"]] == [(5, 0), (4, 1), (5, 0)]
    assert int(((train.concept_id == 1) & (train.category == "positive")).sum()) == 4
    assert train_math[1] not in set(train.loc[train.concept_id == 1, "input"]) and len(evaluation) == 18


def test_a_concept_left_without_eval_rows_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="SQL joins"):
        _build(tmp_path, Fake(PLANTED, empty=lambda prompt: "SQL joins" in prompt))
    assert not (tmp_path / "train_data.parquet").exists()


def test_concept_and_prompt_files(tmp_path):
    concepts = tmp_path / "c.txt"
    concepts.write_text("# a comment\n\nbirds\nlinked lists\tCode\n")
    assert read_concepts(concepts) == [Concept("birds", None), Concept("linked lists", "code")]
    prompts = tmp_path / "p.txt"
    prompts.write_text("Say hi.\nmath\tAdd 2 and 3.\n")
    assert read_prompts(prompts) == {"text": ["Say hi."], "code": ["Say hi."], "math": ["Say hi.", "Add 2 and 3."]}
    concepts.write_text("birds\nbirds\n")
    with pytest.raises(ValueError, match="line 2: 'birds' repeats line 1"):
        read_concepts(concepts)
    concepts.write_text("birds\tpoetry\n")
    with pytest.raises(ValueError, match="line 1: .* GENRE one of text, code, math"):
        read_concepts(concepts)
    assert [c.name for c in read_concepts(EXAMPLE)] == ["references to rivers and lakes", "Python decorators"]


# ----------------------------------------------------------------------------- a tiny local LM


def test_the_local_generator_writes_a_directory_that_fits_diffmean(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    lm = tiny_lm_dir("llama")
    common = ["concepts", "--concepts", str(EXAMPLE), "--lm", lm, "--per_concept", "4", "--eval_per_concept", "2"]
    monkeypatch.setenv("LIT_INTERVENTIONS_PROGRESS_SECONDS", "0")  # a progress line at every update
    record = run([*common, "--out", str(tmp_path / "a"), "--max_new_tokens", "6", "--seed", "3"])
    shown = capsys.readouterr().out.splitlines()
    # the genre question of the 1 concept without one; then 4 pool replies per genre and 4 + 2 + 2 per concept
    total = 4 * len({concept["genre"] for concept in record["concepts"]}) + 2 * (4 + 2 + 2)
    assert shown[0].startswith("genre replies 0/1") and f"replies 0/{total}  elapsed" in "\n".join(shown)
    assert shown[-1].startswith(f"replies {total}/{total} (eval_negative: Python decorators)")
    assert any("|  generated tokens 3/6" in line for line in shown)  # each decoding step of a batch
    weights = Path(lm) / "model.safetensors"
    assert record["generator"] == {
        "kind": "local",
        "lm": lm,
        "weights": lm,
        "sha256": {"model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()},
    }
    assert record["sampling"] == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9}
    assert record["seed"] == 3 and record["package"]["name"] == "lit-interventions"
    assert record["sources"]["concepts"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert record["sources"]["prompts"] == "built-in"
    assert record["concepts"][1]["genre"] == "code" and record["concepts"][1]["genre_from"] == "list"
    assert json.loads((tmp_path / "a" / "generation.json").read_text()) == record
    # the same seed draws the same rows without the cache; another seed, other rows
    run([*common, "--out", str(tmp_path / "b"), "--max_new_tokens", "6", "--seed", "3"])
    run([*common, "--out", str(tmp_path / "c"), "--max_new_tokens", "6", "--seed", "4"])
    a, b, c = (_tables(tmp_path / name)[0] for name in "abc")
    pd.testing.assert_frame_equal(a, b)
    assert a["output"].tolist() != c["output"].tolist()

    data = AxBenchDataModule(lm=lm, concept_dir=str(tmp_path / "a"))
    assert data.concepts == ["references to rivers and lakes", "Python decorators"]
    cli = run(
        [
            "fit",
            "--config",
            "diffmean.yaml",
            f"--data.concept_dir={tmp_path / 'a'}",
            f"--model.lm={lm}",
            "--model.layer=1",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    tensors = load_file(Path(cli.trainer.log_dir) / "dictionary.safetensors")
    assert {tuple(t.shape) for t in tensors.values() if t.dim() == 2} == {(2, HIDDEN)}
    assert set(cli.trainer.callback_metrics) >= {"val/auroc/references to rivers and lakes"}


# ----------------------------------------------------------------------------- an endpoint


class _Endpoint(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.headers.get("Authorization"), body))
        prompt = body["messages"][0]["content"]
        reply = "Math" if prompt.startswith("Sort a concept") else f"answer {body['seed']}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_endpoint_writes_the_data_with_the_key_from_the_environment(tmp_path, endpoint, monkeypatch):
    monkeypatch.setenv("LIT_TEST_CONCEPTS_KEY", "sk-test-123")
    concepts = tmp_path / "c.txt"
    concepts.write_text("prime numbers\n")
    base_url = f"http://127.0.0.1:{endpoint.server_address[1]}/v1"
    argv = ["concepts", "--concepts", str(concepts), "--out", str(tmp_path / "out"), "--base_url", base_url]
    argv += ["--model", "mock-1", "--api_key_env", "LIT_TEST_CONCEPTS_KEY", "--per_concept", "3"]
    record = run([*argv, "--eval_per_concept", "2", "--temperature", "0.2", "--max_new_tokens", "40"])
    assert record["generator"] == {"kind": "endpoint", "base_url": base_url, "model": "mock-1"}
    assert record["concepts"][0]["genre"] == "math" and record["concepts"][0]["genre_reply"] == "Math"
    assert len(endpoint.seen) == 1 + 3 + 3 + 2 + 2
    keys, bodies = zip(*endpoint.seen)
    assert set(keys) == {"Bearer sk-test-123"}
    assert {(b["model"], b["temperature"], b["max_tokens"], b["top_p"]) for b in bodies} == {("mock-1", 0.2, 40, 0.9)}
    assert len({b["seed"] for b in bodies}) == len(bodies)
    train, evaluation = _tables(tmp_path / "out")
    assert set(train.concept_genre) == {"math"} and len(train) == 6 and len(evaluation) == 4
    seeds = {b["seed"] for b in bodies}
    assert all(int(o.split()[1]) in seeds for o in pd.concat([train, evaluation])["output"])
    for name in ("generation.json", CACHE, "metadata.jsonl"):
        assert "sk-test-123" not in (tmp_path / "out" / name).read_text()
    run([*argv, "--eval_per_concept", "2", "--temperature", "0.2", "--max_new_tokens", "40"])
    assert len(endpoint.seen) == 11  # all from the cache


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def files(tmp_path):
    concepts = tmp_path / "concepts.txt"
    concepts.write_text("birds\n")
    return tmp_path, concepts


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--per_concept", "0"], "--per_concept=0: must be an integer >= 1"),
        (["--temperature", "-1"], "--temperature=-1.0: must be a finite number >= 0"),
        (["--top_p", "1.5"], "--top_p=1.5: must be in (0, 1]"),
        (["--lm", "x", "--base_url", "http://h/v1", "--model", "m"], "--lm=x and --base_url=http://h/v1: choose one"),
        (["--base_url", "http://h/v1"], "--base_url=http://h/v1: needs --model"),
        (["--base_url", "ftp://h", "--model", "m"], "--base_url='ftp://h' must start with http:// or https://"),
        (["--model", "m"], "--model=m: only with --base_url"),
        (
            ["--base_url", "http://h/v1", "--model", "m", "--api_key_env", "LIT_TEST_UNSET_KEY"],
            "--api_key_env='LIT_TEST_UNSET_KEY': that environment variable is not set",
        ),
        (["--lm", "/no/such/model"], "--lm=/no/such/model: no such file or directory"),
        (["--lm", "missing.gguf"], "--lm=missing.gguf: GGUF file not found: missing.gguf"),
    ],
)
def test_bad_options_are_one_error_line_before_any_model_loads(files, extra, message, capsys, monkeypatch):
    monkeypatch.delenv("LIT_TEST_UNSET_KEY", raising=False)
    monkeypatch.setattr("lit_interventions.datamodules.concepts_generators.load_lm", pytest.fail)
    tmp_path, concepts = files
    with pytest.raises(SystemExit) as exit_info:
        run(["concepts", "--concepts", str(concepts), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d, c: c.write_text("birds\tpoetry\n"), "line 1: 'birds\\tpoetry' is not CONCEPT<TAB>GENRE"),
        (lambda d, c: c.write_bytes(b"caf\xe9\n"), "not UTF-8 text (byte 3)"),
        (lambda d, c: c.unlink(), "concepts.txt: no such file"),
        (lambda d, c: (d / "out").write_text("x"), "--out"),
        (lambda d, c: (d / "p.txt").write_text("code\tWrite a loop.\nSay hi.\n"), "1 instruction(s) for genre 'text'"),
    ],
)
def test_bad_files_are_one_error_line_from_the_console_script(files, setup, message):
    tmp_path, concepts = files
    setup(tmp_path, concepts)
    extra = ["--prompts", str(tmp_path / "p.txt")] if (tmp_path / "p.txt").exists() else []
    argv = [str(SCRIPT), "concepts", "--concepts", str(concepts), "--out", str(tmp_path / "out"), *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]


# ----------------------------------------------------------------------------- the embedded model


@pytest.mark.slow
def test_the_embedded_model_writes_the_example_concepts(tmp_path):
    argv = ["concepts", "--concepts", str(EXAMPLE), "--out", str(tmp_path), "--per_concept", "2"]
    argv += ["--eval_per_concept", "1", "--max_new_tokens", "24"]
    first = run(argv)
    assert first["generations"] == {"total": 13, "generated": 13, "cached": 0}
    record = run(argv)
    assert record["generations"]["generated"] == 0 and record["concepts"] == first["concepts"]
    assert record["generator"]["lm"] == "smollm2-135m-instruct" and len(record["generator"]["sha256"]) == 64
    data = load_concepts(tmp_path)
    assert data.concepts == ["references to rivers and lakes", "Python decorators"] and data.genres[1] == "code"
