"""Template sampling: the dotted parts of one head variable (`vp.verb`, `vp.prep`) are drawn at
one shared index, as CausalGym's sampler draws them; checked on a planted template and on every
task of the published template file against a hand-written reference of the sampling rule."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from lit_interventions.datamodules.templates import load_templates, parse_task, sample_pairs

from tests.helpers import ROOT

# Each index i of the head variable `vp` carries the marker i in every part, so a pair whose parts
# come from different indices shows two different markers.
N_ROWS = 6
PLANTED = {
    "templates": ["{subj} {vp.verb} {adv} {vp.prep} the {vp.place} and"],
    "label": "subj",
    "labels": {"sg": ["is"], "pl": ["are"]},
    "variables": {
        "subj": {"sg": ["The dog", "A cat"], "pl": ["The dogs"]},
        "vp.verb": [f"ran{i}" for i in range(N_ROWS)],
        "adv": ["fast", "slowly", "twice"],
        "vp.prep": [f"into{i}" for i in range(N_ROWS)],
        "vp.place": [f"barn{i}" for i in range(N_ROWS)],
    },
}
ENV = "LIT_INTERVENTIONS_CAUSALGYM_TEMPLATES"
FETCHED = ROOT / "data" / "causalgym" / "templates.json"  # `lit-interventions data causalgym --out data/causalgym`
_SLOT = re.compile(r"\{([^{}]+)\}")


def _markers(text: str) -> set[str]:
    return set(re.findall(r"(?:ran|into|barn)(\d)", text))


@pytest.mark.parametrize("same_type", [False, True])
def test_parts_of_one_head_variable_keep_one_index(same_type):
    pairs = sample_pairs(parse_task("planted", PLANTED), 30, seed=0, same_type=same_type)
    for pair in pairs:
        base, source = _markers(pair.base.text), _markers(pair.source.text)
        assert len(base) == 1 and len(source) == 1, (pair.base.text, pair.source.text)
        if not same_type:  # a Cause pair shares the index; an Iso pair draws one per sentence
            assert base == source
    assert {m for p in pairs for m in _markers(p.base.text)} == {str(i) for i in range(N_ROWS)}
    if same_type:
        assert any(_markers(p.base.text) != _markers(p.source.text) for p in pairs)


def test_distinct_pairs_count_a_head_variable_once_per_index():
    task = parse_task("planted", PLANTED)
    # Cause: subj (sg 2 x pl 1) x adv 3 x vp 6 rows, per ordered pair of types, halved for the swap.
    assert task.distinct_pairs() == 2 * 1 * 3 * N_ROWS
    # Iso: sg-sg (2 x 2) and pl-pl (1 x 1), adv 3 x 3, vp 6 x 6, halved.
    assert task.distinct_pairs(same_type=True) == (4 + 1) * 9 * N_ROWS**2 // 2
    assert len(sample_pairs(task, 36, seed=1)) == 72  # every distinct pair can be drawn
    with pytest.raises(ValueError, match="has only 36 distinct pairs"):
        sample_pairs(task, 37, seed=1)


def test_repeated_rows_of_a_head_variable_count_once():
    spec = json.loads(json.dumps(PLANTED))
    for part in ("vp.verb", "vp.prep", "vp.place"):
        spec["variables"][part][1] = spec["variables"][part][0]  # rows 0 and 1 identical
    assert parse_task("planted", spec).distinct_pairs() == 2 * 1 * 3 * (N_ROWS - 1)


def test_parts_of_unequal_length_are_refused():
    spec = json.loads(json.dumps(PLANTED))
    spec["variables"]["vp.place"] = spec["variables"]["vp.place"][:4]
    with pytest.raises(ValueError, match=r"'planted'.*'variables.vp.place'.*4 options.*'vp.verb'.*'vp'.*has 6"):
        parse_task("planted", spec)


# ------------------------------------------------------------------ the published template file


def _published() -> Path:
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else FETCHED
    if not path.is_file():
        pytest.skip(
            f"CausalGym's template file is not here ({path}): run `lit-interventions data causalgym "
            f"--out data/causalgym` or set {ENV} to the file"
        )
    return path


def _pieces(template: str) -> list[tuple[str, str | None]]:
    """(text, None) for literal text, (name, name) for a `{name}` slot, in order."""
    pieces, at = [], 0
    for match in _SLOT.finditer(template):
        pieces += [(template[at : match.start()], None), (match.group(1), match.group(1))]
        at = match.end()
    return [*pieces, (template[at:], None)]


def reference_allows(spec: dict, texts: tuple[str, str], types: tuple[str, str]) -> bool:
    """The reference rule, as a recogniser: can it write the (base, source) texts for these types?

    It fills each slot of a template in place: a label variable with any option of the sentence's
    own type; a dotted `head.part` with the part's option at the one index chosen for `head`,
    the same in both sentences; any other variable with one option both sentences share."""
    label_vars = spec["label"] if isinstance(spec["label"], list) else [spec["label"]]

    def options_at(var: str, heads: dict[str, int], at: tuple[int, int]):
        options = spec["variables"][var]
        if var in label_vars:
            for a in {o for o in options[types[0]] if texts[0].startswith(o, at[0])}:
                for b in {o for o in options[types[1]] if texts[1].startswith(o, at[1])}:
                    yield a, b, heads
        elif "." in var:
            head = var.split(".")[0]
            for i in [heads[head]] if head in heads else range(len(options)):
                yield options[i], options[i], {**heads, head: i}
        else:
            for option in set(options):
                yield option, option, heads

    def walk(pieces, at, heads) -> bool:
        if not pieces:
            return at == (len(texts[0]), len(texts[1]))
        (text, var), rest = pieces[0], pieces[1:]
        fills = [(text, text, heads)] if var is None else options_at(var, heads, at)
        return any(
            texts[0].startswith(a, at[0])
            and texts[1].startswith(b, at[1])
            and walk(rest, (at[0] + len(a), at[1] + len(b)), chosen)
            for a, b, chosen in fills
        )

    return types[0] != types[1] and any(walk(_pieces(t), (0, 0), {}) for t in spec["templates"])


def test_reference_refuses_a_pair_whose_parts_come_apart():
    texts = ("The dog ran0 fast into1 the barn1 and", "The dogs ran0 fast into1 the barn1 and")
    assert not reference_allows(PLANTED, texts, ("sg", "pl"))
    coherent = tuple(t.replace("into1", "into0").replace("barn1", "barn0") for t in texts)
    assert reference_allows(PLANTED, coherent, ("sg", "pl"))


def test_every_published_pair_is_one_the_reference_rule_draws():
    path = _published()
    data = load_templates(path)
    for name, spec in data.items():
        task = parse_task(name, spec, path)
        prefix = " " if task.result_prepend_space else ""
        for pair in sample_pairs(task, 200, seed=0)[:200]:
            texts, types = (pair.base.text, pair.source.text), (pair.base_type, pair.source_type)
            assert reference_allows(spec, texts, types), (name, texts)
            assert pair.base.label in [prefix + w for w in spec["labels"][pair.base_type]]
            assert pair.source.label in [prefix + w for w in spec["labels"][pair.source_type]]
