"""Conditional steering (`inference.gate`): h' = h + α·w_c·1[z_c(h) > τ_c]. The gate on planted
latents (pure tensors, and the tiny llama through `apply`), Youden's threshold against a hand
computation, the eval split's τ against the AUROC's own token latents, and bad gates refused in
one line before any model loads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import load_concepts
from lit_interventions.datamodules.axbench_format import collate

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.forward import read_layers
from lit_interventions.core.positions import encode_text
from lit_interventions.inference.apply import LoadedArtifact, apply
from lit_interventions.inference.gate import check_gate, concept_latent, eval_thresholds
from lit_interventions.interventions.additive import (
    ConceptDictionary,
    ReFTR1Dictionary,
    concept_latents,
    youden_threshold,
)
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.modules.steering import SteeringModule
from tests.conftest import HIDDEN
from tests.helpers import run_command

LAYER = 1
TEXT = "The dog is here. The dog gives the keys to the author."


# --- the gate on pure tensors ------------------------------------------------------------------


def test_the_gate_edits_exactly_the_tokens_whose_latent_is_above_tau():
    """Planted latents: the rows are e_0 and e_1, so z_c(h_t) = h_t[c]; tokens above τ get h + α·w_c,
    the others are the input itself, bit for bit; one τ per example; the ReLU latent of ReFT-r1."""
    d = ConceptDictionary(2, 4)
    with torch.no_grad():
        d.weight.copy_(torch.eye(4)[:2])
    base = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    base[0, :, 0] = torch.tensor([2.0, 0.5, -1.0, 1.0, 3.0])  # example 0, concept 0: latents
    base[1, :, 1] = torch.tensor([-2.0, 0.1, 0.2, 5.0, -0.3])  # example 1, concept 1
    concept, alpha = torch.tensor([0, 1]), 10.0
    out = d(base, concept_id=concept, factor=alpha, threshold=torch.tensor([1.0, 0.15]))
    open_ = torch.tensor([[True, False, False, False, True], [False, False, True, True, False]])
    assert torch.equal(out[~open_], base[~open_])  # shut: bit-identical to unsteered
    steered = d(base, concept_id=concept, factor=alpha)  # the ungated edit
    assert torch.equal(out[open_], steered[open_])
    assert torch.equal(out[0, 0], base[0, 0] + torch.tensor([10.0, 0, 0, 0]))
    # (batch, d) states: one token per example
    flat = d(base[:, 0], concept_id=concept, factor=alpha, threshold=1.0)
    assert torch.equal(flat[0], steered[0, 0]) and torch.equal(flat[1], base[1, 0])
    # ReLU(h·w): a latent of −2 is 0, shut for τ = 0 (strictly above), as 0.1 > 0 is open
    relu = ReFTR1Dictionary()
    relu.allocate(2, 4)
    with torch.no_grad():
        relu.weight.copy_(torch.eye(4)[:2])
    gated = relu(base[1:], concept_id=torch.tensor([1]), factor=alpha, threshold=0.0)
    assert torch.equal(gated[0, [0, 4]], base[1, [0, 4]])
    assert torch.equal(gated[0, [1, 2, 3]], relu(base[1:], concept_id=torch.tensor([1]), factor=alpha)[0, [1, 2, 3]])


def test_youden_threshold_equals_the_hand_computation():
    """positive {1, 3, 4}, negative {0, 1.5, 2}: J(τ) = TPR − FPR over τ ∈ every latent is 1/3, 0,
    1/3, 2/3, 1/3, 0 for τ = 0, 1, 1.5, 2, 3, 4: τ = 2. Ties go to the smallest τ."""
    assert youden_threshold(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0.0, 2.0, 1.5])) == 2.0
    # positive {1, 3}, negative {0, 2}: J = 1/2 at τ = 0 (TPR 1, FPR 1/2) and at τ = 2 (TPR 1/2, FPR 0)
    assert youden_threshold(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 2.0])) == 0.0
    # separable: the largest negative is τ, J = 1
    assert youden_threshold(torch.tensor([5.0, 6.0]), torch.tensor([-1.0, 4.0])) == 4.0
    with pytest.raises(ValueError, match="needs latents of both kinds; got 2 positive and 0 negative"):
        youden_threshold(torch.tensor([1.0, 2.0]), torch.tensor([]))


# --- the gate through apply, on the tiny llama -----------------------------------------------------


def _dictionary(lm_dir: str, concepts=("dogs", "giving"), method="diffmean", **extra) -> Dictionary:
    vectors = torch.nn.functional.normalize(
        torch.randn(len(concepts), HIDDEN, generator=torch.Generator().manual_seed(3)), dim=-1
    )
    return Dictionary(
        vectors=vectors,
        max_activations=torch.full((len(concepts),), 2.0),
        concepts=list(concepts),
        model=lm_dir,
        layer=LAYER,
        method=method,
        **extra,
    )


def _layer_output(model, enc) -> torch.Tensor:
    """The residual stream after block LAYER as the LM runs now (hooks included), (seq, d)."""
    seen = []
    handle = decoder_layers(model)[LAYER].register_forward_hook(
        lambda module, args, output: seen.append((output[0] if isinstance(output, tuple) else output).detach())
    )
    try:
        model(**enc)
    finally:
        handle.remove()
    return seen[0][0]


def test_apply_gates_each_token_on_the_dictionarys_latent(tiny_lm_dir, tiny_lm, tokenizer):
    """τ halfway between two middle latents of the text: tokens above it carry h + α·w (α = factor × 2), the others
    are the unsteered state bit for bit; τ below every latent is the ungated edit, τ above every
    latent leaves the LM as it is (its logits bit-identical)."""
    model, lm_dir = tiny_lm("llama"), tiny_lm_dir("llama")
    dictionary = _dictionary(lm_dir)
    enc = encode_text(tokenizer, TEXT)
    plain = _layer_output(model, enc)
    w = dictionary.vectors[1]
    z = concept_latents(plain, w, "linear")
    middle = z.sort().values[len(z) // 2 - 1 : len(z) // 2 + 1]
    tau = float(middle.mean())  # no latent sits at τ itself
    open_ = z > tau
    assert 0 < int(open_.sum()) < len(z)
    with apply(model, dictionary, concept="giving", factor=3.0, gate=tau):
        gated = _layer_output(model, enc)
    assert torch.equal(gated[~open_], plain[~open_])
    assert torch.equal(gated[open_], plain[open_] + (6.0 * w)[None, :])
    with apply(model, dictionary, concept="giving", factor=3.0):
        ungated = _layer_output(model, enc)
        ungated_logits = model(**enc).logits
    with apply(model, dictionary, concept="giving", factor=3.0, gate=float(z.min()) - 1):
        assert torch.equal(_layer_output(model, enc), ungated)
        assert torch.equal(model(**enc).logits, ungated_logits)
    plain_logits = model(**enc).logits
    with apply(model, dictionary, concept="giving", factor=3.0, gate=[1, 1.0]):  # the number 1, not True
        assert torch.equal(model(**enc).logits, plain_logits)  # every latent here is below 1
    assert float(z.max()) < 1
    with apply(model, dictionary, concept="giving", factor=3.0, gate=float(z.max())):
        assert torch.equal(model(**enc).logits, plain_logits)
    # one gate per batch row: row 0 gated at τ, row 1 ungated, each as it is alone
    both = {k: v.repeat(2, 1) for k, v in enc.items()}
    with apply(model, dictionary, concept="giving", factor=3.0, gate=[tau, None]):
        rows = model(**both).logits
    with apply(model, dictionary, concept="giving", factor=3.0, gate=tau):
        alone = model(**enc).logits
    torch.testing.assert_close(rows[0], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[1], ungated_logits[0], rtol=1e-5, atol=1e-5)


def test_a_concept_dictionary_intervention_is_gated_as_the_released_dictionary(tiny_lm_dir, tiny_lm, tokenizer):
    """A `ConceptDictionary` saved as an intervention gates on its own rows: the same states as
    the same rows in a `Dictionary` at the same α (its factor is α itself)."""
    model, lm_dir = tiny_lm("llama"), tiny_lm_dir("llama")
    dictionary = _dictionary(lm_dir)
    rows = ConceptDictionary(2, HIDDEN)
    with torch.no_grad():
        rows.weight.copy_(dictionary.vectors)
    enc = encode_text(tokenizer, TEXT)
    z = concept_latents(_layer_output(model, enc), dictionary.vectors[0], "linear").sort().values
    tau = float(z[len(z) // 2 - 1 : len(z) // 2 + 1].mean())
    with apply(model, dictionary, concept=0, factor=2.5, gate=tau):
        expected = _layer_output(model, enc)
    with apply(model, rows, site={"layer": LAYER}, concept=0, factor=5.0, gate=tau):
        assert torch.equal(_layer_output(model, enc), expected)


def test_eval_thresholds_maximise_youden_over_the_aurocs_token_latents(tiny_lm_dir, tiny_lm):
    """`gate=True`: τ_c from the built-in eval split equals Youden's threshold over the token latents
    the AUROC reads (`SteeringModule.detection_mask`, its default `detect_on: content`) of the
    concept's positives against its negatives, hard negatives left out."""
    model, lm_dir = tiny_lm("llama"), tiny_lm_dir("llama")
    names = load_concepts(None).concepts[:2]
    dictionary = _dictionary(lm_dir, concepts=names, training_data="builtin")
    found = eval_thresholds(concept_latent(dictionary, {}, "d"), model)
    data = AxBenchDataModule(lm=lm_dir, concepts=[0, 1])
    data.setup()
    module = SimpleNamespace(hparams=SimpleNamespace(detect_on="content"))
    latents = {(c, label): [] for c in (0, 1) for label in (0, 1)}
    for start in range(0, len(data.splits["eval"]), 7):
        batch = collate(data.splits["eval"][start : start + 7], pad_id=data.tokenizer.pad_token_id)
        hidden = read_layers(model, [LAYER], batch["input_ids"], batch["attention_mask"])[LAYER]
        mask = SteeringModule.detection_mask(module, batch)
        for row in range(len(hidden)):
            key = (int(batch["concept_id"][row]), int(batch["label"][row]))
            if key in latents:
                latents[key].append(concept_latents(hidden[row][mask[row]], dictionary.vectors[key[0]], "linear"))
    for c, name in enumerate(names):
        positive, negative = torch.cat(latents[(c, 1)]), torch.cat(latents[(c, 0)])
        assert found[name] == youden_threshold(positive, negative)
        j = (positive > found[name]).double().mean() - (negative > found[name]).double().mean()
        assert j > 0  # the rule's J at its τ, against J = 0 of an open gate
    artifact = LoadedArtifact(dictionary, {}, "d")
    tau = found[names[1]]
    enc = encode_text(data.tokenizer, TEXT)
    with apply(model, dictionary, concept=1, factor=3.0, gate=tau):
        by_number = _layer_output(model, enc)
    with apply(model, artifact, concept=1, factor=3.0, gate=True):
        assert torch.equal(_layer_output(model, enc), by_number)
    assert artifact.gate_cache.get(concept_latent(dictionary, {}, "d"), model, "d") == found  # kept


def test_bad_gates_are_one_line_naming_the_value(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    linear = LoadedArtifact(_dictionary(lm_dir), {}, "d")
    relu = LoadedArtifact(_dictionary(lm_dir, method="reft_r1"), {}, "r")
    loreft = LoReFTIntervention(HIDDEN, rank=2)
    for gate, artifacts, message in [
        (float("nan"), [linear], "gate=nan is not a finite number"),
        ("inf", [linear], "gate=inf is not a finite number"),
        ("soon", [linear], "gate='soon'; give true"),
        (-0.5, [relu], "gate=-0.5 is out of range for r: its latent is ReLU(h·w) >= 0"),
        (
            0.5,
            [LoadedArtifact(loreft, {"site": {"layer": 1}}, "l")],
            "l holds a LoReFTIntervention, which has no concept latent",
        ),
        (True, [linear], "d records training data None, not the built-in concepts"),
    ]:
        with pytest.raises(ValueError) as err:
            check_gate(gate, artifacts)
        assert message in str(err.value) and "\n" not in str(err.value)
    assert check_gate(-0.5, [linear]) == -0.5 and check_gate("false", [linear]) is None


# --- the commands: bad gates refused before any model loads ------------------------------------------


@pytest.fixture
def saved(tiny_lm_dir, tmp_path):
    """(the tiny llama's directory, a ReFT-r1-latent dictionary's directory, a LoReFT's directory)."""
    lm_dir = tiny_lm_dir("llama")
    _dictionary(lm_dir, method="reft_r1").save_pretrained(tmp_path / "dict")
    save_pretrained(tmp_path / "loreft", LoReFTIntervention(HIDDEN, rank=2), {"model": lm_dir, "layer": 1})
    return lm_dir, str(tmp_path / "dict"), str(tmp_path / "loreft")


@pytest.mark.parametrize(
    "command,artifact,gate,message",
    [
        ("generate", "dict", "-1", "error: --gate=-1 is out of range for"),
        ("generate", "dict", "nan", "error: --gate=nan is not a finite number"),
        ("generate", "loreft", "true", "which has no concept latent to gate on"),
        ("serve", "loreft", "0.5", "which has no concept latent to gate on"),
        ("serve", "dict", "-2", "error: --gate=-2 is out of range for"),
        ("steer", "dict", "-1", "error: --gate=-1 is out of range for"),
        ("steer", "loreft", "true", "which has no concept latent to gate on"),
        ("steer", None, "true", "error: --gate=true: the prompt baseline has no edit to gate"),
    ],
)
def test_commands_refuse_a_bad_gate_in_one_line_before_loading(saved, tmp_path, command, artifact, gate, message):
    lm_dir, dictionary, loreft = saved
    path = {"dict": dictionary, "loreft": loreft}.get(artifact)
    if command == "generate":
        args = ["generate", "--artifact", path, "--prompt", "The dog"]
    elif command == "serve":
        args = ["serve", "--artifact", path, "--port", "0"]
    else:
        source = ["--artifact", path, "--concepts", "dogs"] if path else ["--method", "prompt", "--concepts", "0"]
        args = ["steer", *source, "--lm", lm_dir, "--out", str(tmp_path / "out"), "--instructions", "2"]
        args += ["--judge", json.dumps({"backend": "local", "lm": lm_dir})]
    done = run_command(*args, "--gate", gate)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr, done.stderr
    assert "Loading weights" not in done.stderr
