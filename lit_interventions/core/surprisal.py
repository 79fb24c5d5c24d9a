"""Region surprisal of a frozen causal LM, in bits.

A sentence is given as a list of regions (strings). It is scored the way SyntaxGym scores it:

1. The sentence is the non-empty regions joined with single spaces, a region made only of
   punctuation (".", ",") too, as syntaxgym-core joins them (`Suite.iter_sentences`: "The
   authors are ."); attach_punctuation=True attaches such a region to the previous one without
   a space instead ("The authors are."). Whitespace inside and around a region collapses to
   single spaces (syntaxgym-core only strips the left: a trailing space would give two).
2. The whole sentence is tokenised once, after a BOS token: the tokenizer's own when it adds
   one (gemma), otherwise the BOS token's text is prepended (pythia, GPT-2, SmolLM2).
3. Token t's surprisal comes from the logits at the previous position:
       s(x_t) = -log2 p(x_t | x_<t) = -log_softmax(logits_{t-1})[x_t] / ln 2
4. A token belongs to the region holding its last non-space character (offsets from
   `return_offsets_mapping=True`); a token of spaces only goes with the next non-space
   character. Special tokens (offsets (0, 0)) and the BOS text belong to no region.
5. A region's surprisal aggregates its tokens:
       sum:  S(r) = sum_{t in r} s(x_t)          (0 for a region without tokens)
       mean: S(r) = S_sum(r) / |r|               (nan for a region without tokens)

Sentences are batched with right padding; position ids come from the attention mask
(`lit_interventions.core.forward.position_ids`), so padding never changes a result. Only the tokens of
the wanted regions go through the LM head (with a 262k vocabulary it costs more than the body).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

import torch

from lit_interventions.core.forward import final_logits, position_ids
from lit_interventions.core.tokens import pad_batch

METRICS = ("sum", "mean")
NO_REGION = -1


@dataclass(frozen=True)
class EncodedSentence:
    """Token ids of one sentence (BOS first) and the region index of each token (-1: none)."""

    text: str
    token_ids: list[int]
    token_regions: list[int]


def is_punctuation(region: str) -> bool:
    """True for a region such as "." or "," (made only of punctuation)."""
    return bool(region) and all(ch in string.punctuation for ch in region)


def join_regions(regions: list[str], attach_punctuation: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The sentence and each region's character span [start, end) in it (empty regions: start == end).
    attach_punctuation: a punctuation-only region follows the previous one without a space."""
    text, spans = "", []
    for region in regions:
        content = " ".join(region.split())
        if content and text and not (attach_punctuation and is_punctuation(content)):
            text += " "
        start = len(text)
        text += content
        spans.append((start, len(text)))
    return text, spans


def bos_prefix(tokenizer) -> str:
    """'' when the tokenizer adds BOS itself, else the BOS token's text to prepend."""
    bos_id = tokenizer.bos_token_id
    if bos_id is not None:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        if ids and ids[0] == bos_id:
            return ""
        return tokenizer.bos_token
    if tokenizer.eos_token is not None:  # GPT-2 style: <|endoftext|> doubles as BOS
        return tokenizer.eos_token
    raise ValueError(
        f"tokenizer {type(tokenizer).__name__} has neither a bos_token nor an eos_token; "
        "the first token's surprisal needs one to condition on"
    )


def _token_region(offset: tuple[int, int], text: str, char_regions: list[int]) -> int:
    """The region of the token's last non-space character (spaces only: the next non-space one)."""
    start, end = offset
    if start == end:
        return NO_REGION  # a special token added by the tokenizer
    for index in range(end - 1, start - 1, -1):
        if not text[index].isspace():
            return char_regions[index]
    for index in range(end, len(text)):
        if not text[index].isspace():
            return char_regions[index]
    return NO_REGION


def encode_regions(tokenizer, regions: list[str], attach_punctuation: bool = False) -> EncodedSentence:
    """Tokenise the joined sentence once (after BOS) and assign each token to a region."""
    sentence, spans = join_regions(regions, attach_punctuation)
    prefix = bos_prefix(tokenizer)
    text = prefix + sentence
    char_regions = [NO_REGION] * len(text)
    for region_index, (start, end) in enumerate(spans):
        for index in range(start, end):
            char_regions[len(prefix) + index] = region_index
    encoding = tokenizer(text, add_special_tokens=not prefix, return_offsets_mapping=True)
    token_ids = list(encoding["input_ids"])
    if not token_ids or token_ids[0] != tokenizer.convert_tokens_to_ids(prefix or tokenizer.bos_token):
        raise ValueError(
            f"the tokenizer did not put a BOS token first in {text!r} (got ids {token_ids[:3]}...); "
            "surprisal needs one token to condition the first word on"
        )
    token_regions = [_token_region(tuple(offset), text, char_regions) for offset in encoding["offset_mapping"]]
    token_regions[0] = NO_REGION
    return EncodedSentence(sentence, token_ids, token_regions)


@torch.no_grad()
def token_surprisals(
    model: torch.nn.Module, token_ids: list[list[int]], pad_id: int, wanted: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """Per-token surprisal in bits for a batch of sentences, s(x_t) = -log2 p(x_t | x_<t).

    `wanted[i]` lists the positions t >= 1 of sentence i to score (default: all of them); the
    others, and t = 0 (nothing precedes it), are nan. The body runs once on the right-padded
    batch (position ids ignore padding) on the device of the LM's embeddings; the LM head
    (`forward.final_logits`, with Gemma's soft-capping) runs only on the hidden states at t - 1 of
    the wanted positions. The surprisals come back on the CPU.
    """
    lengths = [len(ids) for ids in token_ids]
    input_ids, attention_mask, _ = pad_batch(token_ids, pad_id)
    if wanted is None:
        wanted = [list(range(1, length)) for length in lengths]
    rows = torch.tensor([row for row, positions in enumerate(wanted) for _ in positions], dtype=torch.long)
    cols = torch.tensor([t for positions in wanted for t in positions], dtype=torch.long)
    bits = torch.full(input_ids.shape, float("nan"))
    if len(rows):
        if int(cols.min()) < 1 or any(t >= length for positions, length in zip(wanted, lengths) for t in positions):
            raise ValueError(f"wanted positions must lie in 1..length-1 of their sentence, got {wanted}")
        device = model.get_input_embeddings().weight.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        hidden = model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
        ).last_hidden_state
        rows_at, cols_at = rows.to(hidden.device), cols.to(hidden.device)
        logits = final_logits(model, hidden[rows_at, cols_at - 1]).float()  # (wanted tokens, vocab)
        targets = input_ids.to(hidden.device)[rows_at, cols_at, None]
        log_probs = logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)
        bits[rows, cols] = (-log_probs / math.log(2)).cpu()
    return [bits[row, :length] for row, length in enumerate(lengths)]


def aggregate(surprisals: torch.Tensor, token_regions: list[int], num_regions: int, metric: str) -> list[float]:
    """S(r) per region: the sum (or mean) of the surprisals of the tokens assigned to r."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not supported; choose one of {list(METRICS)}")
    totals, counts = [0.0] * num_regions, [0] * num_regions
    for value, region in zip(surprisals.tolist(), token_regions):
        if region != NO_REGION:
            totals[region] += value
            counts[region] += 1
    if metric == "sum":
        return totals
    return [total / count if count else float("nan") for total, count in zip(totals, counts)]


def region_surprisals(
    model: torch.nn.Module,
    tokenizer,
    sentences: list[list[str]],
    metric: str = "sum",
    batch_size: int = 16,
    wanted_regions: list[set[int]] | None = None,
    attach_punctuation: bool = False,
) -> list[list[float]]:
    """S(r) in bits for the regions of every sentence (a sentence is its list of regions).

    `wanted_regions[i]` holds the region indices (0-based) of sentence i to score (default: all);
    only their tokens go through the LM head, and the other regions come back as nan.
    attach_punctuation: join a punctuation-only region without a space (`join_regions`).
    Sentences are sorted by length before batching, so a batch carries little padding.
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not supported; choose one of {list(METRICS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be a positive integer")
    if wanted_regions is None:
        wanted_regions = [set(range(len(regions))) for regions in sentences]
    encoded = [encode_regions(tokenizer, regions, attach_punctuation) for regions in sentences]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = sorted(range(len(encoded)), key=lambda index: len(encoded[index].token_ids))
    results: list[list[float]] = [[] for _ in sentences]
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        wanted = [
            [t for t, region in enumerate(encoded[index].token_regions) if region in wanted_regions[index]]
            for index in batch
        ]
        bits = token_surprisals(model, [encoded[index].token_ids for index in batch], pad_id, wanted)
        for index, values in zip(batch, bits):
            per_region = aggregate(values, encoded[index].token_regions, len(sentences[index]), metric)
            results[index] = [
                value if region in wanted_regions[index] else float("nan") for region, value in enumerate(per_region)
            ]
    return results
