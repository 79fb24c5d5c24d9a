"""Generate with an artifact applied, beside the same generation without it.

`generate_pair` runs `transformers`' own `generate` twice from one seed: once plain, once inside
`apply` (the intervention is a hook; the sampling loop is transformers'). Chat models get their
chat template (the prompt is the user turn); `span` and `source_span` name a piece of the prompt
or the source whose last token is the position (`span_position`); prompt token indices outside
the prompt are refused before anything generates (`prompt_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lit_interventions.core.positions import Positions, encode_text, span_position
from lit_interventions.inference.apply import apply


def prompt_text(tokenizer, prompt: str, chat: bool | None = None) -> tuple[str, bool]:
    """(the text the LM reads, whether it went through the chat template). `chat` None: the
    template when the tokenizer has one."""
    templated = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if templated and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True, but this tokenizer has no chat template")
    if templated:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True
    return prompt, False


def prompt_positions(
    tokenizer, prompt: str, positions: str | Sequence[int] | Positions | None, span: str | None, chat: bool | None
) -> tuple[dict[str, torch.Tensor], Positions, bool]:
    """(the prompt encoded as the LM reads it, the positions to edit, whether it went through the
    chat template): `span`, when given, is the last token of that piece of the prompt; prompt
    token indices must lie in the prompt (-n..n-1 for n tokens), else one ValueError naming the
    prompt's length. Needs the tokenizer only: `generate` checks its options with it before the
    LM loads."""
    text, templated = prompt_text(tokenizer, prompt, chat)
    enc = encode_text(tokenizer, text, templated)
    if span is not None:
        return enc, Positions("indices", (span_position(tokenizer, text, span, templated),)), templated
    positions, n = Positions.parse(positions), int(enc["input_ids"].shape[1])
    outside = [i for i in positions.indices if not -n <= i < n] if positions.rule == "indices" else []
    if outside:
        raise ValueError(
            f"positions={positions}: {', '.join(map(str, outside))} {'is' if len(outside) == 1 else 'are'} "
            f"outside the prompt, which is {n} tokens "
            f"(positions 0..{n - 1}, or -{n}..-1 from its end)"
        )
    return enc, positions, templated


@torch.no_grad()
def generate_pair(
    lm: nn.Module,
    tokenizer,
    artifacts: Any,
    prompt: str,
    *,
    source: str | torch.Tensor | None = None,
    concept: str | int | None = None,
    factor: float = 1.0,
    positions: str | Sequence[int] | Positions | None = None,
    span: str | None = None,
    source_positions: str | Sequence[int] | Positions | None = "last",
    source_span: str | None = None,
    max_new_tokens: int = 32,
    seed: int = 0,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chat: bool | None = None,
    trust_remote_code: bool = False,
    gate: Any = None,
) -> dict[str, Any]:
    """{"prompt", "unsteered", "steered"} (the continuations, decoded without special tokens)
    and the token counts, from one seed. Options as `apply` (`gate`: conditional steering,
    `inference.gate`); `span` / `source_span` override `positions` / `source_positions` with the
    last token of that text."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    enc, positions, templated = prompt_positions(tokenizer, prompt, positions, span, chat)
    enc = {k: v.to(lm.device) for k, v in enc.items()}
    if source_span is not None and isinstance(source, str):
        source_positions = Positions("indices", (span_position(tokenizer, source, source_span),))
    sampling = {"do_sample": do_sample, **({"temperature": temperature, "top_p": top_p} if do_sample else {})}
    settings = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)

    def run() -> torch.Tensor:
        torch.manual_seed(seed)
        return lm.generate(**enc, **settings)[0, enc["input_ids"].shape[1] :]

    plain = run()
    with apply(
        lm,
        artifacts,
        tokenizer=tokenizer,
        positions=positions,
        source=source,
        source_positions=source_positions,
        concept=concept,
        factor=factor,
        trust_remote_code=trust_remote_code,
        gate=gate,
    ):
        steered = run()
    return {
        "prompt": prompt,
        "unsteered": tokenizer.decode(plain, skip_special_tokens=True),
        "steered": tokenizer.decode(steered, skip_special_tokens=True),
        "prompt_tokens": int(enc["input_ids"].shape[1]),
        "chat_template": templated,
    }
