"""RAVEL data: file layout, errors, splits, entity positions, Cause / Iso labels, padding, filtering."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from lit_interventions.datamodules.ravel import RavelDataModule
from lit_interventions.datamodules.ravel_answers import _value_tokens, answer_hit
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL, load_ravel, value_separator

from lit_interventions.core.batch import CAUSE, ISO

SHARED_RAVEL = Path(__file__).resolve().parents[2] / "shared" / "data" / "ravel"


def oracle(known):
    """A stand-in for the model's answers: correct exactly on the entities in `known` (the value's
    answer tokens, then filler up to n tokens)."""

    def predict_next(self, model, queries):
        return [
            _padded(self, self.value_tokens(q.template, self.data.entities[q.entity][q.attribute]))
            if q.entity in known
            else [-1] * self.n_tokens
            for q in queries
        ]

    return predict_next


def _padded(dm, tokens):
    return list(tokens) + [0] * (dm.n_tokens - len(tokens))


@pytest.fixture
def module(monkeypatch, tiny_lm_dir, tmp_path):
    """Build a set-up RavelDataModule on the tiny model, with an oracle that knows every entity
    (or the given ones). The model's answers are cached under this test's own directory."""
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path))

    def make(known=None, **kwargs):
        kwargs = {"lm": tiny_lm_dir("gemma3"), "train_size": 60, "eval_size": 30, "max_candidates": 60, **kwargs}
        dm = RavelDataModule(**kwargs)
        known_entities = known if known is not None else set(dm.data.entities)
        monkeypatch.setattr(RavelDataModule, "predict_next", oracle(known_entities))
        dm.setup()
        return dm

    return make


# -- files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entity_type", "attributes", "n"),
    [
        ("city", ["Country", "Continent", "Language"], 120),
        ("physical_object", ["Category", "Color", "Size", "Texture"], 60),
    ],
)
def test_builtin_files_load(entity_type, attributes, n):
    data = load_ravel(None, entity_type)
    assert data.attributes == attributes
    assert len(data.entities) >= n
    assert all(set(v) == set(attributes) for v in data.entities.values())
    assert set(data.entity_split) == set(data.entities)
    assert set(data.prompt_split) == {t for ts in data.prompts.values() for t in ts}
    shares = Counter(data.entity_split.values())
    assert shares["train"] == pytest.approx(len(data.entities) / 2, abs=2)
    assert shares["val"] == pytest.approx(len(data.entities) / 4, abs=2)
    for templates in data.prompts.values():  # every attribute has templates in every split
        assert 8 <= len(templates) <= 12
        assert {data.prompt_split[t] for t in templates} == {"train", "val", "test"}
    assert len(data.wikipedia) >= 40 and all(e in data.entities for _, e, _ in data.wikipedia)


def test_wikipedia_entries_without_entity_are_skipped(tmp_path):
    for f in BUILTIN_RAVEL.glob("*city*.json"):
        shutil.copy(f, tmp_path / f.name)
    wiki = {
        "In %s it rained": {"split": "train", "entity": None},
        "Near %s a river": {"split": "val", "entity": "Lyon"},
        "By %s a hill": {"split": "val"},
    }
    (tmp_path / "wikipedia_city_entity_prompts.json").write_text(json.dumps(wiki))
    assert load_ravel(tmp_path, "city").wikipedia == [("Near %s a river", "Lyon", "val")]


def test_unknown_entity_type_lists_the_types():
    with pytest.raises(ValueError, match="'town'.*types present: city, physical_object"):
        load_ravel(None, "town")


def test_missing_file_is_named(tmp_path):
    for f in BUILTIN_RAVEL.glob("*city*.json"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "ravel_city_prompt_to_split.json").unlink()
    with pytest.raises(ValueError, match="lacks the file ravel_city_prompt_to_split.json"):
        load_ravel(tmp_path, "city")


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_ravel(tmp_path / "nowhere", "city")


def test_unknown_attribute_lists_the_attributes():
    with pytest.raises(ValueError, match="'Mayor'.*attributes: Country, Continent, Language"):
        RavelDataModule(target_attribute="Mayor")
    with pytest.raises(ValueError, match="attributes: Category, Color, Size, Texture"):
        load_ravel(None, "physical_object").values("Weight")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "random"}, "split='random'; choose one of entity, context"),
        ({"source": "news"}, "source='news'; choose one of attribute, wikipedia, mixed"),
        ({"padding_side": "middle"}, "padding_side='middle'"),
        ({"train_size": 0}, "train_size=0 must be a positive integer"),
        ({"max_candidates": -1}, "max_candidates=-1"),
        ({"cause_label": "source"}, "cause_label='source'"),
        ({"accuracy": "exact"}, "accuracy='exact'; choose one of three_tokens, first_token"),
        ({"average": "entities"}, "average='entities'; choose one of templates, examples"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RavelDataModule(**kwargs)


# -- value tokens --------------------------------------------------------------------------------


def test_value_separator():
    assert value_separator("%s is in the country of") == " "
    assert value_separator("city: %s, country:") == " "
    assert value_separator('{"city": "%s", "country": "') == ""
    assert value_separator("SF has a latitude of 37. %s has a latitude of ") == ""


def test_value_token_matches_the_tokenisation_in_context():
    """With gemma's tokenizer, the first token of the value after the prompt (prompt + value
    tokenised together) is the token we compare the model's answer with, for every template."""
    from lit_interventions.core.lm import load_tokenizer

    dm = RavelDataModule(entity_type="city")
    dm.tokenizer = load_tokenizer("gemma-3-270m")
    for entity_type, entity in (("city", "Paris"), ("physical_object", "banana")):
        data = load_ravel(None, entity_type)
        for attribute, templates in data.prompts.items():
            value = data.entities[entity][attribute]
            for template in templates:
                prompt = template.replace("%s", entity)
                prompt_ids = dm.tokenizer(prompt).input_ids
                joint = dm.tokenizer(prompt + value_separator(template) + value).input_ids
                assert joint[: len(prompt_ids)] == prompt_ids, template
                assert joint[len(prompt_ids)] == dm.value_tokens(template, value)[0], template


# -- examples ------------------------------------------------------------------------------------


def test_entity_split_keeps_entities_apart(module):
    dm = module(split="entity")
    names = dm.entity_names
    seen = {s: {names[e.base_entity] for e in ex} | {names[e.source_entity] for e in ex} for s, ex in dm.splits.items()}
    assert seen["train"].isdisjoint(seen["val"]) and seen["train"].isdisjoint(seen["test"])
    assert seen["val"].isdisjoint(seen["test"])
    for split, entities in seen.items():
        assert {dm.data.entity_split[e] for e in entities} == {split}


def test_context_split_keeps_templates_apart(module):
    dm = module(split="context")
    used = {s: {e.base_template for e in ex} | {e.source_template for e in ex} for s, ex in dm.splits.items()}
    assert used["train"].isdisjoint(used["val"]) and used["train"].isdisjoint(used["test"])
    assert used["val"].isdisjoint(used["test"])
    for split, templates in used.items():
        assert {dm.data.prompt_split[t] for t in templates} == {split}


def test_sizes_and_kinds(module):
    dm = module(multitask=False)
    assert {e.kind for e in dm.splits["train"]} == {CAUSE} and len(dm.splits["train"]) == 60
    for split in ("val", "test"):  # eval_size cause + as many iso, spread over the other attributes
        kinds = Counter((e.kind, e.attribute) for e in dm.splits[split])
        assert kinds == {(CAUSE, 0): 30, (ISO, 1): 15, (ISO, 2): 15}
    multi = module(multitask=True)
    assert Counter(e.kind for e in multi.splits["train"]) == {CAUSE: 60, ISO: 60}


def test_positions_point_at_the_last_entity_token(module):
    dm = module(source="mixed", padding_side="right")
    batch = next(iter(dm.val_dataloader()))
    names = dm.entity_names
    for i in range(len(batch)):
        for side, entity in (("base", names[batch.base.entity[i]]), ("source", names[batch.source.entity[i]])):
            ids = batch.side(side).input_ids[i]
            pos = batch.side(side).pos[i]
            up_to = dm.tokenizer.decode(ids[: pos + 1])
            assert up_to.endswith(entity), (up_to, entity)
            assert dm.tokenizer.decode(ids[pos]).strip() and entity.endswith(dm.tokenizer.decode(ids[pos]).strip()[-1])
            assert entity not in dm.tokenizer.decode(ids[:pos])  # the previous token does not end it


@pytest.mark.parametrize("accuracy", ["three_tokens", "first_token"])
def test_cause_and_iso_labels(module, accuracy):
    dm = module(source="attribute", accuracy=accuracy)
    names, target = dm.entity_names, dm.target_attribute
    assert dm.attributes[dm.target_index] == target == "Country"
    assert dm.n_tokens == {"three_tokens": 3, "first_token": 1}[accuracy]
    n_cause = n_iso = 0
    for e in dm.splits["val"]:
        queried = dm.attributes[e.attribute]
        base_answer = dm.value_tokens(e.base_template, dm.values(queried)[e.base_entity])
        source_answer = dm.value_tokens(e.base_template, dm.values(queried)[e.source_entity])
        assert e.answers[1] == base_answer and e.base_label == base_answer[0]
        assert source_answer != base_answer  # informative source
        assert dm.templates[e.group] == (queried, e.base_template)
        if e.kind == CAUSE:
            n_cause += 1
            assert queried == target
            assert e.answers[0] == source_answer and e.target == source_answer[0]  # y = A*(E')
        else:
            n_iso += 1
            assert queried != target
            assert e.answers[0] == base_answer and e.target == e.base_label  # y = A(E)
        assert names[e.base_entity] in e.base_template.replace("%s", names[e.base_entity])
    assert n_cause == n_iso == 30

    # Countries whose first tokens agree (" United Kingdom", " United States" with gemma's
    # tokenizer) but not their first 3 tokens: a Cause pair by the 3-token rule only.
    def first(e, entity):
        return _value_tokens(dm.tokenizer, value_separator(e.base_template) + dm.values(target)[entity], 1)

    cause = [e for s in dm.splits.values() for e in s if e.kind == CAUSE]
    shared = [e for e in cause if first(e, e.base_entity) == first(e, e.source_entity)]
    assert bool(shared) == (accuracy == "three_tokens")


def test_cause_labels_are_the_model_own_answer(tiny_lm_dir, tmp_path, monkeypatch):
    """Cause label = the tiny model's own answer for (base template, source entity), as the
    official pipeline's `inv_label`; `cause_label="gold"` keeps A*(E')."""
    real = RavelDataModule.predict_next
    wrong = lambda q: (len(q.entity) + len(q.template)) % 3 == 0  # noqa: E731  the model "errs" on a third of the pairs

    def predict_next(self, model, queries):  # gold where it knows, the real tiny model's 3 greedy tokens elsewhere
        # (one prompt at a time: the random model's near-tied logits must not depend on the batch)
        return [
            real(self, model, [q])[0]
            if wrong(q)
            else _padded(self, self.value_tokens(q.template, self.data.entities[q.entity][q.attribute]))
            for q in queries
        ]

    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path))  # answers cached by this test only
    monkeypatch.setattr(RavelDataModule, "predict_next", predict_next)
    dm = RavelDataModule(lm=tiny_lm_dir("gemma3"), train_size=60, eval_size=30, max_candidates=60)
    dm.setup()
    from lit_interventions.core.lm import load_lm

    model = load_lm(dm.lm)
    names, changed, n_cause = dm.entity_names, 0, 0
    for split in dm.splits.values():
        for e in split:
            if e.kind != CAUSE:
                assert e.answers[0] == e.answers[1]
                continue
            n_cause += 1
            query = dm.encode(names[e.source_entity], e.base_template, dm.target_attribute)
            generated = predict_next(dm, model, [query])[0]
            values = {dm.value_tokens(e.base_template, v) for v in dm.values(dm.target_attribute)}
            named = [v for v in values if tuple(generated[: len(v)]) == v]  # the value it names, if any
            assert e.answers[0] == (max(named, key=len) if named else tuple(generated))  # the model's own answer
            assert e.target == e.answers[0][0] and e.answers[0] != e.answers[1]  # the answer changes
            gold = dm.value_tokens(e.base_template, dm.values(dm.target_attribute)[e.source_entity])
            changed += e.answers[0] != gold
    assert n_cause == 60 + 30 + 30 and changed > 0  # some labels differ from the gold value
    gold = RavelDataModule(**{**dm.hparams, "cause_label": "gold"})
    gold.setup()
    for e in (e for split in gold.splits.values() for e in split if e.kind == CAUSE):
        assert e.answers[0] == gold.value_tokens(e.base_template, gold.values("Country")[e.source_entity])


def test_wikipedia_sources(module):
    dm = module(source="wikipedia")
    wiki_prompts = {p for p, _, _ in dm.data.wikipedia}
    assert all(e.source_template in wiki_prompts for s in dm.splits.values() for e in s)


def test_left_and_right_padding_agree(module):
    right = next(iter(module(padding_side="right").val_dataloader()))
    left = next(iter(module(padding_side="left").val_dataloader()))
    assert (left.base.input_ids != right.base.input_ids).any()  # the padding did move
    for side in ("base", "source"):
        lt, r = left.side(side), right.side(side)
        for key in ("pos", "last"):
            got = lt.input_ids.gather(1, getattr(lt, key)[:, None])
            want = r.input_ids.gather(1, getattr(r, key)[:, None])
            assert (got == want).all()
        assert lt.keys[0] == r.keys[0]
        assert all(s == 0 for s in r.keys[1]) and any(s > 0 for s in lt.keys[1])
        assert (lt.entity == r.entity).all()
    assert (left.base.label == right.base.label).all() and left.source.label is right.source.label is None
    for key in ("target", "attribute", "kind"):
        assert (getattr(left, key) == getattr(right, key)).all()


def test_seed_decides_the_examples(module):
    ex = lambda dm: [(e.base_ids, e.source_ids) for e in dm.splits["train"]]  # noqa: E731
    assert ex(module(seed=3)) == ex(module(seed=3)) != ex(module(seed=4))


def test_answers_are_cached_per_model(module, monkeypatch):
    first = module(known={e for e in load_ravel(None, "city").entities if e < "H"})
    kept = dict(first.kept)

    def must_not_run(self, model, queries):
        raise AssertionError("the cached answers should have been used")

    second = RavelDataModule(**{k: v for k, v in first.hparams.items()})
    monkeypatch.setattr(RavelDataModule, "predict_next", must_not_run)
    second.setup()
    assert second.kept == kept and [e.base_ids for e in second.splits["val"]] == [
        e.base_ids for e in first.splits["val"]
    ]


def test_filter_keeps_only_correct_answers(module):
    data = load_ravel(None, "city")
    known = {e for e in data.entities if e < "M"}
    dm = module(known=known)
    names = dm.entity_names
    assert all(names[e.base_entity] in known for s in dm.splits.values() for e in s)
    assert all(names[e.source_entity] in known for s in dm.splits.values() for e in s)  # sources are kept prompts
    assert set(dm.kept) == {"train", "val", "test"} and set(dm.kept["val"]) == {"Country", "Continent", "Language"}
    assert all(0 < dm.kept[s][a] < dm.checked[s][a] for s in dm.kept for a in dm.kept[s])


def test_no_correct_answer_is_an_error(module):
    with pytest.raises(ValueError, match=r"all 60 candidate .* dropped because the model .* answers them wrongly"):
        module(known=set())


def test_no_informative_source_is_an_error(module):
    # Only US cities are known: every source shares the base's country (" United") and continent.
    data = load_ravel(None, "city")
    us = {e for e, v in data.entities.items() if v["Country"] == "United States"}
    with pytest.raises(ValueError, match="no informative source"):
        module(known=us)


# -- real model ----------------------------------------------------------------------------------


def _check_kept_share(dm, minimum):
    for split, counts in dm.kept.items():
        for attribute, n in counts.items():
            assert n >= minimum * dm.checked[split][attribute], (split, attribute, n)


@pytest.mark.slow
def test_gemma_knows_many_builtin_cities():
    from lit_interventions.core.lm import load_lm

    dm = RavelDataModule(entity_type="city", max_candidates=24, train_size=20, eval_size=10)
    dm.setup()
    _check_kept_share(dm, 0.2)
    # What it keeps it really answers: re-run a kept Cause base.
    e = dm.splits["val"][0]
    model = load_lm(dm.lm)
    query = dm.encode(dm.entity_names[e.base_entity], e.base_template, "Country")
    assert answer_hit(dm.predict_next(model, [query])[0], e.answers[1])


@pytest.mark.slow
@pytest.mark.skipif(
    not SHARED_RAVEL.is_dir(),
    reason="published RAVEL files absent; get them: lit-interventions data ravel --out ../shared/data/ravel",
)
def test_gemma_on_published_city_files():
    dm = RavelDataModule(
        ravel_dir=str(SHARED_RAVEL), entity_type="city", max_candidates=24, train_size=20, eval_size=10
    )
    dm.setup()
    assert dm.attributes == ["Country", "Continent", "Latitude", "Longitude", "Language", "Timezone"]
    assert sum(dm.kept["train"].values()) > 0
    assert Counter(e.kind for e in dm.splits["test"]) == {CAUSE: 10, ISO: 10}
