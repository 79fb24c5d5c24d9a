"""AxBench concept data: chat-formatted instruction + response pairs per concept.

Layout (the published AxBench one, parquet or our JSONL): a concept directory holds
`train_data.*` (72 positives per concept and a shared negative pool with concept_id -1),
`latent_eval_data.*` (per concept: positives, negatives and hard negatives, each row carrying the
concept id it is evaluated for) and `metadata.jsonl` ({concept_id, concept, ref,
concept_genres_map}). The built-in set in `datamodules/data/axbench/` is ours (see its README).
Reading it: `axbench_files.py`; formatting rows and batching them: `axbench_format.py`.

Batches carry the LM loss mask on the response (`response_mask`), the sequence label for
detection (`label`: 1 positive, 0 negative, −1 left out of the AUROC; `category`), per-token concept labels (`token_labels`) and `content_mask`:
every real token after the chat prefix (the template tokens every prompt starts with: BOS, a
default system turn, the user header), where AxBench intervenes, runs the TopK and pools detection
(its `prefix_length` with `exclude_bos: true`).

`genre_negatives: true` gives ReFT-r1 AxBench's `train_on_negative` data: each pool negative
appears once for every selected concept of its genre, with that concept's id and label 0 (a
negative of no selected genre is left out); the closed-form methods need the shared pool (false).

`preference: true` gives RePS its preference data (AxBench's `make_preference_data_module`): the
train split is the selected concepts' positives alone, each as (concept response, original
response) of its instruction, batched by `collate_preference`. The original response is the
table's `losing_output` column where it has one (AxBench's `dpo_train_data` layout, whose
`winning_output` is then the concept response), else the LM's own greedy reply to the
instruction, which the training module generates at fit start (`set_original_responses`).
"""

from __future__ import annotations

import warnings
from functools import partial

import pandas as pd
from lit_interventions.datamodules.axbench_files import (
    EVAL_LABELS,
    NEGATIVE_POOL,
    check_counts,
    load_concepts,
    load_instructions,
)
from lit_interventions.datamodules.axbench_format import (
    Example,
    collate,
    collate_preference,
    has_chat_template,
    prompt_text,
    tokenize_rows,
)
from lit_interventions.datamodules.base import BenchmarkDataModule
from torch.utils.data import DataLoader

from lit_interventions.core.lm import load_tokenizer
from lit_interventions.core.loaders import split_loader

CHAT_LM = "smollm2-135m-instruct"


def chat_tokenizer(lm: str, chat_template: bool | None) -> tuple:
    """(the tokenizer of `lm`, whether rows are formatted as chat turns): `chat_template` None
    means when the tokenizer has one; True without one is a ValueError."""
    tokenizer = load_tokenizer(lm)
    chat = has_chat_template(tokenizer) if chat_template is None else chat_template
    if chat and not has_chat_template(tokenizer):
        raise ValueError(f"chat_template=True but the tokenizer of {lm!r} has no chat template")
    return tokenizer, chat


def warn_truncated(splits: dict[str, list[Example]], max_length: int) -> None:
    """One warning per split whose examples lost the end of their response to `max_length`."""
    for split, examples in splits.items():
        truncated = sum(e.truncated for e in examples)
        if truncated:
            warnings.warn(
                f"{split}: {truncated} of {len(examples)} responses truncated to max_length={max_length}",
                stacklevel=3,
            )


class AxBenchDataModule(BenchmarkDataModule):
    """Concept data for steering and detection.

    Args:
        lm: the LM whose tokenizer (and chat template) is used.
        concept_dir: a directory in the AxBench layout (default: our built-in concepts).
        concepts: ids of the concepts to use (default: all). In batches, `concept_id` and
            `token_labels` are positions in this list (so index `self.concepts`); -1 is the pool.
        max_length: longest sequence; the response is truncated to fit.
        batch_size, eval_batch_size: train and validation/test batch sizes.
        seed: shuffling seed for train.
        padding_side: `right` or `left`.
        chat_template: format as a chat turn (None: when the tokenizer has a chat template);
            without one the text is `instruction\\n\\nresponse`.
        end_of_turn: append the end-of-turn token (or EOS) after an untruncated response, inside
            `response_mask`, so that an LM loss teaches the model to stop.
        genre_negatives: train negatives per concept (AxBench's `train_on_negative` data): each
            pool negative once for every selected concept of its genre, with that concept's id
            and label 0. False: the shared pool once, concept_id -1 (the closed-form methods).
        hard_negatives: the eval split's hard negatives: "drop" leaves them out of the AUROC (label
            −1; AxBench's `AUCROCEvaluator`), "negative" scores them as negatives (label 0). Either
            way they count toward each concept's max activation.
    """

    SPLITS = {"train": "train", "val": "eval", "test": "eval"}

    def __init__(
        self,
        lm: str = CHAT_LM,
        concept_dir: str | None = None,
        concepts: list[int] | None = None,
        max_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int = 16,
        seed: int = 0,
        padding_side: str = "right",
        chat_template: bool | None = None,
        end_of_turn: bool = True,
        genre_negatives: bool = False,
        hard_negatives: str = "drop",
        preference: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
        if hard_negatives not in EVAL_LABELS:
            raise ValueError(f"hard_negatives={hard_negatives!r}; choose {' or '.join(map(repr, EVAL_LABELS))}")
        for name, value in (
            ("max_length", max_length),
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.lm = lm
        self.data = load_concepts(concept_dir)  # cheap, and fails before any model is loaded
        valid = list(range(len(self.data.concepts)))
        selected = valid if concepts is None else list(concepts)
        bad = [c for c in selected if c not in valid]
        if bad or not selected or len(set(selected)) < len(selected):
            raise ValueError(
                f"concepts={concepts!r}: {'unknown ids ' + str(bad) if bad else 'need distinct ids'}; "
                f"valid ids: 0..{len(valid) - 1} ({', '.join(f'{i}={n!r}' for i, n in enumerate(self.data.concepts))})"
            )
        # an empty or one-sided split fails here, before any model loads
        check_counts(self.data, selected, hard_negatives)
        self.concept_ids = selected
        self.concepts = [self.data.concepts[i] for i in selected]
        self.concept_genres = [self.data.genres[i] for i in selected]
        self.genre_negatives = bool(genre_negatives)
        self.preference = bool(preference)
        self.original_responses: dict[str, str] = {}
        self.instructions = load_instructions()
        self.splits: dict[str, list[Example]] = {}

    def rows(self, split: str) -> pd.DataFrame:
        """The selected rows of "train" (positives of the selected concepts + the pool) or "eval"."""
        table = self.data.train if split == "train" else self.data.eval
        keep = table["concept_id"].isin(self.concept_ids)
        if split == "train" and self.preference:  # RePS trains on the positives alone
            return table[keep & (table["category"] == "positive")].reset_index(drop=True)
        if split == "train" and not self.genre_negatives:
            keep |= table["concept_id"] == NEGATIVE_POOL
        rows = table[keep]
        if split == "train" and self.genre_negatives:  # the pool once per concept of the negative's genre
            pool = table[table["concept_id"] == NEGATIVE_POOL]
            copies = [
                pool[pool["concept_genre"] == genre].assign(concept_id=c)
                for c, genre in zip(self.concept_ids, self.concept_genres)
            ]
            rows = pd.concat([rows, *copies])
        return rows.reset_index(drop=True)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        self.tokenizer, self.chat = chat_tokenizer(self.lm, hp.chat_template)
        index = {c: i for i, c in enumerate(self.concept_ids)}
        labels = {"train": None, "eval": EVAL_LABELS[hp.hard_negatives]}
        for split in ("train", "eval") if not self.preference else ("eval",):
            self.splits[split] = tokenize_rows(
                self.rows(split), self.tokenizer, self.chat, hp.max_length, hp.end_of_turn, index, labels[split]
            )
        warn_truncated(self.splits, hp.max_length)

    # --- RePS's preference examples -----------------------------------------------------------

    def missing_originals(self) -> list[str]:
        """The training instructions (distinct, in order) with no original response yet: none
        when the table has a `losing_output` column."""
        if not self.preference or "losing_output" in self.data.train.columns:
            return []
        instructions = dict.fromkeys(self.rows("train")["input"])
        return [i for i in instructions if i not in self.original_responses]

    def prompt_texts(self, instructions: list[str]) -> list[str]:
        """Each instruction's prompt as the rows are formatted (the chat turn up to the reply, or
        `instruction\\n\\n`), the text an original response continues."""
        return [prompt_text(self.tokenizer, i, self.chat) for i in instructions]

    def set_original_responses(self, responses: dict[str, str]) -> None:
        """The LM's original response to each training instruction; an empty one leaves its
        examples out (with a warning)."""
        self.original_responses.update(responses)
        self.splits.pop("train", None)

    def preference_examples(self) -> list:
        """(concept, original) example pairs of the train split, tokenized once."""
        if "train" in self.splits:
            return self.splits["train"]
        missing = self.missing_originals()
        if missing:
            raise ValueError(
                f"preference: {len(missing)} training instruction(s) have no original response (e.g. "
                f"{missing[0][:60]!r}): give the table a losing_output column or train with the RePS "
                "objective, which generates them"
            )
        rows = self.rows("train")
        if "winning_output" in rows.columns:
            rows = rows.assign(output=rows["winning_output"])
        originals = (
            rows["losing_output"] if "losing_output" in rows.columns else rows["input"].map(self.original_responses)
        )
        kept = originals.fillna("").astype(str).str.strip() != ""
        if not kept.all():
            warnings.warn(
                f"preference: {int((~kept).sum())} example(s) with an empty original response left out", stacklevel=2
            )
        rows, originals = rows[kept], originals[kept]
        hp, index = self.hparams, {c: i for i, c in enumerate(self.concept_ids)}
        tokenize = partial(
            tokenize_rows, tokenizer=self.tokenizer, chat=self.chat, max_length=hp.max_length,
            end_of_turn=hp.end_of_turn, concept_index=index,
        )  # fmt: skip
        concept = tokenize(rows)
        original = tokenize(rows.assign(output=originals.values, category="negative"))
        self.splits["train"] = list(zip(concept, original))
        warn_truncated({"train": concept + original}, hp.max_length)
        return self.splits["train"]

    def loader(self, split: str, batch_size: int, shuffle: bool = False) -> DataLoader:
        if split == "train" and self.preference:
            pairs = self.preference_examples()
            pad, side = self.tokenizer.pad_token_id, self.hparams.padding_side
            collate_fn = partial(collate_preference, pad_id=pad, padding_side=side)
            return split_loader(pairs, batch_size, collate_fn, self.trainer, shuffle, seed=self.hparams.seed)
        if not self.splits.get(split):
            path = self.data.train_path if split == "train" else self.data.eval_path
            raise ValueError(f"{path}: the {split} split has 0 examples for concepts {self.concept_ids}")
        collate_fn = partial(collate, pad_id=self.tokenizer.pad_token_id, padding_side=self.hparams.padding_side)
        return split_loader(self.splits[split], batch_size, collate_fn, self.trainer, shuffle, seed=self.hparams.seed)
