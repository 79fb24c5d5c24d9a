"""Formatting AxBench rows for the LM: a chat turn (or `instruction\\n\\nresponse`) tokenised
with the response located, the chat prefix every prompt starts with, and the collate function
that pads examples into a batch with its masks and labels (see `collate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from lit_interventions.datamodules.axbench_files import CATEGORIES, EVAL_LABELS, NEGATIVE_POOL

from lit_interventions.core.surprisal import bos_prefix


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def split_chat(tokenizer, instruction: str, response: str) -> tuple[str, str, str]:
    """(prompt, response, end) texts of one chat turn; prompt + response + end is the chat template's
    rendering. The prompt is the template's generation prompt, checked to be a prefix of the turn."""
    user = [{"role": "user", "content": instruction}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError(
            f"The chat template of {type(tokenizer).__name__} renders the prompt of {instruction[:60]!r} differently "
            "with and without the reply, so the response cannot be located; pass chat_template=False"
        )
    rest = full[len(prompt) :]
    text = response if response in rest else response.strip()  # some templates trim the content
    start = rest.find(text)
    if not text or start < 0:
        raise ValueError(
            f"The chat template does not render the response {response[:60]!r} verbatim; pass chat_template=False"
        )
    return prompt + rest[:start], text, rest[start + len(text) :]


def prompt_text(tokenizer, instruction: str, chat: bool) -> str:
    """The text a row's response continues: the chat template's generation prompt, or
    `instruction\\n\\n` after the BOS text (as `encode` formats a row)."""
    if chat:
        user = [{"role": "user", "content": instruction}]
        return tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    return bos_prefix(tokenizer) + instruction + "\n\n"


@dataclass
class Example:
    """One formatted row: its token ids, where its response lies, and its labels."""

    ids: list[int]
    response_start: int  # first response token
    output_end: int  # one past the last token of the output text
    response_end: int  # one past the end-of-turn token (== output_end when there is none)
    concept_id: int
    label: int
    category: int
    truncated: bool = False
    prefix: int = 0  # the chat-prefix tokens (BOS, template) the ids start with


def encode(
    tokenizer, instruction: str, response: str, chat: bool, max_length: int, end_of_turn: bool
) -> tuple[list[int], list[int], list[int], bool]:
    """Token ids of (prompt, response truncated to fit max_length, end-of-turn token or []), truncated?"""
    if chat:
        prompt, text, end = split_chat(tokenizer, instruction, response)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        end_ids = tokenizer(end, add_special_tokens=False)["input_ids"][:1]
        if end_ids and end_ids[0] not in tokenizer.all_special_ids:
            end_ids = []
    else:
        prompt_ids = tokenizer(bos_prefix(tokenizer) + instruction + "\n\n")["input_ids"]
        text = response
        end_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    response_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not end_of_turn:
        end_ids = []
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"The prompt of {instruction[:60]!r} is {len(prompt_ids)} tokens, leaving no room for a response "
            f"within max_length={max_length}; raise max_length"
        )
    truncated = len(response_ids) + len(end_ids) > room
    if truncated:  # a truncated response has no end-of-turn token
        response_ids, end_ids = response_ids[:room], []
    return prompt_ids, response_ids, end_ids, truncated


def chat_prefix(tokenizer, chat: bool, max_length: int = 10_000) -> list[int]:
    """The token ids every formatted prompt starts with (AxBench's `get_prefix_length`: the
    common start of the prompts of the instructions "1" and "2"): BOS and the chat template's
    system turn and user header; BOS alone without a chat template."""
    a = encode(tokenizer, "1", "x", chat, max_length, False)[0]
    b = encode(tokenizer, "2", "x", chat, max_length, False)[0]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def common_length(ids: list[int], prefix: list[int]) -> int:
    """How many leading tokens `ids` shares with `prefix`."""
    n = 0
    while n < min(len(ids), len(prefix)) and ids[n] == prefix[n]:
        n += 1
    return n


def tokenize_rows(
    rows: pd.DataFrame,
    tokenizer,
    chat: bool,
    max_length: int,
    end_of_turn: bool,
    concept_index: dict[int, int],
    labels: dict[str, int] | None = None,
) -> list[Example]:
    """The examples of `rows`, each encoded (`encode`), its concept id an index into the selected
    concepts (`concept_index`; -1: the pool), its label `labels[category]` (default: 1 for a
    positive, else 0; `EVAL_LABELS` for the eval split) and its chat prefix recorded."""
    labels = EVAL_LABELS["negative"] if labels is None else labels
    examples = []
    prefix = chat_prefix(tokenizer, chat, max_length)
    for instruction, response, category, concept in zip(
        rows["input"], rows["output"], rows["category"], rows["concept_id"]
    ):
        prompt_ids, response_ids, end_ids, truncated = encode(
            tokenizer, instruction, response, chat, max_length, end_of_turn
        )
        start = len(prompt_ids)
        examples.append(
            Example(
                ids=prompt_ids + response_ids + end_ids,
                response_start=start,
                output_end=start + len(response_ids),
                response_end=start + len(response_ids) + len(end_ids),
                concept_id=concept_index.get(int(concept), NEGATIVE_POOL),
                label=labels[category],
                category=CATEGORIES[category],
                truncated=truncated,
                prefix=min(common_length(prompt_ids, prefix), len(prompt_ids) - 1),
            )
        )
    return examples


def collate(examples: list[Example], pad_id: int, padding_side: str = "right") -> dict:
    """Pad to the longest example. `response_mask` is the LM loss mask (response + end-of-turn token);
    `output_mask` covers the response text only; `content_mask` every token after the chat prefix;
    `token_labels` is the concept id on the response
    text of positives, -1 elsewhere. `label` is 1 for a positive, 0 for a negative and −1 for a row
    left out of the AUROC (`EVAL_LABELS`). `keys` are the unpadded ids and first real positions, for
    `ActivationCache`."""
    width = max(len(e.ids) for e in examples)
    shape = (len(examples), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    response_mask = torch.zeros(shape, dtype=torch.long)
    output_mask = torch.zeros(shape, dtype=torch.long)
    content_mask = torch.zeros(shape, dtype=torch.long)
    token_labels = torch.full(shape, NEGATIVE_POOL, dtype=torch.long)
    starts = []
    for i, e in enumerate(examples):
        offset = width - len(e.ids) if padding_side == "left" else 0
        ids[i, offset : offset + len(e.ids)] = torch.tensor(e.ids)
        attention_mask[i, offset : offset + len(e.ids)] = 1
        response_mask[i, offset + e.response_start : offset + e.response_end] = 1
        output_mask[i, offset + e.response_start : offset + e.output_end] = 1
        content_mask[i, offset + e.prefix : offset + len(e.ids)] = 1
        if e.label == 1:
            token_labels[i, offset + e.response_start : offset + e.output_end] = e.concept_id
        starts.append(offset)
    return {
        "input_ids": ids,  # (batch, seq)
        "attention_mask": attention_mask,  # (batch, seq)
        "response_mask": response_mask,  # (batch, seq)
        "output_mask": output_mask,  # (batch, seq)
        "content_mask": content_mask,  # (batch, seq)
        "token_labels": token_labels,  # (batch, seq)
        "concept_id": torch.tensor([e.concept_id for e in examples], dtype=torch.long),  # (batch,)
        "label": torch.tensor([e.label for e in examples], dtype=torch.long),  # (batch,)
        "category": torch.tensor([e.category for e in examples], dtype=torch.long),  # (batch,)
        "keys": ([tuple(e.ids) for e in examples], starts),
    }


def collate_preference(pairs: list[tuple[Example, Example]], pad_id: int, padding_side: str = "right") -> dict:
    """A batch of n preference examples (concept response, original response) of one instruction
    each: rows 0..n−1 the concept responses, n..2n−1 the original ones, padded together
    (`collate`), with `pairs` = n."""
    batch = collate([c for c, _ in pairs] + [o for _, o in pairs], pad_id, padding_side)
    batch["pairs"] = len(pairs)
    return batch
