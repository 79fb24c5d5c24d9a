"""CausalGym templates and DataModule: sampling, splits, positions, labels, padding, errors."""

import json

import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule, label_token_ids
from lit_interventions.datamodules.templates import load_task, load_templates, parse_task, sample_pairs, split_regions

from lit_interventions.core.batch import collate_pairs

PAPER_TASKS = """agr_gender agr_sv_num_subj-relc agr_sv_num_obj-relc agr_sv_num_pp agr_refl_num_subj-relc
agr_refl_num_obj-relc agr_refl_num_pp npi_any_subj-relc npi_any_obj-relc npi_ever_subj-relc npi_ever_obj-relc
garden_mvrr garden_mvrr_mod garden_npz_obj garden_npz_obj_mod garden_npz_v-trans garden_npz_v-trans_mod gss_subord
gss_subord_subj-relc gss_subord_obj-relc gss_subord_pp cleft cleft_mod filler_gap_embed_3 filler_gap_embed_4
filler_gap_hierarchy filler_gap_obj filler_gap_pp filler_gap_subj""".split()

# A small file in the published schema, with the features our loader must handle: two label
# variables, label words that begin with a space, an empty option, several templates.
PUBLISHED_STYLE = {
    "toy": {
        "templates": ["{det} {noun}{comma} {verb} the {obj}", "{det} {noun} {verb} the {obj}"],
        "label": ["det", "noun"],
        "labels": {"sg": [" was"], "pl": [" were", " are"]},
        "variables": {
            "det": {"sg": ["This"], "pl": ["These"]},
            "noun": {"sg": ["dog", "cat"], "pl": ["dogs", "cats"]},
            "comma": [",", ""],
            "verb": ["saw", "liked", "found"],
            "obj": ["tree", "car", "ball", "house", "road"],
        },
        "result_prepend_space": False,
    }
}


@pytest.fixture
def toy_file(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(PUBLISHED_STYLE))
    return path


def test_builtin_file_has_the_paper_tasks():
    assert sorted(load_templates()) == sorted(PAPER_TASKS)


@pytest.mark.parametrize("task", PAPER_TASKS)
def test_every_builtin_task_yields_the_paper_sizes(task):
    data = CausalGymDataModule(task=task)  # samples 200/50/50 pairs, before any model is loaded
    assert [len(data.pairs[s]) for s in ("train", "eval", "dev")] == [400, 100, 100]


def test_swapping_doubles_the_data():
    task = load_task("agr_sv_num_pp")
    pairs = sample_pairs(task, 30, seed=3)
    assert len(pairs) == 60
    first, swapped = pairs[:30], pairs[30:]
    for pair, other in zip(first, swapped):
        assert (other.base.text, other.source.text) == (pair.source.text, pair.base.text)
        assert (other.base.label, other.source.label) == (pair.source.label, pair.base.label)
        assert pair.base_type != pair.source_type


def test_train_does_not_overlap_eval_or_dev():
    data = CausalGymDataModule(task="agr_gender")
    train = {p.base.text for p in data.pairs["train"]}
    for split in ("eval", "dev"):
        assert train.isdisjoint({p.base.text for p in data.pairs[split]})
        assert train.isdisjoint({p.source.text for p in data.pairs[split]})
    assert [p.base.text for p in data.pairs["eval"]] != [p.base.text for p in data.pairs["dev"]]


def test_seed_controls_sampling():
    a, b = CausalGymDataModule(task="agr_gender", seed=5), CausalGymDataModule(task="agr_gender", seed=5)
    c = CausalGymDataModule(task="agr_gender", seed=6)
    texts = lambda d: [p.base.text for p in d.pairs["train"]]  # noqa: E731
    assert texts(a) == texts(b) != texts(c)


def test_regions_of_a_template():
    regions = [r.name for r in split_regions("The {subject} that {verb} the {object}")]
    assert regions == ["The", "subject", "that", "verb", "the", "object"]


def _datamodule(tiny_lm_dir, **kwargs):
    data = CausalGymDataModule(lm=tiny_lm_dir("llama"), **{"train_pairs": 20, "eval_pairs": 5, **kwargs})
    data.setup("fit")
    return data


def test_positions_are_the_last_token_of_each_region(tiny_lm_dir, tokenizer):
    data = _datamodule(tiny_lm_dir, task="agr_sv_num_pp")
    task = data.template
    for pair, example in zip(data.pairs["train"], data.splits["train"]):
        for sentence, ids, positions in (
            (pair.base, example.base_ids, example.base_positions),
            (pair.source, example.source_ids, example.source_positions),
        ):
            assert set(positions) == set(sentence.spans)
            for region, pos in positions.items():
                start, end = sentence.spans[region]
                upto = tokenizer.decode(ids[: pos + 1], skip_special_tokens=True)
                assert upto.rstrip().endswith(sentence.text[start:end]), (region, upto)
                before = tokenizer.decode(ids[:pos], skip_special_tokens=True)
                assert len(before.rstrip()) < end  # pos is the token that ends the region
    assert task.label_region == data.region


def test_padding_side_keeps_positions_on_the_same_tokens(tiny_lm_dir):
    examples = _datamodule(tiny_lm_dir, task="agr_sv_num_pp").splits["train"][:6]
    right = collate_pairs(examples, "subject", pad_id=0, padding_side="right")
    left = collate_pairs(examples, "subject", pad_id=0, padding_side="left")
    rows = torch.arange(6)
    for side in ("base", "source"):
        r, lt = right.side(side), left.side(side)
        for key in ("pos", "last"):
            assert torch.equal(r.input_ids[rows, getattr(r, key)], lt.input_ids[rows, getattr(lt, key)])
        for region in r.regions:
            assert torch.equal(r.input_ids[rows, r.regions[region]], lt.input_ids[rows, lt.regions[region]])
        assert (lt.input_ids[:, -1] != 0).all() and (lt.attention_mask[:, -1] == 1).all()
        assert r.types == [getattr(e, f"{side}_type") for e in examples] == lt.types
    assert [e.base_label for e in examples] == right.base.label.tolist()
    assert [e.source_label for e in examples] == right.target.tolist()  # Cause pairs: the source's answer


def test_published_schema_features(tiny_lm_dir, tokenizer, toy_file):
    with pytest.warns(UserWarning, match="region 'comma' is empty"):
        data = _datamodule(tiny_lm_dir, task="toy", templates=str(toy_file), region="comma", train_pairs=10)
    assert data.template.regions == ["det", "noun", "comma", "verb", "the", "obj"]
    assert all(e.base_text.count(",") == 1 for e in data.splits["train"])  # pairs without a comma are skipped
    ids = label_token_ids(data.template, tokenizer)
    assert ids["sg"][" was"] == tokenizer(" was", add_special_tokens=False).input_ids[0]  # used verbatim
    for pair in data.pairs["train"]:
        assert pair.base.text.split()[0] == ("This" if pair.base_type == "sg" else "These")
        assert pair.base.text.split()[1].rstrip(",") in PUBLISHED_STYLE["toy"]["variables"]["noun"][pair.base_type]


def test_multi_token_label_uses_first_token(tokenizer):
    task = parse_task(
        "t", {**PUBLISHED_STYLE["toy"], "labels": {"sg": ["zzqx"], "pl": [" were"]}, "result_prepend_space": False}
    )
    assert len(tokenizer("zzqx", add_special_tokens=False).input_ids) > 1
    assert label_token_ids(task, tokenizer)["sg"]["zzqx"] == tokenizer("zzqx", add_special_tokens=False).input_ids[0]


def test_labels_sharing_a_first_token_are_an_error(tokenizer):
    task = parse_task("clash", {**PUBLISHED_STYLE["toy"], "labels": {"sg": [" was"], "pl": [" was"]}})
    with pytest.raises(ValueError, match=r"clash.*' was'.*' was'"):
        label_token_ids(task, tokenizer)


def test_control_task_maps_labels_to_dog_and_give(tiny_lm_dir, tokenizer):
    data = _datamodule(tiny_lm_dir, task="agr_gender", control="dog_give")
    dog, give = (tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" dog", " give"))
    types = data.template.types
    for pair, example in zip(data.pairs["train"], data.splits["train"]):
        assert example.base_label == (dog if pair.base_type == types[0] else give)
        assert example.source_label == (dog if pair.source_type == types[0] else give)


def test_unknown_task_lists_the_tasks():
    with pytest.raises(ValueError, match=r"Unknown task 'agr_nope'.*agr_gender.*filler_gap_subj"):
        CausalGymDataModule(task="agr_nope")


def test_unknown_region_lists_the_regions():
    with pytest.raises(ValueError, match=r"Unknown region 'verb'.*regions: The, subject"):
        CausalGymDataModule(task="agr_sv_num_pp", region="verb")


def test_missing_template_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CausalGymDataModule(task="toy", templates=str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    "broken,key",
    [
        ({k: v for k, v in PUBLISHED_STYLE["toy"].items() if k != "labels"}, "labels"),
        ({**PUBLISHED_STYLE["toy"], "templates": ["{det} {missing}"]}, "templates"),
        ({**PUBLISHED_STYLE["toy"], "labels": {"sg": ["was"]}}, "labels"),
        (
            {**PUBLISHED_STYLE["toy"], "variables": {**PUBLISHED_STYLE["toy"]["variables"], "det": ["The"]}},
            "variables.det",
        ),
    ],
)
def test_malformed_template_names_file_and_key(tmp_path, broken, key):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({"toy": broken}))
    with pytest.raises(ValueError, match=rf"broken.json.*'toy'.*'{key}'"):
        CausalGymDataModule(task="toy", templates=str(path))


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        CausalGymDataModule(task="toy", templates=str(path))


def test_empty_option_leaves_no_double_space():
    task = load_task("garden_mvrr")
    pairs = sample_pairs(task, 40, seed=0)
    reduced = [p.base for p in pairs if p.base_type == "reduced"]
    assert reduced and all("  " not in s.text and "rc" not in s.spans for s in reduced)
    assert all("rc" in p.base.spans for p in pairs if p.base_type == "unreduced")


@pytest.mark.parametrize("task,region", [("garden_mvrr", "noun"), ("garden_npz_obj", "verb"), ("agr_gender", "name")])
def test_default_region_always_has_a_position(tiny_lm_dir, task, region):
    data = _datamodule(tiny_lm_dir, task=task)
    assert data.region == region
    assert len(data.splits["train"]) == 40  # no pair skipped
