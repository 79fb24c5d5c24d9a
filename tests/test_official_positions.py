"""`positions`: CausalGym's per-side rule (`own`) and the official code's indexing (`official`,
the source read at the base's token index, the closed-form fit on base states at the source's),
in the data module, in what closed-form methods are fitted on, and through the sweep."""

import csv
import json

import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule

from lit_interventions.core.forward import read_site
from lit_interventions.modules.interchange import InterchangeModule, fit_states
from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies.causalgym_tasks import sweep_tasks

OBJECTS = ["house", "car", "ball", "book", "door", "table", "window", "city"]  # one token each (checked below)


def _template(subject_pl: str) -> dict:
    """One task: "The {subject} saw the {object}", singular subject "author", plural `subject_pl`."""
    return {
        "planted": {
            "templates": ["The {subject} saw the {object}"],
            "label": "subject",
            "labels": {"sg": [" was"], "pl": [" were"]},
            "variables": {"subject": {"sg": ["author"], "pl": [subject_pl]}, "object": OBJECTS},
            "result_prepend_space": False,
        }
    }


@pytest.fixture
def unequal(tmp_path):
    """The plural subject is one token longer: every region from `subject` on ends one token later."""
    path = tmp_path / "unequal.json"
    path.write_text(json.dumps(_template("old authors")))
    return str(path)


@pytest.fixture
def equal(tmp_path):
    path = tmp_path / "equal.json"
    path.write_text(json.dumps(_template("authors")))
    return str(path)


def _data(lm, templates, positions, region="object", **kwargs):
    options = {"train_pairs": 4, "eval_pairs": 2, "batch_size": 4, **kwargs}
    data = CausalGymDataModule(
        task="planted", templates=templates, lm=lm, region=region, positions=positions, **options
    )
    data.setup("fit")
    return data


def _batch(data, split="train"):
    """The whole split in one batch, in the split's order."""
    return next(iter(data.loader(split, 64)))


# By hand, with BOS at index 0 (the tokenizer check below pins each word to one token):
#   sg  <bos> The author      saw the X   -> The 1, subject 2, saw the 4, object 5; 6 tokens
#   pl  <bos> The old authors saw the X   -> The 1, subject 3, saw the 5, object 6; 7 tokens
OWN = {
    "sg": {"The": 1, "subject": 2, "saw the": 4, "object": 5},
    "pl": {"The": 1, "subject": 3, "saw the": 5, "object": 6},
}
LENGTH = {"sg": 6, "pl": 7}


def _official(base_type: str, source_type: str, region: str) -> int:
    """The official rule: the source read at the base's index, p_s = min(p_b, n_s - 1) (past the
    source's end: its last token)."""
    return min(OWN[base_type][region], LENGTH[source_type] - 1)


def test_the_hand_computation_matches_the_tokenizer(tokenizer):
    assert all(len(tokenizer.tokenize(" " + word)) == 1 for word in OBJECTS + ["author", "authors", "old"])
    assert tokenizer.tokenize("<bos>The old authors saw the house") == [
        "<bos>", "The", "Ġold", "Ġauthors", "Ġsaw", "Ġthe", "Ġhouse",
    ]  # fmt: skip


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_own_reads_each_side_at_its_region_official_at_the_base_index(tiny_lm_dir, unequal, padding_side):
    lm = tiny_lm_dir("llama")
    own = _batch(_data(lm, unequal, "own", padding_side=padding_side))
    official = _batch(_data(lm, unequal, "official", padding_side=padding_side))
    types = list(zip(own.base.types, own.source.types))
    assert set(types) == {("sg", "pl"), ("pl", "sg")}  # both orders: the base longer and the source longer
    assert own.base.same_inputs(official.base)  # the base side is the same either way
    assert torch.equal(own.source.input_ids, official.source.input_ids)
    shift = {"right": 0, "left": 1}[padding_side]  # the sg sentence is one token short of the batch's width
    for region in ("The", "subject", "saw the", "object"):
        expect_own = [OWN[s][region] + (shift if s == "sg" else 0) for _, s in types]
        expect_official = [_official(b, s, region) + (shift if s == "sg" else 0) for b, s in types]
        assert own.source.regions[region].tolist() == expect_own
        assert official.source.regions[region].tolist() == expect_official
    assert own.source.pos.tolist() == [OWN[s]["object"] + (shift if s == "sg" else 0) for _, s in types]
    # base pl (object at 6) reads the sg source at its last token 5; base sg (object at 5) reads the pl source at 5
    assert official.source.pos.tolist() == [5 + (shift if s == "sg" else 0) for _, s in types]
    assert official.source.pos.tolist() != own.source.pos.tolist()


def test_equal_lengths_give_identical_batches_both_ways(tiny_lm_dir, equal):
    lm = tiny_lm_dir("llama")
    for split in ("train", "dev", "eval"):
        own, official = _batch(_data(lm, equal, "own"), split), _batch(_data(lm, equal, "official"), split)
        assert own.base.same_inputs(official.base) and own.source.same_inputs(official.source)
        assert torch.equal(own.target, official.target) and torch.equal(own.kind, official.kind)
        assert torch.equal(own.source.pos, official.source.pos)


def test_official_fit_states_are_base_states_at_the_source_index(tiny_lm_dir, unequal):
    """The official code collects, for each train pair, the base's state at the source's index
    (clamped to the base's end), classed by the base's type: computed here directly from the
    `own` batch, and compared, as a multiset, with what `fit_states` reads under `official`."""
    lm = tiny_lm_dir("llama")
    module = InterchangeModule(lm=lm, layer=1, region="object")
    own_data, official_data = _data(lm, unequal, "own"), _data(lm, unequal, "official")
    batch = _batch(own_data)
    at = torch.minimum(batch.source.pos, batch.base.last)  # the source's own index, on the base
    expected = read_site(module.lm, 1, batch.base.input_ids, batch.base.attention_mask, at).float()
    expected_labels = list(batch.base.types)
    states, labels = fit_states(module, official_data)
    assert states.shape == expected.shape
    unused = list(range(len(expected)))  # each fitted row matched to its own expected row (rows repeat)
    for state, label in zip(states, labels):
        found = [i for i in unused if expected_labels[i] == label and torch.allclose(expected[i], state, atol=1e-5)]
        assert found, f"a fitted {label} state that is no base state at its source's index"
        unused.remove(found[0])
    assert not unused
    # `own` fits on each base at its own index: other states at the rows whose lengths differ
    own_states, _ = fit_states(module, own_data)
    assert not torch.allclose(own_states, states, atol=1e-3)


def test_a_bad_value_is_one_line_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"^positions='pyvene'; choose 'own' .* or 'official' "):
        CausalGymDataModule(task="agr_sv_num_pp", lm=str(tmp_path / "no-such-lm"), positions="pyvene")
    with pytest.raises(ValueError, match=r"^positions='base'; choose 'own'"):
        sweep.run_sweep(methods=["diffmean"], lm=str(tmp_path / "no-such-lm"), positions="base", out=str(tmp_path))
    with pytest.raises(ValueError, match=r"positions='official' with pairs=.*leave --positions own"):
        sweep_tasks(None, None, "pairs.jsonl", False, "gemma-3-270m", {"seed": 0}, "official")


def test_the_sweep_builds_its_data_at_the_positions_asked(tiny_lm_dir, unequal):
    lm, sizes = tiny_lm_dir("llama"), {"train_pairs": 4, "eval_pairs": 2, "seed": 0}
    found, meta = sweep_tasks("planted", unequal, None, False, lm, sizes, "official")
    data = found["planted"].data("object")
    assert data.hparams.positions == "official" and data.FIT_SIDES == ("source",)
    assert torch.equal(_batch(data).source.pos, _batch(_data(lm, unequal, "official")).source.pos)
    assert meta["positions"] == "official"
    found, meta = sweep_tasks("planted", unequal, None, False, lm, sizes)
    assert found["planted"].data("object").hparams.positions == "own" and "positions" not in meta
    control = sweep_tasks("planted", unequal, None, True, lm, sizes, "official")[0]["planted"].data(
        "object", "dog_give"
    )
    assert control.hparams.positions == "official" and control.hparams.control == "dog_give"


def _odds(out) -> dict:
    with (out / "results.csv").open() as f:
        return {(r["method"], r["region"]): float(r["odds"]) for r in csv.DictReader(f)}


def test_a_sweep_run_both_ways_and_a_resume_at_the_other_setting_is_refused(tmp_path, tiny_lm_dir, unequal, capsys):
    lm = tiny_lm_dir("llama")
    common = [
        "--config", "configs/sweep_causalgym.yaml", f"--lm={lm}", f"--templates={unequal}", "--tasks=[planted]",
        "--methods=[diffmean, vanilla]", "--layers=[1]", "--train_pairs=4", "--eval_pairs=2",
    ]  # fmt: skip
    sweep.main([*common, f"--out={tmp_path / 'own'}"])
    sweep.main([*common, f"--out={tmp_path / 'official'}", "--positions=official"])
    own, official = _odds(tmp_path / "own"), _odds(tmp_path / "official")
    assert json.loads((tmp_path / "official" / "meta.json").read_text())["positions"] == "official"
    assert "positions" not in json.loads((tmp_path / "own" / "meta.json").read_text())
    for method in ("diffmean", "vanilla"):
        assert own[(method, "The")] == official[(method, "The")]  # the same token on both sides
        assert own[(method, "object")] != official[(method, "object")]
    with pytest.raises(SystemExit):
        sweep.main([*common, f"--out={tmp_path / 'own'}", "--positions=official"])
    assert 'holds a sweep with --positions="own", this run has --positions="official"' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main([*common, f"--out={tmp_path / 'official'}"])
    assert 'holds a sweep with --positions="official", this run has --positions="own"' in capsys.readouterr().err
