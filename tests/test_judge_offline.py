"""The `offline` judge: its cut points, its proxies against a hand computation on a tiny llama, the
refusal of an unreliable or unknown concept (one line, exit 2 through `steer`), two judges side by
side, and (slow) planted replies ranked in the right order under the real reference LM."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, load_concepts

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.metrics import judge as judge_module
from lit_interventions.metrics.judge import make_judge
from lit_interventions.metrics.judge_base import Judge, JudgeScore
from lit_interventions.metrics.judge_compare import ComparedJudge, agreement_lines, judge_agreement
from lit_interventions.metrics.judge_offline import (
    CONCEPT_CUTS,
    FLUENCY_CUTS,
    INSTRUCT_CUTS,
    SEPARATOR,
    OfflineJudge,
    rate,
)
from lit_interventions.metrics.judge_prompts import harmonic_mean
from lit_interventions.studies import steer

NEGATIVES = [
    "Bread needs flour, water and salt.",
    "The train leaves at nine.",
    "Paint the fence white this year.",
    "She counted the coins twice.",
    "A new road opened last week.",
    "The printer ran out of paper.",
    "He fixed the old chair.",
    "We moved the table to the left.",
]
DOGS = ["dog dog dog", "The dog is here.", "The dog is not here.", "dog dog", "a dog, a dog", "The dog was here."]


def _write_concepts(directory, concepts: dict[str, tuple[list[str], list[str]]]):
    """A concept directory in the AxBench layout: {name: (train positives, eval positives)}, the
    NEGATIVES split in half between the train pool and each concept's eval negatives."""
    directory.mkdir(parents=True, exist_ok=True)

    def row(text, name, category, cid):
        return {"input": "Say something.", "output": text, "output_concept": name, "concept_genre": "text",
                "category": category, "dataset_category": "instruction", "concept_id": cid}  # fmt: skip

    meta, train, evaluation = [], [], []
    train += [row(t, "EEEEE", "negative", -1) for t in NEGATIVES[::2]]
    for cid, (name, (train_pos, eval_pos)) in enumerate(concepts.items()):
        meta.append({"concept_id": cid, "concept": name, "concept_genres_map": {name: ["text"]}})
        train += [row(t, name, "positive", cid) for t in train_pos]
        evaluation += [row(t, name, "positive", cid) for t in eval_pos]
        evaluation += [row(t, name, "negative", cid) for t in NEGATIVES[1::2]]
    for name, rows in (("metadata", meta), ("train_data", train), ("latent_eval_data", evaluation)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(directory)


@pytest.fixture
def planted(tmp_path):
    """ "dogs": positives full of " dog", separable from the negatives; "echo": its positives ARE
    the negative sentences, so no detector can tell them apart (held-out AUROC 0.5)."""
    return _write_concepts(
        tmp_path / "concepts", {"dogs": (DOGS[:3], DOGS[3:]), "echo": (NEGATIVES[::2], NEGATIVES[1::2])}
    )


def test_rate_by_the_cut_points():
    assert [rate(p, CONCEPT_CUTS) for p in (0.0, 0.2999, 0.3, 0.6999, 0.7, 1.0)] == [0, 0, 1, 1, 2, 2]
    assert [rate(d, INSTRUCT_CUTS) for d in (-1.0, 0.1199, 0.12, 0.2499, 0.25, 3.0)] == [0, 0, 1, 1, 2, 2]
    ppl = (1.0, 100.0, 100.01, 300.0, 300.01, 1e6)
    assert [rate(p, FLUENCY_CUTS, lower_is_better=True) for p in ppl] == [2, 2, 1, 1, 0, 0]
    assert rate(math.nan, CONCEPT_CUTS) == 0 and rate(math.nan, FLUENCY_CUTS, lower_is_better=True) == 0


def _hand_log_probs(model, tokenizer, prefix: str | None, reply: str) -> list[float]:
    """log p(y_t | prefix, y_<t) of each reply token, from one unbatched forward of the whole LM."""
    ids = [tokenizer.bos_token_id] + (tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else [])
    ids += tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + reply_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(ids) + t - 1, token]) for t, token in enumerate(reply_ids)]


def test_proxies_equal_a_hand_computation_on_a_tiny_llama(tiny_lm_dir, planted):
    """Perplexity and Δ of replies of different lengths batched together (right padding) equal
    those of one unbatched forward each; the scores are their ratings by the cut points."""
    lm = tiny_lm_dir("llama")
    judge = OfflineJudge(lm=lm, concept_dir=planted, cache=None, batch_size=3)
    replies = ["The dog is here.", "dog", "The dog is not here. The dog was here."]
    instructions = ["Say something.", "Where is the dog?", "Is the dog here?"]
    measured = judge.measure(["dogs"] * 3, instructions, replies)
    scores = judge.score(["dogs"] * 3, instructions, replies)
    model, tokenizer = load_lm(lm), load_tokenizer(lm)
    assert judge.layer == 1  # the middle of 3 blocks
    for instruction, reply, m, score in zip(instructions, replies, measured, scores):
        alone, given = (
            _hand_log_probs(model, tokenizer, None, reply),
            _hand_log_probs(model, tokenizer, instruction, reply),
        )
        assert m["tokens"] == len(alone)
        assert m["perplexity"] == pytest.approx(math.exp(-sum(alone) / len(alone)), rel=1e-4)
        assert m["relevance"] == pytest.approx((sum(given) - sum(alone)) / len(alone), abs=1e-4)
        c, i = rate(m["p_concept"], CONCEPT_CUTS), rate(m["relevance"], INSTRUCT_CUTS)
        f = rate(m["perplexity"], FLUENCY_CUTS, lower_is_better=True)
        assert (score.concept_score, score.instruct_score, score.fluency_score) == (c, i, f)
        assert score.overall == harmonic_mean(c, i, f) and "perplexity=" in score.replies["fluency"]
    assert judge.auroc["dogs"] == 1.0  # " dog" sentences against the rest: separable even at random weights
    empty = judge.score(["dogs"], ["Say something."], [""])[0]
    assert (empty.concept_score, empty.instruct_score, empty.fluency_score, empty.overall) == (0, 0, 0, 0)


def test_an_unreliable_or_unknown_concept_is_refused_in_one_line(tiny_lm_dir, tmp_path):
    """Alone in its set, "echo"'s held-out positives and negatives are the same sentences: every
    pair ties, AUROC 0.5 exactly."""
    alone = _write_concepts(tmp_path / "echo", {"echo": (NEGATIVES[::2], NEGATIVES[1::2])})
    judge = OfflineJudge(lm=tiny_lm_dir("llama"), concept_dir=alone, cache=None)
    with pytest.raises(ValueError) as err:
        judge.prepare(["echo"])
    assert str(err.value) == (
        "concept 'echo': its offline detector's held-out AUROC is 0.500, below the reliability bar "
        "min_auroc=0.8; its concept scores would not mean anything"
    )
    with pytest.raises(ValueError, match=r"^concept 'cats' is not in the offline judge's concept data .*concept_dir$"):
        judge.prepare(["cats"])
    with pytest.raises(ValueError, match=r"^min_auroc=0.3 must be a number in \[0.5, 1\]"):
        make_judge("offline", min_auroc=0.3)


def two_concept_dictionary(lm: str, path) -> str:
    """A saved DiffMean dictionary of random unit rows for "dogs" and "echo" at layer 1 of `lm`."""
    vectors = torch.nn.functional.normalize(torch.randn(2, 32), dim=-1)
    rows = {"max_activations": torch.tensor([4.0, 8.0]), "concepts": ["dogs", "echo"]}
    return Dictionary(vectors=vectors, model=lm, layer=1, method="diffmean", **rows).save(path)


def test_steer_refuses_an_unreliable_concept_before_the_steered_lm_loads(
    tiny_lm_dir, tmp_path, planted, capsys, monkeypatch
):
    """Through the CLI: exit 2, one `error:` line; the steered LM never loads (run_cells not reached)."""
    lm = tiny_lm_dir("llama")
    path = two_concept_dictionary(lm, tmp_path / "dict")
    monkeypatch.setattr(steer, "run_cells", lambda plan: pytest.fail("the steered LM was loaded"))
    judge = json.dumps({"backend": "offline", "lm": lm, "concept_dir": planted, "cache": None})
    with pytest.raises(SystemExit) as err:
        steer.main(["--dictionary", str(path), "--judge", judge, "--instructions", "2", "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and lines[-1].startswith("error: concept 'echo': its offline detector's held-out AUROC")


def test_ready_judge_defaults_to_offline_and_prepares_the_concepts(monkeypatch):
    made = []

    class Recorder(Judge):
        name = "offline"

        def __init__(self, **options):
            made.append(options)
            self.prepared = None

        def prepare(self, concepts):
            self.prepared = concepts

    monkeypatch.setitem(judge_module.JUDGES, "offline", Recorder)
    judge = steer.ready_judge(None, ["dogs", "rivers"])
    assert isinstance(judge, Recorder) and made == [{}] and judge.prepared == ["dogs", "rivers"]


class Fixed(Judge):
    """Scores each reply by a table: reply -> (c, i, f)."""

    def __init__(self, name, table):
        self.name, self.table = name, table

    def score(self, concepts, instructions, responses):
        return [JudgeScore(*self.table[r], harmonic_mean(*self.table[r]), {"concept": r}) for r in responses]


def test_two_judges_side_by_side_and_their_spearman_by_hand():
    ours = Fixed("offline", {"a": (0, 2, 2), "b": (1, 2, 1), "c": (2, 1, 2), "d": (2, 2, 0)})
    theirs = Fixed("openai", {"a": (0, 2, 2), "b": (2, 1, 2), "c": (1, 2, 2), "d": (2, 2, 2)})
    scores = ComparedJudge(ours, theirs).score(["x"] * 4, ["i"] * 4, ["a", "b", "c", "d"])
    rows = [s.as_dict() for s in scores]
    assert rows[1]["concept_score"] == 1 and rows[1]["compared"]["concept_score"] == 2
    assert rows[1]["compared"]["judge"] == "openai" and rows[1]["compared"]["replies"] == {"concept": "b"}
    table = {r["score"]: r for r in judge_agreement(rows)}
    # concept: ours 0,1,2,2 (ranks 1,2,3.5,3.5), theirs 0,2,1,2 (ranks 1,3.5,2,3.5):
    # centred ranks (-1.5,-.5,1,1) · (-1.5,1,-.5,1) = 2.25-.5-.5+1 = 2.25; each norm² 1.5²+.5²+1+1 = 4.5
    assert table["concept_score"]["spearman"] == pytest.approx(2.25 / 4.5)
    assert table["concept_score"]["ours"] == 1.25 and table["concept_score"]["theirs"] == 1.25
    # instruct: ours 2,2,1,2 (centred ranks .5,.5,-1.5,.5), theirs 2,1,2,2 (.5,-1.5,.5,.5): -1 / 3
    assert table["instruct_score"]["spearman"] == pytest.approx(-1 / 3) and table["fluency_score"]["n"] == 4
    assert math.isnan(table["fluency_score"]["spearman"])  # theirs gives every reply 2: no ranking
    assert math.isnan(
        judge_agreement([{**r, "compared": {**r["compared"], "instruct_score": 2}} for r in rows])[1]["spearman"]
    )
    assert agreement_lines(rows, ("offline", "openai"))[0] == (
        "judges side by side over 4 generations: offline | openai | Spearman ρ"
    )
    assert "compared" not in JudgeScore(1, 1, 1, 1).as_dict() and judge_agreement([{"overall": 1}]) == []


def test_make_judge_compare_is_one_judge_config():
    with pytest.raises(ValueError, match=r"^judge compare='openai' must be one judge's config"):
        make_judge("openai", compare="openai")
    judge = make_judge("openai", base_url="http://127.0.0.1:9/v1", compare={"backend": "openai", "model": "m"})
    assert isinstance(judge, ComparedJudge) and judge.other.model == "m" and judge.primary.model == "gpt-4o-mini"


@pytest.mark.slow
def test_planted_replies_rank_in_order_under_gemma(tmp_path):
    """Under the real reference LM: word salad less fluent than a fluent reply, an off-topic reply
    less relevant than an on-topic one, a reply about rain higher on the rain concept than one
    without; their ratings too. The detector is trained on a slice of the built-in data (a few
    seconds' worth)."""
    data = load_concepts(None)
    concepts = {}
    for c in (0, 1, 2):  # weather, garlic, music: 12 train and 8 eval positives each
        train = data.train[(data.train.concept_id == c) & (data.train.category == "positive")].output.tolist()
        held = data.eval[(data.eval.concept_id == c) & (data.eval.category == "positive")].output.tolist()
        concepts[data.concepts[c]] = (train[:12], held[:8])
    judge = OfflineJudge(concept_dir=_write_concepts(tmp_path / "c", concepts), cache=None)
    calibration = json.loads((BUILTIN_DIR / "judge_calibration.json").read_text())
    by_kind = {}
    for r in calibration["replies"]:
        if r["instruction"] == calibration["instructions"][2]:  # a relaxing Sunday
            by_kind.setdefault((r["kind"], r["concept"]), r["reply"])
    rain = "references to weather and rain"
    kinds = [("on-topic", None), ("word salad", None), ("off-topic", None), ("concept-bearing", rain)]
    replies = [by_kind[k] for k in kinds]
    instruction = calibration["instructions"][2]
    m = judge.measure([rain] * 4, [instruction] * 4, replies)
    s = judge.score([rain] * 4, [instruction] * 4, replies)
    on, salad, off, rainy = m
    assert salad["perplexity"] > 10 * on["perplexity"] and s[1].fluency_score < s[0].fluency_score
    assert off["relevance"] < on["relevance"] - 0.2 and s[2].instruct_score < s[0].instruct_score
    assert rainy["p_concept"] > on["p_concept"] + 0.5 and s[3].concept_score > s[0].concept_score
    assert min(judge.auroc.values()) >= 0.8


def test_steer_with_a_second_judge_prints_both_side_by_side(tiny_lm_dir, tmp_path, planted, capsys):
    """`compare`: every row carries the second judge's scores, and `steer` prints both judges'
    means over the generations with their Spearman ρ."""
    lm = tiny_lm_dir("llama")
    path = two_concept_dictionary(lm, tmp_path / "dict")
    (tmp_path / "instructions.json").write_text(json.dumps(["The dog is here.", "Is the dog here?"]))
    local = {"backend": "local", "lm": lm, "batch_size": 2}
    judge = json.dumps({"backend": "offline", "lm": lm, "concept_dir": planted, "cache": None, "compare": local})
    out = tmp_path / "o"
    argv = ["--dictionary", str(path), "--concepts", "[dogs]", "--factors", "[0.5,2.0]", "--instructions", "2"]
    argv += ["--instruction_file", str(tmp_path / "instructions.json"), "--max_new_tokens", "3", "--batch_size", "2"]
    steer.main([*argv, "--judge", judge, "--out", str(out)])
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["compared"]["judge"] == "local" for r in rows)
    printed = capsys.readouterr().out.splitlines()
    header = printed.index("judges side by side over 4 generations: offline | local | Spearman ρ")
    expected = {r["score"]: r for r in judge_agreement(rows)}
    for line in printed[header + 1 : header + 5]:
        name, ours, theirs, rho = line.split()[0], *(x.strip() for x in line.split(None, 1)[1].split("|"))
        assert float(ours) == pytest.approx(expected[name]["ours"], abs=5e-4)
        assert float(theirs) == pytest.approx(expected[name]["theirs"], abs=5e-4)
        assert rho == f"{expected[name]['spearman']:.3f}"
