"""Contrast pairs from a file: a concept's positive texts beside matched negative ones, for the
AxBench concept methods (DiffMean, PCA, LAT, probe, ReFT-r1, SSV), without Python.

    python train.py fit --config configs/diffmean_contrast.yaml --data.path contrast.jsonl

The file's schema and how it is read: `datamodules/contrast_files.py` (docs/data.md, "Contrast
pairs files"). The rows become the `ConceptData` an AxBench concept directory gives, served as
the AxBench data module serves it: the same examples (`axbench_format.Example`), collate, batch
masks and labels, splits (`SPLITS`: val and test are the held-out rows) and loader, so
`SteeringModule`, the `AUROCCallback` and the dictionary export read a contrast file as they read
AxBench data, and `fit` writes a `Dictionary` (one row per concept) that `detect`, `steer` and
`lit-interventions generate --artifact` use.

A pair with a prompt is two chat turns (or `prompt\\n\\ntext` without a chat template): the prompt as
the instruction, the positive or the negative text as the response. A pair without one is each
text alone after the BOS, as `Dictionary.detect` reads a text: the text is the response and every
token of it is content (`text_example`).

Negatives: with `genre_negatives: false` (the closed-form methods) the train negatives are
AxBench's shared pool (concept_id −1); with `genre_negatives: true` (ReFT-r1's
`train_on_negative`) each negative trains with its own pair's concept. Held-out negatives are
scored for their pair's concept (label 0), positives as 1.
"""

from __future__ import annotations

import pandas as pd
from lit_interventions.datamodules.axbench import CHAT_LM, AxBenchDataModule, chat_tokenizer, warn_truncated
from lit_interventions.datamodules.axbench_files import CATEGORIES, NEGATIVE_POOL
from lit_interventions.datamodules.axbench_format import Example, tokenize_rows
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.contrast_files import assign_splits, concept_data, read_contrast

from lit_interventions.core.surprisal import bos_prefix


def text_example(tokenizer, text: str, category: str, concept_id: int, max_length: int, end_of_turn: bool) -> Example:
    """One text read alone: the BOS (`bos_prefix`), the text as the response (truncated to fit
    `max_length`) and, with `end_of_turn`, EOS after an untruncated text; every token after the BOS
    is content (the chat prefix is the BOS)."""
    prompt_ids = tokenizer(bos_prefix(tokenizer))["input_ids"]
    response_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end_ids = [tokenizer.eos_token_id] if end_of_turn and tokenizer.eos_token_id is not None else []
    room = max_length - len(prompt_ids)
    if room < 1:
        raise ValueError(f"max_length={max_length} leaves no room for a text after the BOS; raise max_length")
    truncated = len(response_ids) + len(end_ids) > room
    if truncated:
        response_ids, end_ids = response_ids[:room], []
    start = len(prompt_ids)
    return Example(
        ids=prompt_ids + response_ids + end_ids,
        response_start=start,
        output_end=start + len(response_ids),
        response_end=start + len(response_ids) + len(end_ids),
        concept_id=concept_id,
        label=int(category == "positive"),
        category=CATEGORIES[category],
        truncated=truncated,
        prefix=start,
    )


def tokenize_contrast(rows: pd.DataFrame, tokenizer, chat: bool, max_length: int, end_of_turn: bool) -> list[Example]:
    """The examples of `rows` in order: a row with an instruction as AxBench's (`tokenize_rows`),
    a row without one as its text alone (`text_example`). Concept ids are kept as they are."""
    alone = (rows["input"] == "").to_numpy()
    index = {int(c): int(c) for c in rows["concept_id"].unique() if c != NEGATIVE_POOL}
    prompted = iter(tokenize_rows(rows[~alone], tokenizer, chat, max_length, end_of_turn, index))
    return [
        text_example(tokenizer, text, category, int(concept), max_length, end_of_turn) if is_alone else next(prompted)
        for is_alone, text, category, concept in zip(alone, rows["output"], rows["category"], rows["concept_id"])
    ]


class ContrastDataModule(BenchmarkDataModule):
    """Contrast pairs read from `path` (see the module doc), served as AxBench concept data.

    Args:
        path: a `.jsonl` or `.csv` file, a `save_to_disk` or data directory, or a Hugging Face
            dataset id (the last three need the `datasets` package).
        lm: the LM whose tokenizer (and chat template) is used (linked to `--model.lm` by train.py).
        concept: the name of the concept of the rows that give none (None: the file's stem).
        eval_fraction: the share of each concept's rows without a `split` held out for the AUROC
            (at least one row when above 0); seed: the seed of that split and of train shuffling.
        max_length: longest sequence; the response is truncated to fit.
        batch_size, eval_batch_size: train and validation/test batch sizes.
        padding_side: `right` or `left`.
        chat_template: format a pair with a prompt as a chat turn (None: when the tokenizer has a
            chat template); without one the text is `prompt\\n\\ntext`.
        end_of_turn: append the end-of-turn token (or EOS) after an untruncated text, inside
            `response_mask`, so that an LM loss teaches the model to stop.
        genre_negatives: train negatives carry their pair's concept (ReFT-r1's
            `train_on_negative`); False: the shared pool, concept_id −1 (the closed-form methods).
    """

    SPLITS = AxBenchDataModule.SPLITS  # val and test: the held-out rows
    loader = AxBenchDataModule.loader  # AxBench's batches: collate, masks, labels
    preference = False  # the loader's RePS pairs: a contrast file has none (RePS trains on concept data)

    def __init__(
        self,
        path: str,
        lm: str = CHAT_LM,
        concept: str | None = None,
        eval_fraction: float = 0.2,
        seed: int = 0,
        max_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int = 16,
        padding_side: str = "right",
        chat_template: bool | None = None,
        end_of_turn: bool = True,
        genre_negatives: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
        for name, value in (
            ("max_length", max_length),
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.lm = lm
        rows = read_contrast(path, concept)  # cheap, and fails before any model is loaded
        self.data = concept_data(assign_splits(rows, eval_fraction, seed, str(path)), str(path))
        self.concepts = list(self.data.concepts)
        self.concept_ids = list(range(len(self.concepts)))
        self.concept_genres = list(self.data.genres)
        self.genre_negatives = bool(genre_negatives)
        self.splits: dict[str, list[Example]] = {}

    def rows(self, split: str) -> pd.DataFrame:
        """The AxBench rows of "train" or "eval"; train negatives are the shared pool (concept_id
        −1) unless `genre_negatives`."""
        table = self.data.train if split == "train" else self.data.eval
        if split == "train" and not self.genre_negatives:
            pool = table["concept_id"].where(table["category"] == "positive", NEGATIVE_POOL)
            table = table.assign(concept_id=pool)
        return table.reset_index(drop=True)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        self.tokenizer, self.chat = chat_tokenizer(self.lm, hp.chat_template)
        for split in ("train", "eval"):
            self.splits[split] = tokenize_contrast(
                self.rows(split), self.tokenizer, self.chat, hp.max_length, hp.end_of_turn
            )
        warn_truncated(self.splits, hp.max_length)
