"""SyntaxGym: the formula parser, region surprisal against a hand computation, the CLI, the real suites."""

from __future__ import annotations

import copy
import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
from tokenizers import processors
from transformers import AutoModelForCausalLM

from lit_interventions.core.lm import load_lm
from lit_interventions.core.surprisal import (
    bos_prefix,
    encode_regions,
    join_regions,
    region_surprisals,
    token_surprisals,
)
from lit_interventions.studies.syntaxgym.cli import main, score_line
from lit_interventions.studies.syntaxgym.formulas import FormulaError, parse_formula
from lit_interventions.studies.syntaxgym.score import SuiteResult, evaluate_suite, sg_score, write_csv
from lit_interventions.studies.syntaxgym.suites import load_suite, suite_from_json, suite_paths
from tests.helpers import run_command

REAL_SUITES = Path(__file__).resolve().parents[2] / "shared" / "data" / "syntaxgym"

FORMULA = "[(3;%match%) < (3;%mismatch%)] & [((3;%match%) + (4;%match%)) - 100 < (3;%mismatch%)]"


def _condition(name: str, regions: list[str]) -> dict:
    return {"condition_name": name, "regions": [{"region_number": n, "content": c} for n, c in enumerate(regions, 1)]}


# Region 2 is empty in item 2 and has stray spaces in item 3; region 4 is punctuation only.
TINY_SUITE = {
    "meta": {"name": "tiny_agreement", "metric": "sum"},
    "predictions": [{"type": "formula", "formula": FORMULA}],
    "items": [
        {
            "item_number": 1,
            "conditions": [
                _condition("match", ["The author", "near the senators", "is", "."]),
                _condition("mismatch", ["The author", "near the senators", "are", "."]),
            ],
        },
        {
            "item_number": 2,
            "conditions": [
                _condition("match", ["The authors", "", "are", "."]),
                _condition("mismatch", ["The authors", "", "is", "."]),
            ],
        },
        {
            "item_number": 3,
            "conditions": [
                _condition("match", ["The pilot", " near  the farmers ", "is", "."]),
                _condition("mismatch", ["The pilot", " near  the farmers ", "are", "."]),
            ],
        },
    ],
}
TINY_SENTENCES = [
    "The author near the senators is .",
    "The author near the senators are .",
    "The authors are .",
    "The authors is .",
    "The pilot near the farmers is .",
    "The pilot near the farmers are .",
]


def _write(tmp_path: Path, data: dict, name: str = "suite.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- formula parser


VALUES = {("a", 1): 1.0, ("a", 2): 4.0, ("b", 1): 3.0, ("b", 2): 2.0}


@pytest.mark.parametrize(
    "formula,expected",
    [
        ("(1;%a%) < (1;%b%)", True),
        ("(1;%a%)>(1;%b%)", False),
        ("[(1;%a%) < (1;%b%)] & [(2;%a%) > (2;%b%)]", True),
        ("[(1;%a%) < (1;%b%)] & [(2;%a%) < (2;%b%)]", False),
        ("[(1;%a%) > (1;%b%)] | [(2;%a%) > (2;%b%)]", True),
        ("(2;%a%) - (1;%a%) = 3", True),  # 4 - 1
        ("(2;%a%) - (1;%a%) - (1;%a%) = 2", True),  # left-associative: (4 - 1) - 1
        ("(2;%a%) - [(1;%a%) - (1;%a%)] = 4", True),
        ("[(2;%a%) - (2;%b%)] - [(1;%b%) - (1;%a%)] > 0", False),  # 2 - 2
        ("[[(2;%a%) - (1;%a%)] > [(1;%b%) - (2;%b%)]] & [((1;%a%) + (1;%b%)) = (2;%a%)]", True),  # 3 > 1, 4 = 4
        ("(1;%a%) = 1.0005", True),  # SyntaxGym's tolerance: |a - b| <= 1e-3 + 1e-5 |b|
        ("(1;%a%) = 1.01", False),
        ("-(1;%a%) < 0", True),
        ("(*;%a%) = 5", True),  # all regions of condition a
    ],
)
def test_formula_by_hand(formula, expected):
    assert parse_formula(formula).evaluate(VALUES) is expected


@pytest.mark.parametrize(
    "formula,reason",
    [
        ("[(5;%a%) > (5;%b%)", r"'\[' at position 0 is never closed"),
        ("[(5;%a%) > (5;%b%))", r"closed by '\)'"),
        ("(5;%a%) >> (5;%b%)", r"unexpected '>'"),
        ("(5;%a%) + (5;%b%)", "must be a comparison"),
        ("[(5;%a%) > 1] + 2 > 0", r"'\+' at position 14 needs numbers"),
        ("(5;%a%) & (5;%b%)", "'&' at position 8 needs comparisons"),
        ("(5;%a%) > 1 > 0", "chained comparison"),
        ("(5;a) > 1", "unexpected character ';'"),
        ("(5;%a%) > 1 ]", r"unexpected '\]'"),
    ],
)
def test_malformed_formula_names_suite_and_formula(formula, reason):
    with pytest.raises(ValueError, match=reason) as caught:
        parse_formula(formula, suite="my_suite")
    assert isinstance(caught.value, FormulaError)
    assert "suite 'my_suite'" in str(caught.value) and repr(formula) in str(caught.value)


def test_suite_with_bad_formula_or_unknown_condition_is_rejected_on_load(tmp_path):
    bad = copy.deepcopy(TINY_SUITE)
    bad["predictions"][0]["formula"] = "[(3;%match%) < (3;%mismatch%)"
    with pytest.raises(ValueError, match=r"suite 'tiny_agreement': cannot parse formula '\[\(3;%match%\)"):
        load_suite(_write(tmp_path, bad))
    bad["predictions"][0]["formula"] = "(3;%match%) < (3;%other%)"
    with pytest.raises(ValueError, match=r"reads condition 'other'.*\['match', 'mismatch'\]"):
        load_suite(_write(tmp_path, bad))
    bad["predictions"][0]["formula"] = "(9;%match%) < (3;%mismatch%)"
    with pytest.raises(ValueError, match=r"reads region 9 .*\[1, 2, 3, 4\]"):
        load_suite(_write(tmp_path, bad))


@pytest.mark.parametrize(
    "break_it,reason",
    [
        (lambda suite: suite["items"][0].pop("conditions"), "has no 'conditions' list"),
        (lambda suite: suite["items"][0]["conditions"][0].pop("condition_name"), "needs a 'condition_name'"),
        (lambda suite: suite["items"][0]["conditions"][0]["regions"][0].pop("content"), "a string 'content'"),
        (lambda suite: suite.pop("predictions"), "has no predictions"),
    ],
)
def test_malformed_suite_structure_is_named(tmp_path, break_it, reason):
    bad = copy.deepcopy(TINY_SUITE)
    break_it(bad)
    with pytest.raises(ValueError, match=f"suite 'tiny_agreement' .*{reason}"):
        load_suite(_write(tmp_path, bad))


def test_metric_must_be_sum_or_mean(tmp_path):
    bad = copy.deepcopy(TINY_SUITE)
    bad["meta"]["metric"] = "median"
    with pytest.raises(ValueError, match=r"meta.metric='median'.*\['sum', 'mean'\]"):
        load_suite(_write(tmp_path, bad))


# ---------------------------------------------------------------- sentences and tokens


def test_regions_join_with_single_spaces_as_syntaxgym_core():
    sentences = [
        join_regions([r["content"] for r in c["regions"]])[0]
        for item in TINY_SUITE["items"]
        for c in item["conditions"]
    ]
    assert sentences == TINY_SENTENCES
    text, spans = join_regions(["The authors", "", "are", "."])
    assert text == "The authors are ."
    assert [text[start:end] for start, end in spans] == ["The authors", "", "are", "."]
    attached, spans = join_regions(["The authors", "", "are", ",", "."], attach_punctuation=True)
    assert attached == "The authors are,." and [attached[a:b] for a, b in spans][-2:] == [",", "."]


def _syntaxgym_core_sentence(regions: list[str]) -> str:
    """syntaxgym-core's `Suite.iter_sentences`: the left-stripped non-empty regions joined by spaces."""
    return " ".join(region.lstrip() for region in regions if region.strip() != "")


def test_punctuation_region_scored_as_syntaxgym_core(tiny_lm_dir, tokenizer):
    """A hand-made item: the "." region is its own word after a space, as syntaxgym-core writes
    the sentence; its token is "Ġ." (the space goes with the token, as lm-zoo's alignment does),
    and its surprisal is −log2 p(Ġ. | <bos> The keys to the cabinet are) from one forward."""
    model = load_lm(tiny_lm_dir("gpt2"))
    regions = ["The keys", "to the cabinet", "are", "."]
    encoded = encode_regions(tokenizer, regions)
    assert encoded.text == _syntaxgym_core_sentence(regions) == "The keys to the cabinet are ."
    words = tokenizer.convert_ids_to_tokens(encoded.token_ids)
    assert list(zip(words, encoded.token_regions))[-2:] == [("Ġare", 2), ("Ġ.", 3)]
    log2_probs = torch.log_softmax(model(torch.tensor([encoded.token_ids])).logits[0].double(), -1) / math.log(2)
    period = len(encoded.token_ids) - 1
    expected = -log2_probs[period - 1, encoded.token_ids[period]].item()
    assert region_surprisals(model, tokenizer, [regions])[0][3] == pytest.approx(expected, abs=1e-4)
    # the earlier join, kept as an option: "are." with the bare "." token
    attached = encode_regions(tokenizer, regions, attach_punctuation=True)
    assert attached.text == "The keys to the cabinet are."
    assert tokenizer.convert_ids_to_tokens(attached.token_ids)[-1] == "." and attached.token_regions[-1] == 3
    assert region_surprisals(model, tokenizer, [regions], attach_punctuation=True)[0][3] != pytest.approx(expected)


def test_bos_is_prepended_only_when_the_tokenizer_does_not_add_it(tokenizer):
    adds_bos = copy.deepcopy(tokenizer)
    adds_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)]
    )
    assert bos_prefix(tokenizer) == "<bos>" and bos_prefix(adds_bos) == ""
    regions = ["The author", "near the senators", "is", "."]
    prepended, added = encode_regions(tokenizer, regions), encode_regions(adds_bos, regions)
    assert prepended.token_ids == added.token_ids and prepended.token_regions == added.token_regions
    assert prepended.token_ids[0] == tokenizer.bos_token_id
    words = tokenizer.convert_ids_to_tokens(prepended.token_ids)
    assert list(zip(words, prepended.token_regions))[-3:] == [("Ġsenators", 1), ("Ġis", 2), ("Ġ.", 3)]


# ---------------------------------------------------------------- surprisal against a hand computation


def _hand_region_surprisals(model, tokenizer, regions: list[str]) -> list[float]:
    """From the full-sequence logits of one unpadded sentence: log_softmax / ln 2, summed per region.

    A region's tokens are found by tokenising growing prefixes: the tokens of <bos> + regions
    1..k minus those of <bos> + regions 1..k-1.
    """
    sentence = join_regions(regions)[0]
    ids = tokenizer("<bos>" + sentence, add_special_tokens=False).input_ids
    log2_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1) / math.log(2)
    bounds = [1]
    for k in range(1, len(regions) + 1):
        prefix_ids = tokenizer("<bos>" + join_regions(regions[:k])[0], add_special_tokens=False).input_ids
        assert prefix_ids == ids[: len(prefix_ids)]  # the region ends on a token boundary
        bounds.append(len(prefix_ids))
    return [-sum(log2_probs[t - 1, ids[t]].item() for t in range(start, end)) for start, end in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("arch", ["gpt2", "gemma2"])  # gemma2: soft-capped logits
def test_region_surprisals_and_predictions_match_a_hand_computation(tiny_lm_dir, tokenizer, tmp_path, arch):
    model = load_lm(tiny_lm_dir(arch))
    suite = suite_from_json(TINY_SUITE, "tiny")
    result = evaluate_suite(suite, model, tokenizer, batch_size=4, all_regions=True)
    expected_correct = []
    for item, values in zip(TINY_SUITE["items"], result.item_values):
        by_hand = {}
        for condition in item["conditions"]:
            regions = [region["content"] for region in condition["regions"]]
            for number, value in enumerate(_hand_region_surprisals(model, tokenizer, regions), 1):
                by_hand[condition["condition_name"], number] = value
        assert values == pytest.approx(by_hand, abs=1e-4)
        assert by_hand["match", 2] == 0.0 or item["item_number"] != 2  # the empty region has no tokens
        s = by_hand  # FORMULA, written out
        expected_correct.append(
            s["match", 3] < s["mismatch", 3] and (s["match", 3] + s["match", 4]) - 100 < s["mismatch", 3]
        )
    assert result.item_correct == expected_correct

    # By default only the regions the formula reads are scored, with the same values and outcome.
    read_only = evaluate_suite(suite, model, tokenizer, batch_size=4)
    assert read_only.item_correct == expected_correct
    for values, all_values in zip(read_only.item_values, result.item_values):
        assert sorted(values) == [("match", 3), ("match", 4), ("mismatch", 3)]
        assert values == pytest.approx({key: all_values[key] for key in values}, abs=1e-5)

    # The command gives the same accuracy and writes the CSV with the SG score as its last row.
    out = tmp_path / "sg.csv"
    main(["--suites", str(_write(tmp_path, TINY_SUITE)), "--lm", tiny_lm_dir(arch), "--out", str(out)])
    rows = list(csv.reader(out.open()))
    accuracy = sum(expected_correct) / 3
    assert rows[0] == ["suite", "items", "accuracy"]
    assert rows[1][:2] == ["tiny_agreement", "3"] and float(rows[1][2]) == pytest.approx(accuracy, abs=1e-6)
    assert rows[2][:2] == ["SG score (all suites)", "3"] and float(rows[2][2]) == pytest.approx(accuracy, abs=1e-6)
    assert rows[3][:2] == ["SG score", "3"] and float(rows[3][2]) == pytest.approx(accuracy, abs=1e-6)


def test_sg_score_leaves_out_the_suites_the_official_analysis_drops(tmp_path):
    # the analysis of Hu et al. 2020 drops ^fgd-embed[34], ^gardenpath and ^nn-nv before its mean
    outcomes = {
        "number_src": [True, True, False, False],  # 0.5
        "fgd-embed3": [False] * 3,  # 0, left out
        "fgd-embed4": [True],  # 1, left out
        "fgd_hierarchy": [True, False, False, False],  # 0.25 (an fgd suite the analysis keeps)
        "nn-nv-rpl": [False, False],  # 0, left out
        "gardenpath_x": [True],  # 1, left out
        "subordination": [True, True, True, False],  # 0.75
    }
    results = [SuiteResult(name, correct, [{} for _ in correct]) for name, correct in outcomes.items()]
    assert sg_score(results) == pytest.approx((0.5 + 0.25 + 0.75) / 3, abs=1e-12)
    assert sg_score(results, all_suites=True) == pytest.approx((0.5 + 0 + 1 + 0.25 + 0 + 1 + 0.75) / 7, abs=1e-12)
    write_csv(results, tmp_path / "sg.csv")
    rows = list(csv.reader((tmp_path / "sg.csv").open()))
    assert rows[-2] == ["SG score (all suites)", "19", f"{3.5 / 7:.6f}"]
    assert rows[-1] == ["SG score", "12", f"{0.5:.6f}"]
    assert math.isnan(sg_score(results[1:2]))  # only left-out suites: no score


def test_mean_metric_divides_by_the_token_count(tiny_lm_dir, tokenizer):
    model = load_lm(tiny_lm_dir("gpt2"))
    regions = ["The author", "near the senators", "is", "."]
    sums = region_surprisals(model, tokenizer, [regions], metric="sum")[0]
    means = region_surprisals(model, tokenizer, [regions], metric="mean")[0]
    counts = [encode_regions(tokenizer, regions).token_regions.count(r) for r in range(4)]
    assert means == pytest.approx([total / count for total, count in zip(sums, counts)])


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_batching_and_padding_do_not_change_surprisal(tiny_lm_dir, tokenizer, arch):
    model = load_lm(tiny_lm_dir(arch))
    sentences = [[r["content"] for r in c["regions"]] for item in TINY_SUITE["items"] for c in item["conditions"]]
    one_by_one = region_surprisals(model, tokenizer, sentences, batch_size=1)
    batched = region_surprisals(model, tokenizer, sentences, batch_size=6)
    for single, together in zip(one_by_one, batched):
        assert together == pytest.approx(single, abs=1e-4)


def test_soft_capped_logits_are_honoured(tiny_lm_dir, tokenizer):
    """Gemma 2 caps logits with 30 tanh(z / 30); large logits make the cap matter."""
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir("gemma2")).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(200.0)
    ids = encode_regions(tokenizer, ["The author", "near the senators", "is", "."]).token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    assert logits.abs().max() > 15  # the cap bends these
    by_hand = [-(torch.log_softmax(logits[t - 1], -1)[ids[t]] / math.log(2)).item() for t in range(1, len(ids))]
    ours = token_surprisals(model, [ids], pad_id=tokenizer.pad_token_id)[0]
    assert ours[1:].tolist() == pytest.approx(by_hand, abs=1e-3)


def test_unwanted_regions_are_nan_and_wanted_ones_unchanged(tiny_lm_dir, tokenizer):
    model = load_lm(tiny_lm_dir("gpt2"))
    regions = ["The author", "near the senators", "is", "."]
    every = region_surprisals(model, tokenizer, [regions])[0]
    some = region_surprisals(model, tokenizer, [regions], wanted_regions=[{0, 2}])[0]
    assert math.isnan(some[1]) and math.isnan(some[3])
    assert [some[0], some[2]] == pytest.approx([every[0], every[2]], abs=1e-5)


# ---------------------------------------------------------------- command-line errors (before the LM loads)


def _error_of(argv: list[str]) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with pytest.raises(SystemExit) as caught, contextlib.redirect_stderr(err):
        main(argv)
    message = err.getvalue()
    assert caught.value.code == 2 and message.startswith("error: ") and message.count("\n") == 1, message
    return message


def test_missing_path_is_a_one_line_error(tmp_path):
    message = _error_of(["--suites", str(tmp_path / "nope.json"), "--lm", "unused", "--out", str(tmp_path / "o.csv")])
    assert "nope.json" in message and "not found" in message
    message = _error_of(["--suites", str(tmp_path), "--lm", "unused", "--out", str(tmp_path / "o.csv")])
    assert "no *.json" in message


def test_suite_without_items_is_a_one_line_error(tmp_path):
    empty = dict(TINY_SUITE, items=[])
    message = _error_of(["--suites", str(_write(tmp_path, empty)), "--lm", "unused", "--out", str(tmp_path / "o.csv")])
    assert "suite 'tiny_agreement'" in message and "has no items" in message


def test_bad_formula_stops_the_command(tmp_path):
    bad = copy.deepcopy(TINY_SUITE)
    bad["predictions"][0]["formula"] = "(3;%match%) <"
    message = _error_of(["--suites", str(_write(tmp_path, bad)), "--lm", "unused", "--out", str(tmp_path / "o.csv")])
    assert "suite 'tiny_agreement'" in message and "'(3;%match%) <'" in message


def test_the_command_prints_the_sg_score_once_and_ends_with_the_file_it_wrote(tiny_lm_dir, tmp_path):
    """`lit-interventions syntaxgym` as a user runs it: a line per suite, one SG score line (the
    official analysis's; the all-suites mean beside it when a suite is left out of it) and, last,
    the CSV it wrote; the printed figures are the CSV's."""
    suites = tmp_path / "suites"
    suites.mkdir()
    _write(suites, TINY_SUITE, "tiny.json")
    dropped = copy.deepcopy(TINY_SUITE)  # a suite the official analysis leaves out (gardenpath*)
    dropped["meta"]["name"] = "gardenpath_tiny"
    for item in dropped["items"]:
        item["conditions"][0]["condition_name"], item["conditions"][1]["condition_name"] = "mismatch", "match"
    _write(suites, dropped, "gardenpath.json")
    out = tmp_path / "runs" / "sg.csv"
    done = run_command("syntaxgym", "--suites", str(suites), "--lm", tiny_lm_dir("gpt2"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row[0]: row for row in csv.reader(out.open())}
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["gardenpath_tiny", "tiny_agreement"]
    official, every = float(rows["SG score"][2]), float(rows["SG score (all suites)"][2])
    assert official != every  # the left-out suite changes the all-suites mean
    score_lines = [line for line in lines if line.startswith("SG score")]
    assert score_lines == [f"{'SG score':<28} suites  1  accuracy {official:.3f}  (all 2 suites: {every:.3f})"]
    assert re.fullmatch(rf"wrote {re.escape(str(out))} \(\d+\.\d s with model loading\)", lines[-1]), lines
    assert len(lines) == 4 and "files in" not in done.stdout


def test_the_sg_score_line_of_counted_suites_alone_has_no_all_suites_figure():
    results = [SuiteResult("number_src", [True, False], [{}, {}]), SuiteResult("subordination", [True], [{}])]
    assert score_line(results) == f"{'SG score':<28} suites  2  accuracy 0.750"  # (0.5 + 1) / 2


# ---------------------------------------------------------------- the real suites


@pytest.mark.skipif(
    not REAL_SUITES.is_dir(),
    reason=f"no SyntaxGym suites at {REAL_SUITES}; get them: lit-interventions data syntaxgym --out {REAL_SUITES}",
)
def test_all_34_real_suites_parse():
    paths = suite_paths([str(REAL_SUITES)])
    suites = [load_suite(path) for path in paths]  # parses every formula, checks every region it reads
    assert len(suites) == 34
    assert all(suite.metric == "sum" and suite.items and suite.predictions for suite in suites)
    assert sum(len(suite.predictions) for suite in suites) == 36


@pytest.mark.slow
@pytest.mark.skipif(
    not REAL_SUITES.is_dir(),
    reason=f"no SyntaxGym suites at {REAL_SUITES}; get them: lit-interventions data syntaxgym --out {REAL_SUITES}",
)
def test_gemma_beats_chance_on_number_agreement(tmp_path):
    """gemma-3-270m on 2 real suites (about 20 s on 2 CPU cores once the model is cached)."""
    out = tmp_path / "sg.csv"
    suites = [str(REAL_SUITES / "number_src.json"), str(REAL_SUITES / "subordination.json")]
    results = main(["--suites", *suites, "--lm", "gemma-3-270m", "--out", str(out)])
    accuracy = {result.name: result.accuracy for result in results}
    assert accuracy["number_src"] > 0.5, accuracy  # chance is 0.25: two conjuncts
    rows = list(csv.reader(out.open()))
    assert [row[0] for row in rows] == ["suite", "number_src", "subordination", "SG score (all suites)", "SG score"]
