"""A random-init LM in the shape of a published model, for speed benchmarks where the hub is out
of reach (the issue's GPU run: pythia-1b's configuration). Its tokenizer is an embedded model's,
so the CausalGym templates tokenise as usual; the vocabulary is that tokenizer's.

    python benchmarks/random_lm.py --shape pythia-1b --out /tmp/pythia-1b-random
    python benchmarks/interchange_speed.py --lm /tmp/pythia-1b-random --device cuda --dtype bfloat16

Speed depends on the shape alone, not on the weights; the odds of a random model mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

# EleutherAI's published configurations (config.json on the hub), without the vocabulary size.
SHAPES = {
    "pythia-70m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048),
    "pythia-410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "pythia-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
    "pythia-1.4b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192),
}
PYTHIA = dict(
    rotary_pct=0.25,
    rotary_emb_base=10000,
    use_parallel_residual=True,
    max_position_embeddings=2048,
    layer_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="gelu",
)


def write_random_lm(shape: str, out: Path, tokenizer: str = "smollm2-135m-instruct", seed: int = 0, **override) -> Path:
    """Save a random-init GPT-NeoX model of `shape` (`override` changes fields, e.g. for a test)
    and `tokenizer`'s files to `out`, a directory `--model.lm` and `load_lm` accept."""
    from lit_interventions.core.lm import load_tokenizer

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: choose one of {sorted(SHAPES)}")
    tok = load_tokenizer(tokenizer)
    config = GPTNeoXConfig(
        **{**PYTHIA, **SHAPES[shape], **override},
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="pythia-1b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="an embedded model or a local directory")
    args = parser.parse_args()
    out = write_random_lm(args.shape, args.out, args.tokenizer)
    print(f"wrote {args.shape} (random init) to {out}")


if __name__ == "__main__":
    main()
