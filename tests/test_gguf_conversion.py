"""The GGUF conversion (`lm.convert_gguf`) on a tiny llama GGUF written here (Q8_0, Q4_1 and F32
tensors, a byte-level BPE vocabulary): it shows its progress on stderr from its first line, parses
the file once, leaves gguf and transformers as it found them, and writes the tensors and
tokenizer that transformers' own loader makes of the file, bit for bit. The embedded models'
conversions are checked the same way in the slow test."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as hf_gguf

from lit_interventions.core import lm, model_cache
from lit_interventions.core.progress import ENV
from tests.test_study_progress import _levels

LAYERS = 2
TENSORS = 1 + 9 * LAYERS + 1  # token_embd, 9 per block, output_norm (the output is tied)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, hidden: int = 64, ffn: int = 128, heads: int = 4, kv_heads: int = 2) -> Path:
    """A 2-layer llama GGUF with seeded random weights, in the tensor types of the embedded
    SmolLM2 file (Q4_1 attention, Q8_0 elsewhere, F32 norms) and a gpt2-style vocabulary."""
    rng = np.random.default_rng(0)
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens = ["<|endoftext|>", *_byte_level_alphabet(), *(m.replace(" ", "") for m in merges)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    q8, q4, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32

    def tensor(name: str, shape: tuple[int, ...], kind=q8) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == f32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    tensor("token_embd.weight", (len(tokens), hidden))
    kv = hidden * kv_heads // heads
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), f32)
        for part, rows in (("q", hidden), ("k", kv), ("v", kv), ("output", hidden)):
            tensor(f"blk.{i}.attn_{part}.weight", (rows, hidden), q4)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), f32)
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,), f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _reference(path: Path):
    """(state dict, tokenizer) as transformers' own GGUF loader makes them, nothing of ours around it."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.state_dict(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same_as_reference(converted: Path, path: Path) -> None:
    """Every tensor of the converted safetensors equals the reference's, bit for bit (tied
    weights are saved once), and the tokenizers give the same ids."""
    state, tokenizer = _reference(path)
    saved = load_file(converted / "model.safetensors")
    assert set(saved) <= set(state) and len(saved) >= len(state) - 1
    for name, tensor in saved.items():
        expected = state[name]
        assert tensor.dtype == expected.dtype == torch.float32 and tensor.shape == expected.shape, name
        assert torch.equal(tensor.view(torch.int32), expected.contiguous().view(torch.int32)), name
    text = "the tea at the theatre\nis hot"
    assert AutoTokenizer.from_pretrained(converted)(text).input_ids == tokenizer(text).input_ids


def test_the_conversion_shows_its_steps_on_stderr_from_its_first_line(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(ENV, "0")  # a line at every update
    target = lm.convert_gguf(tiny_gguf)
    out, err = capsys.readouterr()
    assert out == ""  # stdout is a command's result (export's paths, generate's text)
    lines = err.splitlines()
    assert lines[0] == f"converting tiny.gguf to safetensors once ({lm.CONVERSION_TIME}), cached in {target}"
    assert re.fullmatch(r"converted tiny\.gguf in \d+ s", lines[-1])
    shown = [_levels(line) for line in lines[1:-1]]
    assert all(levels and len(levels) == 1 for levels in shown), err
    steps = [(level["n"], level["note"]) for (level,) in shown]
    assert steps[0] == ("0", lm.READING) and shown[0][0]["desc"] == "converting tiny.gguf"
    assert [int(n) for n, _ in steps] == sorted(int(n) for n, _ in steps)  # the share done only rises
    share = dict(zip(lm.CONVERSION_SHARES, np.cumsum(list(lm.CONVERSION_SHARES.values())).tolist()))
    building = f"building the model; {TENSORS} tensors to dequantize"
    assert steps[1] == (str(share["metadata"]), building)  # each line: the step under way, the share before it
    sizes = np.cumsum([int(t.n_elements) for t in gguf.GGUFReader(tiny_gguf).tensors])
    assert len(sizes) == TENSORS
    dequantizing, last = [], share["model"]  # the tensors' share grows with their elements: a line per whole %
    for i, done in enumerate(sizes, 1):
        n = share["model"] + lm.CONVERSION_SHARES["tensors"] * int(done) // int(sizes[-1])
        if n != last:
            dequantizing.append(
                (str(n), f"dequantizing tensor {i + 1}/{TENSORS}" if i < TENSORS else "loading the weights")
            )
        last = n
    assert len(dequantizing) >= 5 and dequantizing[-1][0] == str(share["tensors"])
    assert steps[2 : 2 + len(dequantizing)] == dequantizing
    assert steps[2 + len(dequantizing) :] == [
        (str(share["tensors"]), "building the tokenizer"),
        (str(share["tokenizer"]), "writing model.safetensors"),
        (str(share["writing"]), "hashing the files for the manifest"),
        ("100", "done"),
    ]
    assert all(level["eta"] != "?" for (level,) in shown[1:])
    assert model_cache.check_converted(target) is None


def test_the_file_is_parsed_once_and_gguf_and_transformers_are_left_as_found(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    parsed = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(Path(path).name)
            super().__init__(path, mode)

    class CountedPlain(lm._PlainGGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(f"plain {Path(path).name}")
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    monkeypatch.setattr(lm, "_PlainGGUFReader", CountedPlain)
    found = (gguf.GGUFReader, gguf.dequantize, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm)
    lm.convert_gguf(tiny_gguf)
    assert parsed == ["plain tiny.gguf"]  # transformers alone: three times (config, weights, tokenizer)
    assert (gguf.GGUFReader, gguf.dequantize, gguf.get_tensor_name_map) == found[:3]
    assert (hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm) == found[3:]
    _reference(tiny_gguf)
    assert parsed.count("tiny.gguf") == 3


def test_the_converted_tensors_and_tokenizer_equal_transformers_own(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    _assert_same_as_reference(lm.convert_gguf(tiny_gguf), tiny_gguf)


def test_a_failed_conversion_restores_gguf_and_leaves_no_staging(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    found = (gguf.GGUFReader, gguf.dequantize, hf_gguf.load_gguf_checkpoint)

    def broken(*args, **kwargs):
        raise RuntimeError("no tokenizer today")

    monkeypatch.setattr(lm.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="no tokenizer today"):
        lm.convert_gguf(tiny_gguf)
    assert (gguf.GGUFReader, gguf.dequantize, hf_gguf.load_gguf_checkpoint) == found
    assert not list((tmp_path / "cache").glob(".converting-*")) and not list((tmp_path / "cache").glob("tiny-*"))


# smollm2 alone (23 s): gemma-3-270m takes the same path at 4x the cost (its 236 tensors, config and
# tokenizer were checked equal once, docs/models.md); the suite stays within its time.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct"])
def test_an_embedded_model_converts_to_transformers_own_weights_bit_for_bit(name, tmp_path, monkeypatch):
    gguf_file = lm._embedded_gguf(name)  # the gemma file is assembled in the real cache, if not there
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))  # a fresh conversion
    _assert_same_as_reference(lm.convert_gguf(gguf_file), gguf_file)


def test_with_progress_off_the_first_and_last_lines_remain_on_stderr(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(ENV, "off")  # progress off: the first and last lines remain
    target = lm.convert_gguf(tiny_gguf)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0].endswith(f"cached in {target}")
    assert len(err.splitlines()) == 2 and err.splitlines()[1].startswith("converted tiny.gguf in ")
