"""Greedy answers of an intervened model: RAVEL's accuracy reads n generated tokens (n = 3, the
official `eval_with_interventions`, pyvene's `generate` with `intervene_on_prompt=True`).

The site is in the prompt, so `greedy_answers` runs, every step, the base extended by the tokens
generated so far, with the same intervention at the same site: under causal attention the
intervened state at the site is the one the first step wrote, and every later token reads it, as
a generation that keeps the intervened prompt's keys and values does. Each step is one batched
forward (`intervened_logits`, the module's own path: cache, composed sites), logits at the last
token only. A module with the activation cache at one block-output site keeps those keys and
values instead and runs each later token as one column (`SiteModule.intervened_answers`,
`core.forward.greedy_at`): the same tokens, tested against this loop.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from lit_interventions.core.batch import PairBatch, Side


def answer_length(batch: PairBatch) -> int:
    """How many tokens an answer of this batch has: the width of its `answers` (1 without)."""
    return 1 if batch.answers is None else batch.answers.shape[-1]


def extend(side: Side, tokens: torch.Tensor) -> Side:
    """`side` with one token per row, (batch,), written after each row's last real token (one
    column added on the right: a right-padded row's token goes where its padding began)."""
    ids = F.pad(side.input_ids, (0, 1))
    mask = F.pad(side.attention_mask, (0, 1))
    rows = torch.arange(len(ids), device=ids.device)
    at = side.last + 1  # (batch,)
    ids[rows, at] = tokens.to(ids.dtype)
    mask[rows, at] = 1
    return replace(side, input_ids=ids, attention_mask=mask, last=at)


@torch.no_grad()
def greedy_answers(module, batch: PairBatch, first: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
    """(batch, n) the greedy tokens of p_{f←f*}(· | b, s), n = `answer_length(batch)` by default.
    `first`: the intervened logits at the base's last token, if already computed (step 1)."""
    n = answer_length(batch) if n is None else n
    logits = module.intervened_logits(batch) if first is None else first
    tokens = [logits.argmax(-1)]
    base = batch.base
    for _ in range(1, n):
        base = extend(base, tokens[-1])
        tokens.append(module.intervened_logits(replace(batch, base=base)).argmax(-1))
    return torch.stack(tokens, 1)
