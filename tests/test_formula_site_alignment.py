"""CausalGym's site alignment, end to end: which token of each side an interchange reads and
writes, under `positions: own` (the paper's text) and `positions: official` (the official code).

The official rule (aryamanarora/causalgym): `Pair.tokenize` aligns each template span to its
tokens on each side, `Batch.compute_pos("last")` takes each span's last token and returns
[source positions, base positions]; `train.py` / `eval.py` pass `{"sources->base": ([None,
pos_interv[1]], pos_interv)}` to pyvene with `sources=[None, batch.src]`, so the interchange
reads f(s) at the base's index p_b(r) and writes it into the base at p_b(r). Ours under
`official` reads the source at min(p_b(r), n_s − 1) (the official code reads a padding token's
state past the source's end; ours, the source's last token: docs/differences.md). Under `own`,
f(s) is read at p_s(r), the last token of the source's own region.

Planted pair: the plural subject "old authors" is one token longer than "author", so every
region from the subject on sits one token later on the plural side. The test writes the
positions by hand, then recomputes the vanilla interchange (f* = f(s), the full swap) with its
own hooks on the decoder block, and compares it with `InterchangeModule.intervened_logits`."""

import json

import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule

from lit_interventions.interventions.registry import method_spec
from lit_interventions.modules.interchange import InterchangeModule

LAYER = 1
OBJECTS = ["house", "car", "ball", "book", "door", "table", "window", "city"]
# By hand, BOS at index 0 (each word one token of the tiny tokenizer, checked below):
#   sg  <bos> The author     saw the X   -> subject 2, "saw the" 4, object 5; 6 tokens
#   pl  <bos> The old authors saw the X  -> subject 3, "saw the" 5, object 6; 7 tokens
LAST = {"sg": {"subject": 2, "saw the": 4, "object": 5}, "pl": {"subject": 3, "saw the": 5, "object": 6}}
LENGTH = {"sg": 6, "pl": 7}
# (base type, source type, region) -> (base position written, source position read), by hand
HAND = {
    "own": {
        ("sg", "pl", "object"): (5, 6),
        ("pl", "sg", "object"): (6, 5),
        ("sg", "pl", "saw the"): (4, 5),
        ("pl", "sg", "saw the"): (5, 4),
    },
    "official": {  # the source at the base's index; past the source's end, its last token
        ("sg", "pl", "object"): (5, 5),  # the pl source's "the", not its object
        ("pl", "sg", "object"): (6, 5),  # index 6 is past the sg source's end (6 tokens): its last
        ("sg", "pl", "saw the"): (4, 4),  # the pl source's "saw"
        ("pl", "sg", "saw the"): (5, 5),  # the sg source's object
    },
}


@pytest.fixture
def planted(tmp_path):
    path = tmp_path / "planted.json"
    task = {
        "templates": ["The {subject} saw the {object}"],
        "label": "subject",
        "labels": {"sg": [" was"], "pl": [" were"]},
        "variables": {"subject": {"sg": ["author"], "pl": ["old authors"]}, "object": OBJECTS},
        "result_prepend_space": False,
    }
    path.write_text(json.dumps({"planted": task}))
    return str(path)


def test_the_hand_positions_match_the_tokenizer(tokenizer):
    assert tokenizer.tokenize("<bos>The author saw the house") == ["<bos>", "The", "Ġauthor", "Ġsaw", "Ġthe", "Ġhouse"]
    assert tokenizer.tokenize("<bos>The old authors saw the house") == [
        "<bos>", "The", "Ġold", "Ġauthors", "Ġsaw", "Ġthe", "Ġhouse",
    ]  # fmt: skip
    assert all(len(tokenizer.tokenize(" " + word)) == 1 for word in OBJECTS)


def _block_output(output):
    return output[0] if isinstance(output, tuple) else output


def _states_at(model, ids: list[int], layer: int) -> torch.Tensor:
    """The residual stream after decoder block `layer`, (seq, d), of one unpadded sentence."""
    seen = {}
    handle = model.model.layers[layer].register_forward_hook(lambda m, i, o: seen.setdefault("h", _block_output(o)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["h"][0]


def _swapped_logits(model, base_ids: list[int], at: int, state: torch.Tensor, layer: int) -> torch.Tensor:
    """The base's next-token logits at its last token, its state after block `layer` at `at`
    replaced by `state`: the vanilla interchange written out with a hook of this test's own."""

    def write(module, inputs, output):
        hidden = _block_output(output).clone()
        hidden[0, at] = state
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[layer].register_forward_hook(write)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([base_ids])).logits[0, -1]
    finally:
        handle.remove()


@pytest.mark.parametrize("positions", ["own", "official"])
@pytest.mark.parametrize("region", ["object", "saw the"])
def test_each_side_is_read_and_written_where_the_rule_says(tiny_lm_dir, planted, positions, region):
    lm = tiny_lm_dir("llama")
    data = CausalGymDataModule(
        task="planted", templates=planted, lm=lm, region=region, positions=positions, train_pairs=4, eval_pairs=2
    )
    data.setup("fit")
    batch = next(iter(data.loader("train", 64)))  # right padded: indices as in the sentences
    types = list(zip(batch.base.types, batch.source.types))
    assert set(types) == {("sg", "pl"), ("pl", "sg")}  # the base longer and the source longer both occur
    expected = [HAND[positions][(b, s, region)] for b, s in types]
    assert batch.base.pos.tolist() == [b for b, _ in expected]  # written into the base at p_b(r) either way
    assert batch.source.pos.tolist() == [s for _, s in expected]
    assert batch.base.pos.tolist() == [LAST[b][region] for b, _ in types]

    module = InterchangeModule(
        lm=lm, layer=LAYER, region=region, intervention=lambda d: method_spec("vanilla").build(d, 0), cache=False
    )
    module.eval()
    with torch.no_grad():
        got = module.intervened_logits(batch)
    model = module.lm
    for row, (base_type, source_type) in enumerate(types):
        base_ids = batch.base.input_ids[row, : LENGTH[base_type]].tolist()
        source_ids = batch.source.input_ids[row, : LENGTH[source_type]].tolist()
        write_at, read_at = expected[row]
        state = _states_at(model, source_ids, LAYER)[read_at]
        by_hand = _swapped_logits(model, base_ids, write_at, state, LAYER)
        torch.testing.assert_close(got[row], by_hand, atol=1e-5, rtol=1e-5)
        # the rules differ on this row: the other rule's source token gives other logits
        other = HAND["own" if positions == "official" else "official"][(base_type, source_type, region)][1]
        if other != read_at:
            moved = _swapped_logits(model, base_ids, write_at, _states_at(model, source_ids, LAYER)[other], LAYER)
            assert not torch.allclose(got[row], moved, atol=1e-4)
