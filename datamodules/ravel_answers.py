"""The frozen LM's answers to RAVEL prompts: the first token of an attribute value, the padded
batch a forward reads, and the cache of the model's argmax next token per prompt on disk
(`AnswerCache`), so each prompt is run once per model.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import torch

from lit_interventions.core.lm import cache_dir
from lit_interventions.core.tokens import pad_batch


class AnswerCache:
    """A frozen LM's argmax next token for each prompt (by token ids), in a JSON file under
    `$LIT_INTERVENTIONS_CACHE/ravel_answers/`: filtering is done once per model, not per run.
    A local model directory is keyed by its path and the time its config was written."""

    def __init__(self, lm: str):
        key = lm
        config = Path(lm) / "config.json"
        if config.exists():
            key = f"{Path(lm).resolve()}@{config.stat().st_mtime_ns}"
        self.path = cache_dir() / "ravel_answers" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        self.answers: dict[str, int] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.dirty = False

    def get(self, ids: list[int]) -> int | None:
        return self.answers.get(",".join(map(str, ids)))

    def put(self, ids: list[int], token: int) -> None:
        self.answers[",".join(map(str, ids))] = int(token)
        self.dirty = True

    def save(self) -> None:
        if self.dirty:  # atomic: a concurrent reader (another DDP rank) sees the old or the new file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.answers))
            os.replace(tmp, self.path)
            self.dirty = False


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
