"""Which token positions an applied intervention edits, while `transformers` generates.

A rule names positions of the prompt and of the tokens generated after it:

    rule        edits
    site        the artifact's own rule: every position for steering artifacts (dictionaries,
                LoReFT, LoRA: they are trained and steer that way), the prompt's last token for
                interchange artifacts
    all         every position, prompt and generated
    prompt      every token of the prompt
    generated   every generated token (the hidden state of each new token as it is fed back)
    last        the prompt's last token
    0,3,-1      these prompt tokens (negative: counted from the prompt's end)
    f5+l5       the prompt's first 5 and last 5 tokens (AxBench's and pyreft's `fN+lM`, also `fN`,
                `lM`), each count capped at half the prompt's length (`prompt_ends`)

A text is encoded as the LM reads it (`encode_text`: after a BOS); `span_position(tokenizer,
text, span)` turns a piece of it into its last token's index, through the tokenizer's character
offsets (any fast tokenizer).

`PositionTracker` follows one LM through `generate`: a pre-forward hook reads how many positions
the cache already holds (`cache.get_seq_length()`), so each forward's chunk (the prompt, then one
token at a time) is placed at its absolute positions; a forward without a cache that starts with
the prompt it saw last (`use_cache=False`) is the same sequence grown by one. Rows padded on the
left are placed by their attention mask: prompt index i of a row is its first real token + i.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.core.tokens import token_covering

RULES = ("site", "all", "prompt", "generated", "last")
ENDS = "ends"  # the rule of `fN+lM`: indices are (N, M)
_ENDS = re.compile(r"^(?:f(\d+)(?:\+l(\d+))?|l(\d+))$")
_HELP = "use one of {}, fN+lM (first N and last M prompt tokens) or token indices such as 0,3,-1".format(
    ", ".join(RULES)
)


def parse_ends(text: str) -> tuple[int, int] | None:
    """(N, M) of "fN+lM", "fN" or "lM" (M or N 0); None for any other text."""
    match = _ENDS.match(text.strip())
    if match is None:
        return None
    first, last, only_last = match.groups()
    return (int(first), int(last or 0)) if first is not None else (0, int(only_last))


def prompt_ends(
    first: torch.Tensor, end: torch.Tensor, n_first: int, n_last: int, absolute: torch.Tensor
) -> torch.Tensor:
    """(batch, width) bool: the `absolute` positions, (batch, width), among the first
    f = min(n // 2, n_first) and the last l = min(n // 2, n_last) tokens of each row's prompt
    [first, end), n = end − first, (batch,) each. pyreft's `get_intervention_locations` with
    `share_weights` (AxBench's LoReFT): positions 0..f−1 and n−l..n−1 of the prompt, disjoint."""
    half = (end - first) // 2
    f, ell = half.clamp(max=n_first)[:, None], half.clamp(max=n_last)[:, None]
    start, stop = first[:, None], end[:, None]
    return ((absolute >= start) & (absolute < start + f)) | ((absolute >= stop - ell) & (absolute < stop))


@dataclass(frozen=True)
class Positions:
    """A position rule (`RULES`), prompt token indices (`rule` "indices") or the prompt's ends
    (`rule` `ENDS`, indices (N, M): "fN+lM")."""

    rule: str = "site"
    indices: tuple[int, ...] = ()

    @classmethod
    def parse(cls, value: str | int | Sequence[int] | Positions | None) -> Positions:
        """A rule name, "0,3,-1", an int or a list of ints; None is "site"."""
        if value is None:
            return cls()
        if isinstance(value, Positions):
            return value
        if isinstance(value, bool):
            raise ValueError(f"positions={value!r}; {_HELP}")
        if isinstance(value, int):
            return cls("indices", (value,))
        if isinstance(value, str):
            text = value.strip()
            if text in RULES:
                return cls(text)
            if (ends := parse_ends(text)) is not None:
                if not any(ends):
                    raise ValueError(f"positions={value!r} selects no token; {_HELP}")
                return cls(ENDS, ends)
            try:
                indices = tuple(int(part) for part in text.split(","))
            except ValueError:
                raise ValueError(f"positions={value!r}; {_HELP}") from None
            return cls("indices", indices)
        if isinstance(value, Sequence) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            return cls("indices", tuple(value))
        raise ValueError(f"positions={value!r}; {_HELP}")

    def resolved(self, site_rule: str) -> Positions:
        """This rule with "site" replaced by the artifact's own rule `site_rule`."""
        return Positions.parse(site_rule) if self.rule == "site" else self

    def __str__(self) -> str:
        if self.rule == ENDS:
            return f"f{self.indices[0]}+l{self.indices[1]}"
        return ",".join(map(str, self.indices)) if self.rule == "indices" else self.rule


def model_text(tokenizer, text: str, templated: bool = False) -> str:
    """The string the LM reads for `text`: a chat-templated text as it is, any other after the
    BOS the tokenizer does not add itself (`bos_prefix`)."""
    return text if templated else bos_prefix(tokenizer) + text


def encode_text(tokenizer, text: str, templated: bool = False) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask, (1, seq), of `model_text(text)` (special tokens added
    unless templated: the template writes its own)."""
    return dict(
        tokenizer(model_text(tokenizer, text, templated), return_tensors="pt", add_special_tokens=not templated)
    )


def span_position(tokenizer, text: str, span: str, templated: bool = False, occurrence: int = -1) -> int:
    """The index, in `encode_text(text)`, of the last token of `span` in `text`, found through the
    tokenizer's character offsets. `occurrence`: which occurrence of `span` (-1: the last)."""
    starts, at = [], text.find(span)
    while span and at != -1:
        starts.append(at)
        at = text.find(span, at + 1)
    if not starts:
        raise ValueError(f"span {span!r} does not occur in {text!r}")
    if not -len(starts) <= occurrence < len(starts):
        raise ValueError(
            f"span {span!r} occurs {len(starts)} times in {text!r}; occurrence={occurrence} is out of range"
        )
    full = model_text(tokenizer, text, templated)
    end = len(full) - len(text) + starts[occurrence] + len(span) - 1
    offsets = tokenizer(full, return_offsets_mapping=True, add_special_tokens=not templated)["offset_mapping"]
    return token_covering([tuple(o) for o in offsets], end, full)


class PositionTracker:
    """Where each forward of `model` is in its sequence, for `mask` (see the module doc);
    `enabled`: None, or a bool per batch row (rows with False are never chosen)."""

    def __init__(self, enabled: Sequence[bool] | None = None):
        self.enabled = None if enabled is None else torch.as_tensor(list(enabled), dtype=torch.bool)  # rows edited
        self.past = 0  # positions before this forward's chunk
        self.width = 0  # the chunk's length
        self.prompt_ids: torch.Tensor | None = None
        self.first = self.last = torch.zeros(0, dtype=torch.long)  # each row's first / last prompt token

    @contextmanager
    def following(self, model: nn.Module) -> Iterator[PositionTracker]:
        """Track `model`'s forwards inside the block."""
        handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def _before_forward(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2])
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
        if past == 0 and self._continues(ids):
            past = 0  # the whole sequence again (no cache): positions count from 0, the prompt is kept
        elif past == 0:
            self._new_prompt(ids, kwargs.get("attention_mask"), shape)
        self.past, self.width = past, shape[1]

    def _continues(self, ids: torch.Tensor | None) -> bool:
        prompt = self.prompt_ids
        if ids is None or prompt is None or ids.shape[0] != prompt.shape[0] or ids.shape[1] <= prompt.shape[1]:
            return False
        return bool(torch.equal(ids[:, : prompt.shape[1]].to(prompt.device), prompt))

    def _new_prompt(self, ids: torch.Tensor | None, mask: torch.Tensor | None, shape: tuple[int, int]) -> None:
        batch, width = shape
        if mask is None or mask.dim() != 2:
            mask = torch.ones(batch, width, dtype=torch.long)
        mask = mask.detach().cpu().long()
        self.first = mask.argmax(1)  # the first real token (left padding)
        self.last = width - 1 - mask.flip(1).argmax(1)  # the last real token (right padding)
        self.prompt_ids = ids.detach().cpu() if ids is not None else None

    def mask(self, positions: Positions, batch: int, device: torch.device) -> torch.Tensor:
        """(batch, chunk) bool: which positions of the current chunk `positions` edits (in the
        rows `enabled` leaves on)."""
        if positions.rule == "site":
            raise ValueError("positions 'site' must be resolved against an artifact first")
        absolute = torch.arange(self.past, self.past + self.width)[None, :].expand(batch, -1)
        first, last = self._rows(self.first, batch)[:, None], self._rows(self.last, batch)[:, None]
        if positions.rule == "all":
            chosen = torch.ones_like(absolute, dtype=torch.bool)
        elif positions.rule == "prompt":
            chosen = (absolute >= first) & (absolute <= last)
        elif positions.rule == "generated":
            chosen = absolute > last
        elif positions.rule == "last":
            chosen = absolute == last
        elif positions.rule == ENDS:  # prompt tokens only: a generated token is never chosen
            chosen = prompt_ends(first[:, 0], last[:, 0] + 1, *positions.indices, absolute)
        else:
            chosen = torch.zeros_like(absolute, dtype=torch.bool)
            for index in positions.indices:
                at = first + index if index >= 0 else last + 1 + index
                chosen |= (absolute == at) & (at >= first) & (at <= last)
        if self.enabled is not None:  # rows switched off are left unedited
            chosen &= self._rows(self.enabled, batch)[:, None]
        return chosen.to(device)

    def _rows(self, values: torch.Tensor, batch: int) -> torch.Tensor:
        if len(values) == batch:
            return values
        if len(values) == 1 or not len(values):  # num_return_sequences / beams expand one prompt
            return (values if len(values) else torch.zeros(1, dtype=torch.long)).expand(batch)
        return values.repeat_interleave(batch // len(values))
