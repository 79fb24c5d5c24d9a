"""Counterfactual pairs from a file: a researcher's own minimal pairs, without templates.

    python train.py fit --config configs/das_pairs.yaml --data.path pairs.jsonl

The file's schema and how it is read: `datamodules/pairs_files.py` (docs/data.md, "Counterfactual
pairs files"). Each pair becomes the same example CausalGym's pairs do (`causalgym.Example`),
batched by the same collate (`PairBatch`), scored by the same callbacks (log odds-ratio and IIA)
and fitted on by closed-form methods through the same `site_labels`; the class of a site state is
its sentence's label as written (a closed-form direction needs exactly two of them in train).

Two regions: `site`, the last token of the row's `base_position` / `source_position` (found
through the fast tokenizer's character offsets, `core.positions.span_position`; the
sentence's last token where the row gives none), and `last`, the sentence's last token. A label
of several tokens is scored by its first token, as CausalGym does (`causalgym.first_token`).

Like CausalGym, every pair is also used swapped (source as base) unless `swap` is false; the file's
val and test splits are served as CausalGym's dev and eval (`SPLITS`), so `train.py` and its
callbacks read a pairs file as they read CausalGym data.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.causalgym import CausalGymDataModule, Example, first_token
from lit_interventions.datamodules.pairs_files import PairRow, assign_splits, read_pairs

from lit_interventions.core.batch import CAUSE, ISO
from lit_interventions.core.lm import DEFAULT_LM, load_tokenizer
from lit_interventions.core.pair_checks import refuse_identical_pairs
from lit_interventions.core.positions import encode_text, span_position

REGIONS = ("site", "last")
FILE_SPLITS = {"train": "train", "val": "dev", "test": "eval"}  # the file's split -> the served split


def label_word(label: str, prepend_space: bool) -> str:
    """The label as the word after the sentence: with a space before it unless it has one."""
    return label if not prepend_space or label[:1].isspace() else " " + label


class PairsDataModule(BenchmarkDataModule):
    """Counterfactual pairs read from `path` (see the module doc).

    Args:
        path: a `.jsonl` or `.csv` file, a `save_to_disk` or data directory, or a Hugging Face
            dataset id (the last three need the `datasets` package).
        lm: the LM whose tokenizer is used (linked to `--model.lm` by train.py).
        region: `site` (default: each row's position, else its last token) or `last` (linked to
            `--model.region` by train.py).
        prepend_space: score ` are` for a label written `are` (a label starting with a space is
            kept as it is).
        val_fraction, test_fraction: the shares of the cause rows without a `split` that go to
            val and test (at least one row each when above 0); seed: the seed of that split.
        swap: also use every pair swapped, source as base (CausalGym's doubling).
        multitask: train on the file's iso rows too (the multi-task loss of MDAS / MDBM,
            `objectives.CauseIsoLoss(multitask=True)`); without it they are left out.
        batch_size, eval_batch_size: training and evaluation batch sizes.
        padding_side: `right` or `left`.
    """

    SPLITS = CausalGymDataModule.SPLITS  # val: dev, test: eval
    FIT_SIDES = CausalGymDataModule.FIT_SIDES  # the base states, by their sentence's label
    # the batches, the metrics (odds and IIA) and the fitted classes are CausalGym's
    loader = CausalGymDataModule.loader
    metric_callbacks = CausalGymDataModule.metric_callbacks
    site_labels = CausalGymDataModule.site_labels

    def __init__(
        self,
        path: str,
        lm: str = DEFAULT_LM,
        region: str | None = None,
        prepend_space: bool = True,
        val_fraction: float = 0.2,
        test_fraction: float = 0.2,
        seed: int = 0,
        swap: bool = True,
        multitask: bool = False,
        batch_size: int = 4,
        eval_batch_size: int = 16,
        padding_side: str = "right",
    ):
        super().__init__()
        self.save_hyperparameters()
        region = "site" if region is None else region
        if region not in REGIONS:
            raise ValueError(f"region={region!r}; a pairs file's regions are {', '.join(REGIONS)}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.region, self.lm, self.file = region, lm, Path(path).name
        self.pairs = self.build_splits(read_pairs(path))  # cheap, and fails before any model is loaded
        self.tokenizer = load_tokenizer(lm)
        self.label_ids = self.check_labels()
        self.splits: dict[str, list[Example]] = {}

    def build_splits(self, rows: list[PairRow]) -> dict[str, list[PairRow]]:
        """{train, dev, eval: rows} (`assign_splits`); iso rows only with `multitask`. A split
        left empty is an error saying how to fill it."""
        hp = self.hparams
        iso = [row for row in rows if row.kind == "iso"]
        if hp.multitask and not iso:
            raise ValueError(f"multitask=True trains on iso pairs, and {self.file} has none (rows of type iso)")
        if iso and not hp.multitask:
            warnings.warn(
                f"{self.file}: its {len(iso)} iso pairs are left out; --data.multitask true trains on them (MDAS/MDBM)",
                stacklevel=3,
            )
            rows = [row for row in rows if row.kind != "iso"]
        splits = assign_splits(rows, hp.val_fraction, hp.test_fraction, hp.seed)
        for split, found in splits.items():
            if not any(row.kind == "cause" for row in found):
                fill = "more rows without a split" if split == "train" else f"{split}_fraction above 0"
                raise ValueError(f"{self.file} has no cause pairs for {split}: give rows split {split!r}, or {fill}")
        return {FILE_SPLITS[split]: found for split, found in splits.items()}

    def check_labels(self) -> dict[str, int]:
        """{label as written: its first token}; a cause pair whose labels share their first token
        is an error naming its row."""
        space = self.hparams.prepend_space
        ids = {}
        for row in (row for rows in self.pairs.values() for row in rows):
            for label in (row.base_label, row.source_label):
                if label not in ids:
                    ids[label] = first_token(self.tokenizer, label_word(label, space))
            if row.kind == "cause" and ids[row.base_label] == ids[row.source_label]:
                token = self.tokenizer.convert_ids_to_tokens(ids[row.base_label])
                raise ValueError(
                    f"{row.where}: 'source_label' {row.source_label!r} and 'base_label' {row.base_label!r} share "
                    f"their first token {token!r}; the odds compare first tokens, so they must differ"
                )
        return ids

    def encode(self, text: str, position: str | None) -> tuple[list[int], dict[str, int]]:
        """The token ids the LM reads for `text` (`encode_text`) and {region: token index}."""
        ids = encode_text(self.tokenizer, text)["input_ids"][0].tolist()
        last = len(ids) - 1
        site = last if position is None else span_position(self.tokenizer, text, position)
        return ids, {"site": site, "last": last}

    def example(self, row: PairRow) -> Example:
        base_ids, base_positions = self.encode(row.base, row.base_position)
        source_ids, source_positions = self.encode(row.source, row.source_position)
        return Example(
            base_ids,
            source_ids,
            base_positions,
            source_positions,
            self.label_ids[row.base_label],
            self.label_ids[row.source_label],
            row.base,
            row.source,
            row.base_label,  # the class a closed-form method is fitted on (`site_labels`)
            row.source_label,
            ISO if row.kind == "iso" else CAUSE,
        )

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        for split, rows in self.pairs.items():
            examples = [self.example(row) for row in rows]
            if self.hparams.swap:
                examples += [self.example(swapped(row)) for row in rows]
            refuse_identical_pairs(examples, split, self.file)
            self.splits[split] = examples

    def usage_example(self) -> dict[str, str]:
        """The first eval pair: its base as the prompt, its source, and (region `site`) the
        positions whose last tokens are the site (`generate --span` / `--source_span`)."""
        row = self.pairs["eval"][0]
        example = {"prompt": row.base, "source": row.source}
        if self.region == "site" and row.base_position and row.source_position:
            example |= {"span": row.base_position, "source_span": row.source_position}
        return example


def swapped(row: PairRow) -> PairRow:
    """The pair with its source as base."""
    return PairRow(
        row.where,
        row.source,
        row.base,
        row.source_label,
        row.base_label,
        row.source_position,
        row.base_position,
        row.split,
        row.kind,
    )
