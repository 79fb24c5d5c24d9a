"""Published-template sampling on a planted file in the published CausalGym format, by hand.

The official rule (aryamanarora/causalgym, `data.py`, `Dataset.sample_pair`): the base and
source types differ; a label variable takes an option of the sentence's own type on each side
(drawn apart); a dotted `head.part` takes the option at one index drawn once per head variable
and shared by both sentences; any other variable takes one option both sentences share; each
sentence's continuation is a word of its own type, drawn apart, with a space before it when
`result_prepend_space` is true. Ours: `datamodules/templates.py` (`sample_pair`,
`sample_pairs`: n distinct pairs, then their swaps) and `CausalGymDataModule` (the file read by
`--data.templates`, train / eval / dev with no train sentence in the others).

The planted file copies the published `syntaxgym.json` entry format (`source`, `templates`,
`label`, `result_prepend_space`, `labels`, `variables`) with options small enough to list every
pair the rule can draw."""

import json

import pytest
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from lit_interventions.datamodules.templates import load_task, sample_pairs

# garden_mvrr's shape: an empty label option (the reduced relative), label words with their own
# space and result_prepend_space false, a head variable `vp` of two parts.
MVRR = {
    "source": "https://syntaxgym.org/test_suite/items?test_suite=265",
    "templates": ["The {noun}{insert} {vp.verb} {vp.cont}"],
    "label": "insert",
    "result_prepend_space": False,
    "labels": {"rr": [" by"], "mv": ["."]},
    "variables": {
        "noun": ["dog", "cat"],
        "insert": {"rr": [" who was"], "mv": [""]},
        "vp.verb": ["walked", "fed"],
        "vp.cont": ["home", "fast"],
    },
}
# agr_sv_num_pp's shape: a label list, two words per type, result_prepend_space true.
AGREE = {
    "source": "https://syntaxgym.org/test_suite/items?test_suite=259",
    "templates": ["The {subject} near the {object}"],
    "label": ["subject"],
    "result_prepend_space": True,
    "labels": {"plural": ["are", "were"], "singular": ["is", "was"]},
    "variables": {"subject": {"singular": ["author"], "plural": ["authors"]}, "object": ["house", "car", "ball"]},
}

# Every pair the official rule can draw from MVRR, unordered, written out: the noun and the
# vp row shared, "walked" always with "home", "fed" with "fast".
MVRR_PAIRS = {
    frozenset({("rr", f"The {n} who was {v} {c}", " by"), ("mv", f"The {n} {v} {c}", ".")})
    for n in ("dog", "cat")
    for v, c in (("walked", "home"), ("fed", "fast"))
}


@pytest.fixture
def published(tmp_path):
    path = tmp_path / "templates.json"
    path.write_text(json.dumps({"garden_mvrr": MVRR, "agr_sv_num_pp": AGREE}, indent=2))
    return str(path)


def _side(sentence, label_type):
    return (label_type, sentence.text, sentence.label)


def _unordered(pair):
    return frozenset({_side(pair.base, pair.base_type), _side(pair.source, pair.source_type)})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_distinct_pair_once_then_the_swaps(published, seed):
    task = load_task("garden_mvrr", published)
    pairs = sample_pairs(task, 4, seed)
    assert len(pairs) == 8
    assert {_unordered(p) for p in pairs[:4]} == MVRR_PAIRS  # the 4 the rule can draw, each once
    for pair, swap in zip(pairs[:4], pairs[4:]):
        assert (swap.base, swap.source, swap.base_type, swap.source_type) == (
            pair.source, pair.base, pair.source_type, pair.base_type,
        )  # fmt: skip
    with pytest.raises(ValueError, match="5 pairs asked for, but task 'garden_mvrr' has only 4 distinct pairs"):
        sample_pairs(task, 5, seed)


def test_the_regions_of_a_drawn_pair_by_hand(published):
    pair = next(p for p in sample_pairs(load_task("garden_mvrr", published), 4, 0) if p.base_type == "rr")
    noun = pair.base.text.split()[1]
    assert pair.source.text == pair.base.text.replace(" who was", "")
    n = len(noun)  # "The " 4 characters, the noun, " who was" 8, then the verb
    assert pair.base.spans["The"] == (0, 3) and pair.base.spans["noun"] == (4, 4 + n)
    assert pair.base.spans["insert"] == (5 + n, 12 + n)
    assert "insert" not in pair.source.spans  # the empty option leaves no token there
    verb = pair.base.text.split()[4]
    assert pair.base.spans["vp.verb"] == (13 + n, 13 + n + len(verb))
    assert pair.source.spans["vp.verb"] == (5 + n, 5 + n + len(verb))


def test_labels_are_each_sides_own_types_words_drawn_apart(published):
    task = load_task("agr_sv_num_pp", published)
    words = {"plural": {" are", " were"}, "singular": {" is", " was"}}  # result_prepend_space: a space first
    pairs = sample_pairs(task, 3, 0)  # 1 subject per type x 3 objects: 3 distinct pairs
    assert {p.base.text.split()[-1] for p in pairs[:3]} == {"house", "car", "ball"}
    for pair in pairs:
        assert {pair.base_type, pair.source_type} == {"plural", "singular"}
        assert pair.base.text.split()[-1] == pair.source.text.split()[-1]  # the object shared
        assert pair.base.text.split()[1] == {"singular": "author", "plural": "authors"}[pair.base_type]
        assert pair.base.label in words[pair.base_type] and pair.source.label in words[pair.source_type]
    # drawn apart on each side: over many draws every (base word, source word) combination occurs
    combos = set()
    for seed in range(40):
        for pair in sample_pairs(task, 3, seed)[:3]:
            combos.add((pair.base_type, pair.base.label, pair.source.label))
    assert combos == {
        (t, b, s)
        for t, other in (("plural", "singular"), ("singular", "plural"))
        for b in words[t]
        for s in words[other]
    }


def test_the_data_module_splits_the_published_file_without_shared_sentences(published, tiny_lm_dir):
    data = CausalGymDataModule(
        task="garden_mvrr", templates=published, lm=tiny_lm_dir("llama"), region="noun", train_pairs=2, eval_pairs=2
    )
    train, evaluation, dev = (data.pairs[s] for s in ("train", "eval", "dev"))
    assert len(train) == len(evaluation) == len(dev) == 4  # 2 pairs each, then their swaps
    # 4 distinct pairs in all: train takes 2, so eval and dev are the other 2 (no train sentence)
    assert {_unordered(p) for p in train} | {_unordered(p) for p in evaluation} == MVRR_PAIRS
    assert {_unordered(p) for p in evaluation} == {_unordered(p) for p in dev}
    assert not {_unordered(p) for p in train} & {_unordered(p) for p in evaluation}
