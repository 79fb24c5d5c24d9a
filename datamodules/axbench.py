"""AxBench concept data: chat-formatted instruction + response pairs per concept.

Layout (the published AxBench one, parquet or our JSONL): a concept directory holds
`train_data.*` (72 positives per concept and a shared negative pool with concept_id -1),
`latent_eval_data.*` (per concept: positives, negatives and hard negatives, each row carrying the
concept id it is evaluated for) and `metadata.jsonl` ({concept_id, concept, ref,
concept_genres_map}). The built-in set in `datamodules/data/axbench/` is ours (see its README).

Batches carry the LM loss mask on the response (`response_mask`), the sequence label for
detection (`label`, `category`), per-token concept labels (`token_labels`) and `content_mask`:
every real token after the chat prefix (the template tokens every prompt starts with: BOS, a
default system turn, the user header), where AxBench intervenes, runs the TopK and pools detection
(its `prefix_length` with `exclude_bos: true`).

`genre_negatives: true` gives ReFT-r1 AxBench's `train_on_negative` data: each pool negative
appears once for every selected concept of its genre, with that concept's id and label 0 (a
negative of no selected genre is left out); the closed-form methods need the shared pool (false).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader

from lit_interventions.core.lm import load_tokenizer
from lit_interventions.core.loaders import split_loader
from lit_interventions.core.surprisal import bos_prefix

BUILTIN_DIR = Path(__file__).parent / "data" / "axbench"
COLUMNS = ["input", "output", "output_concept", "concept_genre", "category", "dataset_category", "concept_id"]
CATEGORIES = {"negative": 0, "positive": 1, "hard negative": 2}  # the batch's `category` codes
NEGATIVE_POOL = -1  # concept_id of the shared negative pool in train
CHAT_LM = "smollm2-135m-instruct"


@dataclass
class ConceptData:
    """Train and eval rows; `concepts[i]` is the concept whose rows carry concept_id i."""

    train: pd.DataFrame
    eval: pd.DataFrame
    concepts: list[str]
    genres: list[str]
    train_path: Path | None = None
    eval_path: Path | None = None


def _read_table(directory: Path, stem: str) -> tuple[pd.DataFrame, Path]:
    for suffix in (".parquet", ".jsonl"):
        path = directory / f"{stem}{suffix}"
        if path.exists():
            table = pd.read_parquet(path) if suffix == ".parquet" else pd.read_json(path, lines=True, dtype=False)
            return table, path
    raise FileNotFoundError(f"Missing {directory / stem}.parquet (or .jsonl) in concept directory {directory}")


def _check_columns(table: pd.DataFrame, path: Path, columns: list[str]) -> None:
    for column in columns:
        if column not in table.columns:
            raise ValueError(f"{path} has no column {column!r}; columns: {', '.join(map(str, table.columns))}")


def _read_metadata(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(
            f"Missing {path} (one JSON object per concept: concept_id, concept, concept_genres_map)"
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        for key in ("concept_id", "concept"):
            if key not in row:
                raise ValueError(f"{path}: a row has no field {key!r}: {row}")
    return rows


def load_concepts(concept_dir: str | Path | None = None) -> ConceptData:
    """Read a concept directory (None: our built-in set); concept ids become 0..C-1 in metadata order
    (sorted by the published id), -1 stays the shared negative pool."""
    directory = BUILTIN_DIR if concept_dir is None else Path(concept_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"Concept directory {directory} does not exist")
    metadata = sorted(_read_metadata(directory / "metadata.jsonl"), key=lambda row: int(row["concept_id"]))
    train, train_path = _read_table(directory, "train_data")
    evaluation, eval_path = _read_table(directory, "latent_eval_data")
    for table, path in ((train, train_path), (evaluation, eval_path)):
        _check_columns(table, path, COLUMNS)
        unknown = sorted(set(table["category"]) - set(CATEGORIES))
        if unknown:
            raise ValueError(f"{path}: unknown category {unknown}; allowed: {sorted(CATEGORIES)}")
    remap = {int(row["concept_id"]): i for i, row in enumerate(metadata)}
    remap[NEGATIVE_POOL] = NEGATIVE_POOL
    for table, path in ((train, train_path), (evaluation, eval_path)):
        unknown = sorted(set(table["concept_id"].astype(int)) - set(remap))
        if unknown:
            raise ValueError(f"{path}: concept ids {unknown} are not in {directory / 'metadata.jsonl'}")
        table["concept_id"] = table["concept_id"].astype(int).map(remap).astype("int64")
    if (evaluation["concept_id"] == NEGATIVE_POOL).any():
        raise ValueError(f"{eval_path}: every eval row needs the concept id it is evaluated for; found concept_id -1")
    concepts = [str(row["concept"]) for row in metadata]
    genres = []
    for i, row in enumerate(metadata):
        genre = (row.get("concept_genres_map") or {}).get(row["concept"])
        if not genre:  # fall back to the genre written on the concept's positives
            genre = train.loc[train["concept_id"] == i, "concept_genre"].head(1).tolist() or ["text"]
        genres.append(genre[0] if isinstance(genre, (list, tuple)) else str(genre))
    return ConceptData(
        train.reset_index(drop=True), evaluation.reset_index(drop=True), concepts, genres, train_path, eval_path
    )


def check_counts(data: ConceptData, concept_ids: list[int]) -> None:
    """Every selected concept needs training positives and, in the eval split, positives and
    negatives (AUROC and the max activation need both); else a ValueError naming the file, the
    split, the concept and the count. Called before any model is loaded."""
    train, evaluation = data.train, data.eval
    where = {"train": data.train_path or "train_data", "eval": data.eval_path or "latent_eval_data"}
    chosen = f"{len(concept_ids)} selected concept(s)"
    train_rows = train[train["concept_id"].isin(concept_ids)]
    if len(train_rows) == 0:
        raise ValueError(
            f"{where['train']}: the train split has 0 rows for the {chosen} "
            f"(of {len(train)} rows in the file); a dictionary needs training data"
        )
    eval_rows = evaluation[evaluation["concept_id"].isin(concept_ids)]
    if len(eval_rows) == 0:
        raise ValueError(
            f"{where['eval']}: the eval split has 0 rows for the {chosen} (of {len(evaluation)} rows in "
            "the file); detection (AUROC) and the max activations need eval data"
        )
    for c in concept_ids:
        name = data.concepts[c]
        positives = int(((train["concept_id"] == c) & (train["category"] == "positive")).sum())
        if positives == 0:
            raise ValueError(
                f"{where['train']}: concept {c} ({name!r}) has 0 positive rows in the train split; "
                "each concept needs at least 1"
            )
        rows = evaluation[evaluation["concept_id"] == c]
        n_pos = int((rows["category"] == "positive").sum())
        n_neg = len(rows) - n_pos
        if n_pos == 0 or n_neg == 0:
            raise ValueError(
                f"{where['eval']}: concept {c} ({name!r}) has {n_pos} positive and {n_neg} negative rows "
                "in the eval split; its AUROC and max activation need at least 1 of each"
            )


def load_instructions(path: str | Path | None = None) -> list[str]:
    """Steering-evaluation instructions (default: our own, `data/axbench/instructions.json`)."""
    path = BUILTIN_DIR / "instructions.json" if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Missing instruction file {path}")
    instructions = json.loads(path.read_text())
    if not isinstance(instructions, list) or not all(isinstance(x, str) for x in instructions):
        raise ValueError(f"{path} must hold a JSON list of strings")
    return instructions


# --- formatting -------------------------------------------------------------------------------


def has_chat_template(tokenizer) -> bool:
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


@dataclass
class Example:
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
    n = 0
    while n < min(len(ids), len(prefix)) and ids[n] == prefix[n]:
        n += 1
    return n


def tokenize_rows(
    rows: pd.DataFrame, tokenizer, chat: bool, max_length: int, end_of_turn: bool, concept_index: dict[int, int]
) -> list[Example]:
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
                label=int(category == "positive"),
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
    text of positives, -1 elsewhere. `keys` are the unpadded ids and first real positions, for
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


class AxBenchDataModule(LightningDataModule):
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
    """

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
        check_counts(self.data, selected)  # an empty or one-sided split fails here, before any model loads
        self.concept_ids = selected
        self.concepts = [self.data.concepts[i] for i in selected]
        self.concept_genres = [self.data.genres[i] for i in selected]
        self.genre_negatives = bool(genre_negatives)
        self.instructions = load_instructions()
        self.splits: dict[str, list[Example]] = {}

    def rows(self, split: str) -> pd.DataFrame:
        """The selected rows of "train" (positives of the selected concepts + the pool) or "eval"."""
        table = self.data.train if split == "train" else self.data.eval
        keep = table["concept_id"].isin(self.concept_ids)
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
        self.tokenizer = load_tokenizer(self.lm)
        chat = has_chat_template(self.tokenizer) if hp.chat_template is None else hp.chat_template
        if chat and not has_chat_template(self.tokenizer):
            raise ValueError(f"chat_template=True but the tokenizer of {self.lm!r} has no chat template")
        self.chat = chat
        index = {c: i for i, c in enumerate(self.concept_ids)}
        for split in ("train", "eval"):
            self.splits[split] = tokenize_rows(
                self.rows(split), self.tokenizer, chat, hp.max_length, hp.end_of_turn, index
            )
        for split, examples in self.splits.items():
            truncated = sum(e.truncated for e in examples)
            if truncated:
                warnings.warn(
                    f"{split}: {truncated} of {len(examples)} responses truncated to max_length={hp.max_length}",
                    stacklevel=2,
                )

    def loader(self, split: str, batch_size: int, shuffle: bool = False) -> DataLoader:
        if not self.splits.get(split):
            path = self.data.train_path if split == "train" else self.data.eval_path
            raise ValueError(f"{path}: the {split} split has 0 examples for concepts {self.concept_ids}")
        collate_fn = partial(collate, pad_id=self.tokenizer.pad_token_id, padding_side=self.hparams.padding_side)
        return split_loader(self.splits[split], batch_size, collate_fn, self.trainer, shuffle, seed=self.hparams.seed)

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("eval", self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.loader("eval", self.hparams.eval_batch_size)
