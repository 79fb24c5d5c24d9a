"""Shared fixtures: tiny random-init LMs of several architectures, saved as local directories with
a small byte-level BPE tokenizer trained offline on our template words."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lit_interventions.datamodules.templates import BUILTIN_TEMPLATES
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
)

HIDDEN, LAYERS = 32, 3

# Under pytest-xdist each worker, and every command its tests start (they inherit OMP_NUM_THREADS),
# runs torch on its share of the cores: threads that outnumber the cores spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    THREADS = max(1, CORES // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


def _corpus() -> list[str]:
    words = []

    def walk(value):
        if isinstance(value, str):
            words.extend([value, " " + value])
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(json.loads(BUILTIN_TEMPLATES.read_text()))
    return words + [" dog", " give", "The dog is here."] * 3


@pytest.fixture(scope="session")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_config(arch: str, vocab_size: int):
    common = dict(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **common,
        )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            max_position_embeddings=128,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128, **common)
    if arch == "gemma2":
        return Gemma2Config(
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            **common,
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            sliding_window=16,
            **common,
        )
    if arch == "opt":  # an inline MLP: fc1 and fc2 on the decoder layer, no MLP module
        return OPTConfig(
            hidden_size=HIDDEN,
            ffn_dim=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            word_embed_proj_dim=HIDDEN,
            max_position_embeddings=128,
            **common,
        )
    raise ValueError(arch)


ARCHS = ["llama", "gpt_neox", "gpt2", "gemma2", "gemma3"]


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory, tokenizer):
    """arch -> a local directory holding a tiny random-init model and the tokenizer."""
    made = {}

    def make(arch: str) -> str:
        if arch not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer)))
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[arch] = str(path)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_lm(tiny_lm_dir):
    """arch -> a frozen tiny model (loaded through lit_interventions.core.lm, like a user's model)."""
    from lit_interventions.core.lm import load_lm

    return lambda arch: load_lm(tiny_lm_dir(arch))
