"""`lit_interventions.apply`: any artifact on a loaded LM, at the positions asked, while
`transformers` generates; pyvene parity for an interchange; LoRA as peft computes it; one error
line for an artifact of another LM."""

from __future__ import annotations

import json

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.positions import Positions, encode_text, span_position
from lit_interventions.inference.apply import LoadedArtifact, apply
from lit_interventions.interventions.additive import ConceptDictionary
from lit_interventions.interventions.attacks import GradientAttack
from lit_interventions.interventions.base import Intervention, register_intervention
from lit_interventions.interventions.compose import Composition
from lit_interventions.interventions.directions import DiffMeanDirection
from lit_interventions.interventions.featurizers import FeatureInterchange, FullVectorSwap, PCAFeaturizer, SAEFeaturizer
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.interventions.mask import SigmoidMaskIntervention
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.probe import ProbeModule
from lit_interventions.modules.steering_baselines import LoRAModule
from tests.conftest import HIDDEN
from tests.helpers import run_command

LAYER = 1


def _dictionary(model_dir: str, d: int = HIDDEN, layer: int = LAYER) -> Dictionary:
    """Two concepts: e_0 (max activation 1) and e_1 (max activation 2)."""
    return Dictionary(
        vectors=torch.eye(d)[:2],
        max_activations=torch.tensor([1.0, 2.0]),
        concepts=["first", "second"],
        model=model_dir,
        layer=layer,
        method="diffmean",
    )


class Deltas:
    """What the edit hook at block `layer` adds, per forward: a hook placed before `apply` sees
    the block's own output, one placed after sees the edited output."""

    def __init__(self, model, layer: int = LAYER):
        self.block, self.before, self.after = decoder_layers(model)[layer], [], []

    def hook(self, into: list):
        return self.block.register_forward_hook(
            lambda m, a, out: into.append(out[0] if isinstance(out, tuple) else out)
        )

    def dims(self, dim: int) -> list[torch.Tensor]:
        return [(b2 - b1)[..., dim] for b1, b2 in zip(self.before, self.after)]


def _generate(model, enc, n: int = 4, **options):
    return model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0, **options)


@pytest.mark.parametrize(
    "positions,expected",
    [
        ("all", lambda p, n: [1] * (p + n - 1)),
        ("prompt", lambda p, n: [1] * p + [0] * (n - 1)),
        ("generated", lambda p, n: [0] * p + [1] * (n - 1)),
        ("last", lambda p, n: [0] * (p - 1) + [1] + [0] * (n - 1)),
        ("0,-2", lambda p, n: [1] + [0] * (p - 3) + [1, 0] + [0] * (n - 1)),
    ],
)
@pytest.mark.parametrize("use_cache", [True, False])
def test_positions_edited_while_generating(tiny_lm_dir, tiny_lm, tokenizer, positions, expected, use_cache):
    """Concept "first" at factor 1 adds exactly 1.0 to dimension 0 at the chosen positions of
    the prompt and of each token fed back, with the cache (one token per forward) and without it
    (the whole sequence each forward)."""
    model = tiny_lm("llama")
    enc = encode_text(tokenizer, "The dog is here")
    prompt, n = enc["input_ids"].shape[1], 4
    deltas = Deltas(model)
    first = deltas.hook(deltas.before)
    with apply(model, _dictionary(tiny_lm_dir("llama")), concept="first", positions=positions):
        second = deltas.hook(deltas.after)
        _generate(model, enc, n, use_cache=use_cache)
    first.remove(), second.remove()
    added = deltas.dims(0)
    seen = torch.cat([d[0] for d in added]) if use_cache else added[-1][0]
    torch.testing.assert_close(seen, torch.tensor(expected(prompt, n), dtype=torch.float32))
    assert all(d.abs().max() == 0 for d in deltas.dims(1))  # only w_first, only dimension 0


def test_left_padded_rows_per_row_concepts_factors_and_switches(tiny_lm_dir, tiny_lm, tokenizer):
    """Rows padded on the left: "prompt" skips the pads, indices count from each row's first
    token; each row gets its own concept, factor and on/off switch."""
    model = tiny_lm("llama")
    texts = ["The dog is here", "The dog"]
    ids = [encode_text(tokenizer, t)["input_ids"][0].tolist() for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in ids])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in ids])[:, None]).long()
    deltas = Deltas(model)
    first = deltas.hook(deltas.before)
    d = _dictionary(tiny_lm_dir("llama"))
    with apply(model, d, concept=["first", "second"], factor=[3.0, 0.5], positions="0"):
        second = deltas.hook(deltas.after)
        model(input_ids=input_ids, attention_mask=mask)
    first.remove(), second.remove()
    pad = width - len(ids[1])
    dim0, dim1 = deltas.dims(0)[0], deltas.dims(1)[0]
    assert dim0[0].tolist() == [3.0] + [0.0] * (width - 1)  # row 0: 3 × 1 × e_0 at its token 0
    assert dim1[1].tolist() == [0.0] * pad + [1.0] + [0.0] * (width - pad - 1)  # row 1: 0.5 × 2 × e_1
    deltas.before.clear(), deltas.after.clear()
    first = deltas.hook(deltas.before)
    with apply(model, d, concept="first", positions="prompt", enabled=[False, True]):
        second = deltas.hook(deltas.after)
        model(input_ids=input_ids, attention_mask=mask)
    first.remove(), second.remove()
    dim0 = deltas.dims(0)[0]
    assert dim0[0].abs().max() == 0  # switched off
    assert dim0[1].tolist() == [0.0] * pad + [1.0] * (width - pad)  # the pads are not the prompt


def test_interchange_matches_pyvene(tiny_lm, tokenizer):
    """DAS applied with a source text gives pyvene's logits for the same rotation at the last
    tokens of base and source."""
    pyvene = pytest.importorskip("pyvene")
    model = tiny_lm("llama")
    das = RotatedSpaceIntervention(HIDDEN, 2)
    base, source = encode_text(tokenizer, "The dog is here"), encode_text(tokenizer, "The keys are there now")
    with apply(model, das, site={"layer": LAYER}, tokenizer=tokenizer, source="The keys are there now"):
        ours = model(**base).logits
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(layer=LAYER, component="block_output", low_rank_dimension=2)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    theirs = next(iter(intervenable.interventions.values()))
    theirs = theirs[0] if isinstance(theirs, (tuple, list)) else theirs
    with torch.no_grad():
        theirs.rotate_layer.weight = das.basis.detach().T.clone()
    where = ([[[source["input_ids"].shape[1] - 1]]], [[[base["input_ids"].shape[1] - 1]]])
    _, out = intervenable(base, [source], unit_locations={"sources->base": where})
    torch.testing.assert_close(ours, out.logits, rtol=1e-4, atol=1e-5)
    assert (ours[0, -1] - model(**base).logits[0, -1]).abs().max() > 1e-3  # it changed the output


def test_saved_artifacts_compose_and_load_from_directories(tmp_path, tiny_lm_dir, tiny_lm, tokenizer):
    """Two saved artifacts given as a list edit together: a DAS (by its directory) at the last
    token and a dictionary concept at every position give what each gives nested."""
    model, lm_dir = tiny_lm("llama"), tiny_lm_dir("llama")
    das = RotatedSpaceIntervention(HIDDEN, 1)
    save_pretrained(tmp_path / "das", das, {"model": lm_dir, "layer": 2})
    _dictionary(lm_dir).save_pretrained(tmp_path / "dict")
    enc = encode_text(tokenizer, "The dog is here")
    options = dict(tokenizer=tokenizer, source="The keys", concept="second", factor=2.0)
    with apply(model, [str(tmp_path / "das"), str(tmp_path / "dict")], **options):
        together = model(**enc).logits
    # the DAS outside (the list's factor scales its edit too): its source is read before any edit
    # is placed, as in the list
    with apply(model, str(tmp_path / "das"), tokenizer=tokenizer, source="The keys", factor=2.0):
        with apply(model, str(tmp_path / "dict"), concept="second", factor=2.0):
            nested = model(**enc).logits
    torch.testing.assert_close(together, nested, rtol=0, atol=0)
    assert (together - model(**enc).logits).abs().max() > 1e-3


def test_composition_parts_at_their_own_sites(tiny_lm, tokenizer):
    """A composed artifact applies each part at the site config.json records for it."""
    model = tiny_lm("llama")
    parts = [RotatedSpaceIntervention(HIDDEN, 1), RotatedSpaceIntervention(HIDDEN, 1)]
    enc = encode_text(tokenizer, "The dog is here")
    with apply(
        model, Composition(parts), site={"sites": [{"layer": 0}, {"layer": 2}]}, tokenizer=tokenizer, source="A dog"
    ):
        composed = model(**enc).logits
    with apply(model, parts[0], site={"layer": 0}, tokenizer=tokenizer, source="A dog"):
        with apply(model, parts[1], site={"layer": 2}, tokenizer=tokenizer, source="A dog"):
            nested = model(**enc).logits
    torch.testing.assert_close(composed, nested, rtol=0, atol=0)


@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_lora_applied_by_hooks_equals_peft(tiny_lm_dir, tiny_lm, tokenizer, rslora):
    """A LoRA adapter applied to the shared LM with hooks gives the logits of peft's adapted copy,
    scaled by α/r, or α/√r with rsLoRA."""
    lm_dir = tiny_lm_dir("llama")
    module = LoRAModule(lm=lm_dir, rank=4, alpha=8, rslora=rslora)
    assert module.scaling == (4.0 if rslora else 2.0)
    with torch.no_grad():
        for name, p in module.adapter.items():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    enc = encode_text(tokenizer, "The dog is here")
    adapted = module.lm(**enc).logits
    model = tiny_lm("llama")
    with apply(model, module):
        ours = model(**enc).logits
    torch.testing.assert_close(ours, adapted, rtol=1e-5, atol=1e-6)
    assert (ours - model(**enc).logits).abs().max() > 1e-3


def test_span_position_is_the_last_token_of_the_text(tokenizer):
    text = "The dog is here"
    enc = encode_text(tokenizer, text)["input_ids"][0].tolist()
    index = span_position(tokenizer, text, "dog")
    assert tokenizer.decode(enc[: index + 1]).endswith("dog")
    assert not tokenizer.decode(enc[:index]).endswith("dog")
    with pytest.raises(ValueError, match="span 'cat' does not occur in 'The dog is here'"):
        span_position(tokenizer, text, "cat")


def test_bad_requests_are_one_line_naming_both(tiny_lm_dir, tiny_lm, tokenizer):
    model = tiny_lm("llama")
    lm_dir = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"was trained on .* \(hidden size 16\); the LM given, .*, has hidden size 32"):
        with apply(model, _dictionary(lm_dir, d=16), concept=0):
            pass
    with pytest.raises(ValueError, match=r"\(layer 5\); the LM given, .*, has 3 layers \(0..2\)"):
        with apply(model, _dictionary(lm_dir, layer=5), concept=0):
            pass
    with pytest.raises(ValueError, match=r"concept='third'; give one of 'first', 'second' or an index 0..1"):
        with apply(model, _dictionary(lm_dir), concept="third"):
            pass
    with pytest.raises(ValueError, match="holds 2 concepts: name one"):
        with apply(model, _dictionary(lm_dir)):
            pass
    with pytest.raises(ValueError, match="is an interchange intervention: give a source"):
        with apply(model, RotatedSpaceIntervention(HIDDEN, 1), site={"layer": 1}):
            pass
    with pytest.raises(ValueError, match=r"positions='middle'; use one of site, all, prompt, generated, last"):
        Positions.parse("middle")
    with pytest.raises(ValueError, match="factor=nan must be a finite number"):
        with apply(model, _dictionary(lm_dir), concept=0, factor=float("nan")):
            pass
    enc = encode_text(tokenizer, "The dog")
    plain = model(**enc).logits
    with pytest.raises(ValueError):
        with apply(model, [_dictionary(lm_dir), _dictionary(lm_dir, d=16)], concept=0):
            pass
    torch.testing.assert_close(model(**enc).logits, plain, rtol=0, atol=0)  # nothing left hooked


# --- lit-interventions generate, as a user runs it ------------------------------------------------


def test_generate_command_prints_unsteered_and_steered(tmp_path, tiny_lm_dir, tiny_lm, tokenizer):
    """`generate --json` prints the continuation without and with the artifact, as `generate`
    gives them inside and outside `apply`; the plain output puts them side by side."""
    lm_dir = tiny_lm_dir("llama")
    _dictionary(lm_dir).save_pretrained(tmp_path / "dict")
    args = ["generate", "--artifact", str(tmp_path / "dict"), "--prompt", "The dog", "--concept", "second"]
    args += ["--factor", "30", "--max_new_tokens", "5"]
    done = run_command(*args, "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    model = tiny_lm("llama")
    enc = encode_text(tokenizer, "The dog")
    plain = _generate(model, enc, 5)[0, enc["input_ids"].shape[1] :]
    with apply(model, str(tmp_path / "dict"), concept="second", factor=30.0):
        steered = _generate(model, enc, 5)[0, enc["input_ids"].shape[1] :]
    assert printed == {
        "prompt": "The dog",
        "unsteered": tokenizer.decode(plain, skip_special_tokens=True),
        "steered": tokenizer.decode(steered, skip_special_tokens=True),
    }
    assert printed["steered"] != printed["unsteered"]
    table = run_command(*args).stdout.splitlines()
    assert table[0] == "prompt: The dog"
    assert table[2].split("|")[0].strip() == "unsteered" and table[2].split("|")[1].strip() == "steered"
    assert table[4].split(" | ")[0].strip() == printed["unsteered"][: len(table[4].split(" | ")[0].strip())]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--factor", "nan"], "--factor.factor: Expected a <class 'float'>. Got value: nan"),
        (["--artifact", "/nonexistent/dict"], "error: '/nonexistent/dict' is neither a directory nor a hub id"),
        (["--positions", "middle"], "error: --positions='middle'; use one of site, all, prompt, generated, last"),
        (["--max_new_tokens", "0"], "error: --max_new_tokens=0 must be an integer >= 1"),
        (["--concept", "third"], "concept='third'; give one of 'first', 'second' or an index 0..1"),
    ],
)
def test_generate_command_refuses_bad_input_before_loading(tmp_path, tiny_lm_dir, extra, message):
    _dictionary(tiny_lm_dir("llama")).save_pretrained(tmp_path / "dict")
    artifact = [] if "--artifact" in extra else ["--artifact", str(tmp_path / "dict")]
    done = run_command("generate", *artifact, "--prompt", "The dog", *extra)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr
    assert "Loading weights" not in done.stderr  # refused before the LM loads


def test_recorded_model_type_and_layer_count_are_checked(tiny_lm_dir, tiny_lm):
    model = tiny_lm("llama")
    das = RotatedSpaceIntervention(HIDDEN, 1)
    for config, message in [
        (
            {"site": {"layer": 1}, "model": "gpt2-ish", "model_type": "gpt2"},
            r"\(a gpt2 model\); the LM given, .*, is a llama model",
        ),
        (
            {"site": {"layer": 1}, "model": "deep", "num_layers": 12},
            r"'deep' \(12 layers\); the LM given, .*, has 3 layers",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            with apply(model, LoadedArtifact(das, config, "the DAS"), source=torch.zeros(HIDDEN)):
                pass


def _interventions():
    """Every kind of intervention `apply` takes generically, at hidden size 32: (build, interchange)."""
    g = torch.Generator().manual_seed(4)
    states, labels = torch.randn(40, HIDDEN, generator=g), torch.arange(40) % 2
    pca = PCAFeaturizer.fit(torch.randn(64, HIDDEN, generator=g), n_components=8)
    sae = SAEFeaturizer(*(torch.randn(*shape, generator=g) for shape in [(64, HIDDEN), (64,), (HIDDEN, 64), (HIDDEN,)]))
    mask = SigmoidMaskIntervention(HIDDEN, temperature=0.5)
    with torch.no_grad():
        mask.mask.copy_(torch.randn(HIDDEN, generator=g))
    return {
        "das": (lambda: RotatedSpaceIntervention(HIDDEN, 3), True),
        "fixed": (lambda: FixedSubspaceIntervention(torch.linalg.qr(torch.randn(HIDDEN, 2, generator=g))[0].T), True),
        "direction": (lambda: DiffMeanDirection().fit(states, labels).to_intervention(), True),
        "dbm": (lambda: mask, True),
        "pca": (lambda: FeatureInterchange(pca, [0, 3, 5]), True),
        "sae": (lambda: FeatureInterchange(sae, [1, 7, 30], keep_error=False), True),
        "full_swap": (FullVectorSwap, True),
        "concept_dictionary": (lambda: ConceptDictionary(3, HIDDEN, seed=1), False),
        "loreft": (lambda: LoReFTIntervention(HIDDEN, rank=2), False),
    }


@pytest.mark.parametrize("name", list(_interventions()))
def test_every_intervention_applies_from_its_directory(name, tmp_path, tiny_lm_dir, tiny_lm, tokenizer):
    """Saved with `save_pretrained` and applied by its directory, each intervention gives what the
    object gives, and changes the LM's output."""
    build, interchange = _interventions()[name]
    module = build()
    save_pretrained(tmp_path, module, {"model": tiny_lm_dir("llama"), "layer": 1})
    model, enc = tiny_lm("llama"), encode_text(tokenizer, "The dog is here")
    options = dict(tokenizer=tokenizer, source="The keys are there") if interchange else dict(concept=2, factor=3.0)
    with apply(model, str(tmp_path), **options):
        loaded = model(**enc).logits
    with apply(model, module, site={"layer": 1}, **options):
        own = model(**enc).logits
    torch.testing.assert_close(loaded, own, rtol=1e-5, atol=1e-5)
    assert (loaded - model(**enc).logits).abs().max() > 1e-4


def test_an_attack_needing_targets_is_refused_with_one_line(tiny_lm):
    attack = GradientAttack(ProbeModule(["a", "b", "c"], "toy", 0, HIDDEN, kind="mlp", hidden=8), epsilon=0.3, steps=5)
    with pytest.raises(ValueError, match="a GradientAttack needs target for every row, which apply does not give"):
        with apply(tiny_lm("llama"), attack, site={"layer": 1}):
            pass


@register_intervention
class Squash(Intervention):
    """A planted source-free edit whose forward takes no factor: f*(h) = tanh(h) + b."""

    edits_base_alone = True

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = torch.nn.Parameter(bias)

    def forward(self, base, source=None):
        return torch.tanh(base) + self.bias

    def export(self):
        return {"bias": self.bias.detach()}


def _edited_states(model, enc, artifact, **options):
    """(the block's own output h, the edited output, the logits) of one forward under `apply`."""
    deltas = Deltas(model)
    before = deltas.hook(deltas.before)
    try:
        with apply(model, artifact, site={"layer": LAYER}, **options):
            after = deltas.hook(deltas.after)
            try:
                logits = model(**enc).logits
            finally:
                after.remove()
    finally:
        before.remove()
    return deltas.before[0], deltas.after[0], logits


@pytest.mark.parametrize("name", ["planted", "loreft"])
def test_the_factor_scales_an_edit_without_a_factor_of_its_own(tiny_lm, tokenizer, name):
    """h + factor·(f*(h) − h): factor 0 leaves the LM's output as it is, factor 1 is f* bit for
    bit (the logits of a hook that puts f*(h) in place), factor 2 is h + 2(f* − h) on the states."""
    model, enc = tiny_lm("llama"), encode_text(tokenizer, "The dog is here")
    torch.manual_seed(3)
    edit = Squash(torch.randn(HIDDEN)) if name == "planted" else LoReFTIntervention(HIDDEN, rank=2)
    plain = model(**enc).logits
    h, zero, logits = _edited_states(model, enc, edit, factor=0.0)
    assert torch.equal(zero, h) and torch.equal(logits, plain)
    with torch.no_grad():
        star = edit(h, None)
    _, one, logits = _edited_states(model, enc, edit, factor=1.0)
    assert torch.equal(one, star)
    handle = decoder_layers(model)[LAYER].register_forward_hook(
        lambda m, a, out: (edit(out[0], None), *out[1:]) if isinstance(out, tuple) else edit(out, None)
    )
    try:
        by_hand = model(**enc).logits
    finally:
        handle.remove()
    assert torch.equal(logits, by_hand) and not torch.equal(logits, plain)
    _, two, _ = _edited_states(model, enc, edit, factor=2.0)
    assert torch.equal(two, h + 2.0 * (star - h))
    assert (two - star).abs().max() > 1e-3  # not f* again


def test_per_row_factors_scale_each_row_and_a_lora_at_factor_0_is_the_plain_lm(tiny_lm_dir, tiny_lm, tokenizer):
    """Rows with factors [0, 1]: the first row's output is the plain LM's, the second the edit's;
    a LoRA adapter at factor 0 leaves the logits as they are, and at factor 2 moves them."""
    model = tiny_lm("llama")
    edit = Squash(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5)))
    enc = {k: v.repeat(2, 1) for k, v in encode_text(tokenizer, "The dog is here").items()}
    plain = model(**enc).logits
    with apply(model, edit, site={"layer": LAYER}):
        full = model(**enc).logits
    with apply(model, edit, site={"layer": LAYER}, factor=[0.0, 1.0]):
        mixed = model(**enc).logits
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[1], full[1])
    module = LoRAModule(lm=tiny_lm_dir("llama"), rank=4, alpha=8)
    with torch.no_grad():
        for i, p in enumerate(module.adapter.values()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    with apply(model, module, factor=0.0):
        assert torch.equal(model(**enc).logits, plain)
    with apply(model, module):
        one = model(**enc).logits
    with apply(model, module, factor=2.0):
        two = model(**enc).logits
    assert (one - plain).abs().max() > 1e-3 and (two - one).abs().max() > 1e-3


@pytest.mark.parametrize("factor", [0.2, 0.6, 1.0, 1.4, 2.5, 3.0])
def test_a_dictionary_steers_through_apply_as_through_its_own_steer(tiny_lm_dir, tiny_lm, tokenizer, factor):
    """`apply` (what `steer` and `generate` use) and `Dictionary.steer`: the same greedy token ids,
    at max activations whose α = factor × m_c rounds differently in float32 and in float64."""
    lm_dir, model = tiny_lm_dir("llama"), tiny_lm("llama")
    torch.manual_seed(0)
    dictionary = Dictionary(
        vectors=torch.nn.functional.normalize(torch.randn(2, HIDDEN), dim=-1),
        max_activations=torch.tensor([3.7, 13.3]),
        concepts=["first", "second"],
        model=lm_dir,
        layer=LAYER,
        method="diffmean",
    )
    enc = tokenizer(["The dog is here", "A river"], return_tensors="pt", padding=True, padding_side="left")
    with dictionary.steer(model, "second", factor):
        old = _generate(model, enc, 8)
        old_logits = model(**enc).logits
    with apply(model, dictionary, concept="second", factor=factor):
        new = _generate(model, enc, 8)
        new_logits = model(**enc).logits
    assert torch.equal(new, old) and torch.equal(new_logits, old_logits)
    assert not torch.equal(new_logits, model(**enc).logits)  # it steered
