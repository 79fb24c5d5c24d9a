"""`lit-interventions export`: each format loaded back by the other tool itself (peft, gguf's
reader, pyvene; lm-eval's layout, and its own loader when it is installed), with our logits;
bad input as one line and exit code 2; files replaced whole or not at all."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.core.forward import read_site
from lit_interventions.core.hooks import site_hook
from lit_interventions.export.cli import main
from lit_interventions.export.formats import supported_formats
from lit_interventions.export.pyvene_interventions import pyvene
from lit_interventions.interventions.additive import ConceptDictionary
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.steering_baselines import LoRAModule
from tests.conftest import HIDDEN
from tests.helpers import run_command

CONCEPTS = ["dogs", "rental services"]
PEAKS = [2.0, 3.5]


def _ids(vocab_size: int, seed: int = 0, shape=(3, 7)) -> torch.Tensor:
    return torch.randint(3, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _dictionary(lm_dir: str, layer: int = 1, seed: int = 0) -> Dictionary:
    vectors = torch.randn(len(CONCEPTS), HIDDEN, generator=torch.Generator().manual_seed(seed))
    return Dictionary(vectors, torch.tensor(PEAKS), CONCEPTS, lm_dir, layer, "reft_r1")


def _export(*args) -> None:
    main([str(a) for a in args])


def _one_error_line(done) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@torch.no_grad()
def _logits(model, ids, layer=None, component="block_output", edit=None) -> torch.Tensor:
    if edit is None:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    with site_hook(model, layer, component, edit):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


# --- peft ------------------------------------------------------------------------------------------


def _lora_run(lm_dir: str, directory: Path) -> LoRAModule:
    torch.manual_seed(0)
    module = LoRAModule(lm=lm_dir, rank=2, concept="cats")
    for p in module.adapter.values():  # B = 0 at init: give the adapter weights of its own
        torch.nn.init.normal_(p, std=0.5)
    module.save(directory)
    return module


def test_peft_adapter_loads_with_peft_and_gives_our_logits(tiny_lm_dir, tmp_path):
    lm_dir = tiny_lm_dir("llama")
    module = _lora_run(lm_dir, tmp_path / "run")
    done = run_command("export", "--artifact", str(tmp_path / "run"), "--to", "peft", "--out", str(tmp_path / "peft"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lm_dir), tmp_path / "peft").eval()
    assert loaded.peft_config["default"].r == 2 and loaded.peft_config["default"].target_modules == {"o_proj"}
    ids = _ids(loaded.config.vocab_size)
    ours, theirs = _logits(module.lm.eval(), ids), _logits(loaded, ids)
    assert (ours - theirs).abs().max().item() == 0.0  # the same adapter through the same peft code
    assert (ours - _logits(AutoModelForCausalLM.from_pretrained(lm_dir), ids)).abs().max() > 1e-3  # it steers


def test_peft_adapter_of_a_gpt2_conv1d_projection(tiny_lm_dir, tmp_path):
    """GPT-2's attn.c_proj is a Conv1D: peft's fan_in_fan_out goes into adapter_config.json."""
    lm_dir = tiny_lm_dir("gpt2")
    module = _lora_run(lm_dir, tmp_path / "run")
    _export("--artifact", tmp_path / "run", "--to", "peft", "--out", tmp_path / "peft")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lm_dir), tmp_path / "peft").eval()
    assert loaded.peft_config["default"].fan_in_fan_out is True
    ids = _ids(loaded.config.vocab_size)
    assert torch.equal(_logits(module.lm.eval(), ids), _logits(loaded, ids))


# --- gguf control vectors --------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, name: str):
    return reader.fields[name].contents()


def test_gguf_control_vectors_read_back_with_gguf_reader(tiny_lm_dir, tmp_path):
    dictionary = _dictionary(tiny_lm_dir("llama"), layer=2)
    dictionary.save_pretrained(tmp_path / "dict")
    done = run_command(
        "export", "--artifact", str(tmp_path / "dict"), "--to", "gguf-control-vector", "--out", str(tmp_path / "cv"),
        "--factor", "0.5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "cv").iterdir()) == ["dogs.gguf", "rental-services.gguf"]
    for row, (concept, stem) in enumerate(zip(CONCEPTS, ["dogs", "rental-services"])):
        reader = gguf.GGUFReader(tmp_path / "cv" / f"{stem}.gguf")
        assert _field(reader, "general.architecture") == "controlvector"
        assert _field(reader, "controlvector.model_hint") == "llama"
        assert _field(reader, "controlvector.layer_count") == 1
        (tensor,) = reader.tensors
        assert tensor.name == "direction.2"  # llama.cpp's index is our block index (see control_vector.py)
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        expected = 0.5 * PEAKS[row] * dictionary.vectors[row]  # factor × max activation × w
        assert torch.equal(torch.from_numpy(tensor.data.copy()), expected)
        assert torch.equal(expected, dictionary.steering_vectors(concept, 0.5)[concept][2])  # what `steer` adds


def test_gguf_one_concept_by_name_or_row_and_a_concept_dictionary(tiny_lm_dir, tmp_path):
    lm_dir = tiny_lm_dir("llama")
    _dictionary(lm_dir).save_pretrained(tmp_path / "dict")
    _export("--artifact", tmp_path / "dict", "--to", "gguf-control-vector", "--out", tmp_path / "a", "--concept", "1")
    _export(
        "--artifact", tmp_path / "dict", "--to", "gguf-control-vector", "--out", tmp_path / "b", "--concept", "dogs"
    )
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["rental-services.gguf"]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["dogs.gguf"]
    rows = ConceptDictionary(3, HIDDEN, seed=4)
    save_pretrained(tmp_path / "rows", rows, {"model": lm_dir, "layer": 1})  # its layer: config.json's site
    _export("--artifact", tmp_path / "rows", "--to", "gguf-control-vector", "--out", tmp_path / "c", "--factor", "3")
    reader = gguf.GGUFReader(tmp_path / "c" / "concept-2.gguf")
    (tensor,) = reader.tensors
    assert tensor.name == "direction.1"
    assert torch.equal(torch.from_numpy(tensor.data.copy()), torch.tensor(3.0) * rows.weight[2].detach())


# --- lm-eval ---------------------------------------------------------------------------------------


def _lm_eval_steer(model, payload: dict):
    """What lm-eval's SteeredModel does with the .pt (hf_steered.py, action "add"): a forward hook
    on `model.base_model`'s module named by the hookpoint adds steering_vector × coefficient."""
    ((hookpoint, entry),) = payload.items()
    vector = entry["steering_vector"].to(model.dtype) * float(entry["steering_coefficient"])

    def hook(module, args, output):
        return (output[0] + vector, *output[1:]) if isinstance(output, tuple) else output + vector

    return model.base_model.get_submodule(hookpoint).register_forward_hook(hook)


@pytest.mark.parametrize("arch,hookpoint", [("llama", "layers.1"), ("gpt2", "h.1")])
def test_lm_eval_steering_file_has_its_layout_and_steers_as_we_do(tiny_lm_dir, tiny_lm, tmp_path, arch, hookpoint):
    dictionary = _dictionary(tiny_lm_dir(arch))
    dictionary.save_pretrained(tmp_path / "dict")
    _export("--artifact", tmp_path / "dict", "--to", "lm-eval", "--out", tmp_path / "pt", "--factor", "2")
    payload = torch.load(tmp_path / "pt" / "rental-services.pt", weights_only=True)
    assert list(payload) == [hookpoint]
    entry = payload[hookpoint]
    assert set(entry) == {"steering_vector", "steering_coefficient", "action", "bias", "head_index"}
    assert [entry[k] for k in ("steering_coefficient", "action", "bias", "head_index")] == [1.0, "add", None, None]
    assert torch.equal(entry["steering_vector"], 2 * PEAKS[1] * dictionary.vectors[1])
    model, ids = tiny_lm(arch), _ids(tiny_lm(arch).config.vocab_size)
    with dictionary.steer(model, "rental services", factor=2.0):
        ours = _logits(model, ids)
    handle = _lm_eval_steer(model, payload)
    try:
        theirs = _logits(model, ids)
    finally:
        handle.remove()
    assert torch.equal(ours, theirs) and (ours - _logits(model, ids)).abs().max() > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")
def test_lm_eval_steered_model_loads_it(tiny_lm_dir, tiny_lm, tmp_path):
    from lm_eval.models.hf_steered import SteeredModel

    lm_dir = tiny_lm_dir("llama")
    dictionary = _dictionary(lm_dir)
    dictionary.save_pretrained(tmp_path / "dict")
    _export("--artifact", tmp_path / "dict", "--to", "lm-eval", "--out", tmp_path / "pt", "--concept", "dogs")
    steered = SteeredModel(pretrained=lm_dir, steer_path=str(tmp_path / "pt" / "dogs.pt"), device="cpu", batch_size=1)
    model, ids = tiny_lm("llama"), _ids(tiny_lm("llama").config.vocab_size)
    with dictionary.steer(model, "dogs"):
        ours = _logits(model, ids)
    with torch.no_grad():
        theirs = steered._model_call(ids)
    assert torch.equal(ours, theirs)


# --- pyvene ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,layer,component", [(RotatedSpaceIntervention, 1, "block_output"), (RotatedSpaceIntervention, -1, "block_output"),
                            (FixedSubspaceIntervention, 2, "mlp_output")],
)  # fmt: skip
def test_pyvene_restores_das_with_our_logits(tiny_lm_dir, tiny_lm, tmp_path, cls, layer, component):
    lm_dir, model = tiny_lm_dir("llama"), tiny_lm("llama")
    torch.manual_seed(3)
    basis = torch.linalg.qr(torch.randn(HIDDEN, 2)).Q.T  # (k, d), orthonormal rows
    das = RotatedSpaceIntervention.from_tensors({"basis": basis}) if cls is RotatedSpaceIntervention else cls(basis)
    save_pretrained(tmp_path / "das", das, {"model": lm_dir, "layer": layer, "component": component})
    _export("--artifact", tmp_path / "das", "--to", "pyvene", "--out", tmp_path / "pv")
    intervenable = pyvene.IntervenableModel.load(str(tmp_path / "pv"), model)
    base, source = _ids(model.config.vocab_size, 1), _ids(model.config.vocab_size, 2)
    base_pos, source_pos = [1, 3, 6], [2, 0, 6]
    _, theirs = intervenable(
        {"input_ids": base, "attention_mask": torch.ones_like(base)},
        [{"input_ids": source, "attention_mask": torch.ones_like(source)}],
        unit_locations={"sources->base": ([[[p] for p in source_pos]], [[[p] for p in base_pos]])},
    )
    state = read_site(model, layer, source, torch.ones_like(source), torch.tensor(source_pos), component=component)
    rows = torch.arange(3)

    def interchange(h):
        h = h.clone()
        h[rows, base_pos] = das(h[rows, base_pos], state.to(h.dtype))
        return h

    ours = _logits(model, base, layer, component, interchange)
    assert (ours - theirs.logits).abs().max().item() < 1e-5
    assert (ours - _logits(model, base)).abs().max() > 1e-3  # the interchange did something


def test_pyvene_restores_loreft_with_our_logits(tiny_lm_dir, tiny_lm, tmp_path):
    lm_dir, model = tiny_lm_dir("gpt2"), tiny_lm("gpt2")
    torch.manual_seed(5)
    loreft = LoReFTIntervention(HIDDEN, rank=3)
    save_pretrained(tmp_path / "loreft", loreft, {"model": lm_dir, "layer": 1})
    _export("--artifact", tmp_path / "loreft", "--to", "pyvene", "--out", tmp_path / "pv")
    intervenable = pyvene.IntervenableModel.load(str(tmp_path / "pv"), model)
    ids = _ids(model.config.vocab_size, 3)
    every = [list(range(ids.shape[1]))] * len(ids)  # LoReFT steers at every position
    _, theirs = intervenable(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, unit_locations={"base": [every]}
    )
    ours = _logits(model, ids, 1, "block_output", lambda h: loreft(h))
    assert (ours - theirs.logits).abs().max().item() < 1e-5
    assert (ours - _logits(model, ids)).abs().max() > 1e-3


def test_pyvene_restores_a_reft_r1_dictionary_per_concept(tiny_lm_dir, tiny_lm, tmp_path):
    lm_dir, model = tiny_lm_dir("llama"), tiny_lm("llama")
    dictionary = _dictionary(lm_dir, layer=2)
    dictionary.save_pretrained(tmp_path / "dict")
    _export("--artifact", tmp_path / "dict", "--to", "pyvene", "--out", tmp_path / "pv", "--factor", "1.5")
    assert sorted(p.name for p in (tmp_path / "pv").iterdir()) == ["dogs", "rental-services"]
    ids = _ids(model.config.vocab_size, 4)
    every = [list(range(ids.shape[1]))] * len(ids)
    for concept, stem in zip(CONCEPTS, ["dogs", "rental-services"]):
        intervenable = pyvene.IntervenableModel.load(str(tmp_path / "pv" / stem), model)
        _, theirs = intervenable(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, unit_locations={"base": [every]}
        )
        with dictionary.steer(model, concept, factor=1.5):
            ours = _logits(model, ids)
        assert torch.equal(ours, theirs.logits)  # h + α·w, added alike


# --- capabilities and bad input --------------------------------------------------------------------


def test_formats_follow_capabilities():
    das = RotatedSpaceIntervention(HIDDEN, 1)
    dictionary = Dictionary(torch.eye(2, HIDDEN), torch.ones(2), ["a", "b"], "m", 1, "diffmean")
    assert supported_formats(das) == supported_formats(LoReFTIntervention(HIDDEN, 2)) == ["pyvene"]
    assert (
        supported_formats(dictionary)
        == supported_formats(ConceptDictionary(2, HIDDEN))
        == [
            "gguf-control-vector",
            "pyvene",
            "lm-eval",
        ]
    )
    assert supported_formats(LoRAModule) == ["peft"]  # a class answers as its instances do


BAD_INPUT = {  # (format, out): the one error line, {out} standing for the out directory
    ("onnx", "new"): "error: --to 'onnx' is not an export format; formats: peft, gguf-control-vector, pyvene, lm-eval",
    ("gguf-control-vector", "new"): "error: RotatedSpaceIntervention cannot be exported to gguf-control-vector (it "
    "has no steering_vectors()); it can be exported to: pyvene",
    ("pyvene", "theirs"): "error: --out {out} already holds notes.txt, which a pyvene export does not write; give an "
    "empty or new directory",
}


@pytest.mark.parametrize("to,out", list(BAD_INPUT), ids=["unknown-format", "no-capability", "foreign-out-dir"])
def test_bad_input_is_one_line_and_exit_2(tiny_lm_dir, tmp_path, to, out):
    save_pretrained(tmp_path / "das", RotatedSpaceIntervention(HIDDEN, 1), {"model": tiny_lm_dir("llama"), "layer": 1})
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    done = run_command("export", "--artifact", str(tmp_path / "das"), "--to", to, "--out", str(tmp_path / out))
    assert _one_error_line(done) == BAD_INPUT[to, out].format(out=tmp_path / out)
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["notes.txt"] and not (tmp_path / "new").exists()


def test_options_an_artifact_does_not_take_and_layers_a_format_cannot_hold(tiny_lm_dir, tmp_path, capsys):
    lm_dir = tiny_lm_dir("llama")
    save_pretrained(tmp_path / "das", RotatedSpaceIntervention(HIDDEN, 1), {"model": lm_dir, "layer": 1})
    _dictionary(lm_dir, layer=0).save_pretrained(tmp_path / "dict0")
    refused = {
        (tmp_path / "das", "pyvene", "--concept", "dogs"): "--concept does not apply to RotatedSpaceIntervention: "
        "its to_pyvene() takes no concept",
        (tmp_path / "dict0", "gguf-control-vector"): "steering vector 'dogs' acts after block 0; llama.cpp's control "
        "vectors start at block 1 (it refuses direction.0)",
        (tmp_path / "dict0", "pyvene", "--concept", "cats"): "concept 'cats' is not in this dictionary; valid "
        "concepts include 'dogs', 'rental services'",
    }
    for (artifact, to, *options), line in refused.items():
        with pytest.raises(SystemExit) as exit_:
            _export("--artifact", artifact, "--to", to, "--out", tmp_path / "out", *options)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "out").exists()


# --- files -----------------------------------------------------------------------------------------


def test_a_failed_export_keeps_the_files_of_the_last_one(tiny_lm_dir, tmp_path, monkeypatch, capsys):
    """Each file is written beside itself and renamed: a write that fails (one line, exit 1)
    leaves the earlier export's file whole and no temporary file; an export into its own earlier
    output replaces it."""
    _dictionary(tiny_lm_dir("llama")).save_pretrained(tmp_path / "dict")
    args = ("--artifact", tmp_path / "dict", "--to", "gguf-control-vector", "--out", tmp_path / "cv")
    _export(*args)
    before = {p.name: p.read_bytes() for p in (tmp_path / "cv").iterdir()}

    def broken(self):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        _export(*args, "--factor", "2")
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path / 'cv'} could not be written: disk full; no file is left half-written (each is "
        "written beside itself and renamed), fix that and export again\n"
    )
    assert {p.name: p.read_bytes() for p in (tmp_path / "cv").iterdir()} == before
    monkeypatch.undo()
    _export(*args, "--factor", "2")  # replaces its own files
    after = {p.name: p.read_bytes() for p in (tmp_path / "cv").iterdir()}
    assert sorted(after) == sorted(before) and all(after[name] != before[name] for name in after)
