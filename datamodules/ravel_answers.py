"""The frozen LM's answers to RAVEL prompts: the tokens of an attribute value, the model's greedy
answer (n tokens, `greedy_tokens`) and when it is right (`answer_hit`), the value a generation
names (`named_value`), and the cache of the model's answers per prompt on disk (`AnswerCache`),
so each prompt is run once per model.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_interventions.core.forward import cache_keyword, logits_at
from lit_interventions.core.model_cache import cache_dir
from lit_interventions.core.tokens import pad_batch


class AnswerCache:
    """A frozen LM's greedy answer of `n` tokens to each prompt (by token ids), in a JSON file
    under `$LIT_INTERVENTIONS_CACHE/ravel_answers/` (one file per model and n; n = 1 holds the
    argmax next token): filtering is done once per model, not per run. A local model directory
    is keyed by its path and the time its config was written."""

    def __init__(self, lm: str, n: int = 1):
        key = lm
        config = Path(lm) / "config.json"
        if config.exists():
            key = f"{Path(lm).resolve()}@{config.stat().st_mtime_ns}"
        name = hashlib.sha256(key.encode()).hexdigest()[:20] + ("" if n == 1 else f"-{n}tokens")
        self.path = cache_dir() / "ravel_answers" / f"{name}.json"
        self.answers: dict[str, int | list[int]] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.dirty = False

    def get(self, ids: list[int]) -> list[int] | None:
        found = self.answers.get(",".join(map(str, ids)))
        return [found] if isinstance(found, int) else found

    def put(self, ids: list[int], tokens: list[int]) -> None:
        tokens = [int(t) for t in tokens]
        self.answers[",".join(map(str, ids))] = tokens[0] if len(tokens) == 1 else tokens
        self.dirty = True

    def fill(self, queries: list, predict, batch: int = 64) -> None:
        """The answers of the `queries` (anything with `ids`) not cached yet, from
        `predict(chunk) -> [tokens]`, `batch` at a time, shortest first (little padding)."""
        todo = sorted({tuple(q.ids): q for q in queries if self.get(q.ids) is None}.values(), key=lambda q: len(q.ids))
        for k in range(0, len(todo), batch):
            chunk = todo[k : k + batch]
            for q, tokens in zip(chunk, predict(chunk)):
                self.put(q.ids, tokens)

    def save(self) -> None:
        if self.dirty:  # atomic: a concurrent reader (another DDP rank) sees the old or the new file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.answers))
            os.replace(tmp, self.path)
            self.dirty = False


@torch.no_grad()
def greedy_tokens(model, seqs: list[list[int]], pad_id: int, n: int) -> list[list[int]]:
    """The model's n greedy tokens after each prompt. n = 1: one batched forward, logits at each
    row's last token (right padding). n > 1: the prompts left-padded, then one token per step
    with the keys and values kept (logits at the last column only)."""
    if n == 1:
        ids, mask = _right_pad(seqs, pad_id, model.device)
        return logits_at(model, ids, mask, mask.sum(-1) - 1).argmax(-1)[:, None].tolist()
    ids, mask, _ = pad_batch(seqs, pad_id, "left")
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    steps = [out.logits[:, -1].argmax(-1)]
    for _ in range(1, n):
        mask = F.pad(mask, (0, 1), value=1)
        positions = positions[:, -1:] + 1
        keyword = cache_keyword(type(model))
        out = model(
            input_ids=steps[-1][:, None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{keyword: getattr(out, keyword)},
        )
        steps.append(out.logits[:, -1].argmax(-1))
    return torch.stack(steps, 1).tolist()


def answer_hit(generated, label) -> bool:
    """Whether a generation starts with the label's tokens (the official `compute_metrics`: each
    of the label's first n tokens equals the generated token at its place)."""
    return len(generated) >= len(label) and tuple(generated[: len(label)]) == tuple(label)


def named_value(generated, values) -> tuple[int, ...]:
    """The answer a generation gives: the longest of `values` (token tuples) it starts with, else
    the generation itself."""
    named = [v for v in values if answer_hit(generated, v)]
    return max(named, key=len) if named else tuple(generated)


@lru_cache(maxsize=65536)
def _value_tokens(tokenizer, text: str, n: int) -> tuple[int, ...]:
    """The first n token ids of `text` (no special tokens); a ValueError when it tokenises to nothing."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"Value {text!r} tokenises to nothing")
    return tuple(ids[:n])


@lru_cache(maxsize=65536)
def _first_token(tokenizer, text: str) -> int:
    """The first token id of `text` (no special tokens); a ValueError when it tokenises to nothing."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"Value {text!r} tokenises to nothing")
    return ids[0]


def _right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of `seqs` padded on the right, on `device`."""
    ids, mask, _ = pad_batch(seqs, pad_id)
    return ids.to(device), mask.to(device)
