"""Small token-level helpers every data path shares: which token holds a character, and padding
a batch of token-id lists."""

from __future__ import annotations

import torch


def token_covering(offsets: list[tuple[int, int]], char_index: int, text: str = "") -> int:
    """The index of the token that holds character `char_index`: the last non-empty token that
    starts at or before it (the token containing it when there is one; a byte-level BPE's several
    tokens of one character share its offsets, and the last of them is taken)."""
    covering = [i for i, (start, end) in enumerate(offsets) if end > start and start <= char_index]
    if not covering:
        raise ValueError(f"No token covers character {char_index} of {text!r}")
    return covering[-1]


def pad_batch(
    seqs: list[list[int]], pad_id: int, side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, shift): the sequences padded to the longest on `side`, (batch, width),
    and each row's offset of its first real token, (batch,) (0 unless padded on the left)."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side={side!r}; choose 'left' or 'right'")
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    shift = torch.zeros(len(seqs), dtype=torch.long)
    for i, seq in enumerate(seqs):
        offset = width - len(seq) if side == "left" else 0
        ids[i, offset : offset + len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, offset : offset + len(seq)] = 1
        shift[i] = offset
    return ids, mask, shift
