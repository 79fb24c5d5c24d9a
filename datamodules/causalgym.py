"""CausalGym DataModule: counterfactual minimal pairs, tokenised, with per-region positions.

Sizes follow the paper (§3.2 and App. B): train 200 pairs doubled to 400 by swapping base and
source; dev and eval 50 pairs doubled to 100, with no sentence that also appears in train.
Validation uses dev, test uses eval.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from functools import partial

from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.templates import Pair, TaskTemplate, load_task, sample_pairs
from torch.utils.data import DataLoader

from lit_interventions.callbacks.metrics import OddsCallback
from lit_interventions.core.batch import CAUSE, ISO, PairBatch, collate_pairs
from lit_interventions.core.lm import DEFAULT_LM, load_tokenizer
from lit_interventions.core.loaders import split_loader
from lit_interventions.core.pair_checks import refuse_identical_pairs
from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.core.tokens import token_covering

CONTROL_TASKS = {"dog_give": [" dog", " give"]}
OWN, OFFICIAL = "own", "official"  # where a pair's source is read (`check_positions`)
POSITIONS = (OWN, OFFICIAL)


class EmptyRegionError(ValueError):
    """The chosen region is empty in every pair of a split: no site (a sweep skips that region)."""  # Hewitt & Liang-style control: arbitrary labels


@dataclass
class Example:
    base_ids: list[int]
    source_ids: list[int]
    base_positions: dict[str, int]  # region -> last token of the region
    source_positions: dict[str, int]
    base_label: int
    source_label: int
    base_text: str
    source_text: str
    base_type: str
    source_type: str
    kind: int = CAUSE  # ISO: a same-type pair whose base answer must not change (multi-task loss)


def first_token(tokenizer, word: str) -> int:
    """A label that splits into several tokens is scored by its first token."""
    ids = tokenizer(word, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"Label word {word!r} tokenises to nothing")
    return ids[0]


def label_token_ids(task: TaskTemplate, tokenizer, control: str | None = None) -> dict[str, dict[str, int]]:
    """type -> label word -> token id. Two types sharing a first token make the task ill-posed."""
    words = task.label_words()
    if control is not None:
        if control not in CONTROL_TASKS:
            raise ValueError(f"Unknown control task {control!r}; choose one of {sorted(CONTROL_TASKS)}")
        if len(words) != 2:
            raise ValueError(f"The {control} control needs exactly 2 label types; task {task.name!r} has {list(words)}")
        words = {t: [w] for t, w in zip(words, CONTROL_TASKS[control])}
    ids = {t: {w: first_token(tokenizer, w) for w in ws} for t, ws in words.items()}
    owner: dict[int, tuple[str, str]] = {}
    for label_type, mapping in ids.items():
        for word, token in mapping.items():
            if token in owner and owner[token][0] != label_type:
                raise ValueError(
                    f"Task {task.name!r}: label words {owner[token][1]!r} ({owner[token][0]}) and {word!r} "
                    f"({label_type}) share their first token {tokenizer.convert_ids_to_tokens(token)!r}"
                )
            owner[token] = (label_type, word)
    return ids


def tokenize_pairs(
    pairs: list[Pair], tokenizer, label_ids: dict[str, dict[str, int]], control: str | None, kind: int = CAUSE
) -> list[Example]:
    prefix = bos_prefix(tokenizer)  # every sentence starts with BOS (pythia's tokenizer adds none)

    def encode(sentence):
        enc = tokenizer(prefix + sentence.text, return_offsets_mapping=True)
        positions = {
            region: token_covering(enc["offset_mapping"], len(prefix) + end - 1, sentence.text)
            for region, (start, end) in sentence.spans.items()
        }
        return enc["input_ids"], positions

    def label_id(label_type, word):
        mapping = label_ids[label_type]
        return next(iter(mapping.values())) if control is not None else mapping[word]

    examples = []
    for pair in pairs:
        base_ids, base_positions = encode(pair.base)
        source_ids, source_positions = encode(pair.source)
        examples.append(
            Example(
                base_ids,
                source_ids,
                base_positions,
                source_positions,
                label_id(pair.base_type, pair.base.label),
                label_id(pair.source_type, pair.source.label),
                pair.base.text,
                pair.source.text,
                pair.base_type,
                pair.source_type,
                kind,
            )
        )
    return examples


def check_positions(positions: str) -> str:
    """`positions` if it is one of `POSITIONS`; else one ValueError line naming it and them."""
    if positions not in POSITIONS:
        raise ValueError(
            f"positions={positions!r}; choose 'own' (each side at the last token of its own region) "
            "or 'official' (the source at the base's token index, as CausalGym's code reads it)"
        )
    return positions


def at_base_index(example: Example) -> Example:
    """`example` with the official code's source positions: for each region r both sentences
    have, p_s(r) = min(p_b(r), n_s - 1), p_b(r) the last token of the base's region and n_s the
    source's length in tokens. CausalGym's code gives pyvene `{"sources->base": ([None, b], [s,
    b])}` (`train.py:62`, `eval.py:31`; `Batch.compute_pos` returns [source, base] positions,
    `data.py:115-142`): f(s) is read at the base's index b. Where b is past the source's end
    (the base is longer before the region) that code reads a padding token's state after the
    source; here, the source's last token, the last state that has read the whole source."""
    last = len(example.source_ids) - 1
    aligned = {r: min(p, last) for r, p in example.base_positions.items() if r in example.source_positions}
    return replace(example, source_positions=aligned)


def split_pairs(
    template: TaskTemplate, train_pairs: int, eval_pairs: int, seed: int, dev_seed: int = 1, multitask: bool = False
) -> dict[str, list[Pair]]:
    """A task's pairs, each split swap-doubled (`sample_pairs`): train (`seed`), eval (`seed`,
    after train) and dev (`dev_seed`), no sentence of train in eval or dev; with `multitask`, also
    train_iso (Iso pairs, no sentence of eval or dev in them). Cheap: a sweep builds every task's
    splits before any work, so a task that cannot give them is refused then (one `ValueError`
    naming the task, the split and the sizes)."""

    def draw(split: str, n: int, seed: int, exclude=frozenset(), same_type=False) -> list[Pair]:
        try:
            return sample_pairs(template, n, seed, exclude=exclude, same_type=same_type)
        except ValueError as error:
            sizes = f"train_pairs={train_pairs}, eval_pairs={eval_pairs}"
            raise ValueError(f"{split} split of task {template.name!r} ({sizes}): {error}") from None

    train = draw("train", train_pairs, seed)
    seen = {p.base.text for p in train}
    splits = {
        "train": train,
        "eval": draw("eval", eval_pairs, seed + 7919, exclude=seen),
        "dev": draw("dev", eval_pairs, dev_seed + 7919, exclude=seen),
    }
    if multitask:  # Iso pairs from sentences of the dev and eval sets' complement, like train's
        held_out = {p.base.text for p in splits["eval"] + splits["dev"]}
        splits["train_iso"] = draw("train_iso", train_pairs, seed + 104729, exclude=held_out, same_type=True)
    return splits


class CausalGymDataModule(BenchmarkDataModule):
    """Minimal pairs for one CausalGym task at one region.

    Args:
        task: task name in the template file.
        templates: a template file in the published CausalGym schema (default: our own 29 tasks).
        lm: the LM whose tokenizer is used (linked to `--model.lm` by train.py).
        region: the region whose last token is the site (default: the label variable; linked to
            `--model.region` by train.py).
        control: `dog_give` to replace the labels by " dog" / " give" (the control task).
        batch_size: training batch size (the paper: 4).
        eval_batch_size: batch size for validation and test.
        train_pairs, eval_pairs: pairs before swap-doubling (the paper: 200 and 50).
        seed: seed for train and eval; dev_seed: seed for dev.
        padding_side: `right` or `left`.
        multitask: add as many Iso pairs to train (both sentences of one type, every other
            variable sampled apart: the base's answer must not change) for the multi-task loss of
            MDAS / MDBM (`objectives.CauseIsoLoss(multitask=True)`). Dev and eval stay Cause pairs.
        positions: `own` (default): each side read at the last token of its own region (the
            paper's rule); `official`: the source at the base's token index and the closed forms
            fitted on the source side, as CausalGym's code (`at_base_index`, docs/causalgym.md).
    """

    SPLITS = {"train": "train", "val": "dev", "test": "eval"}
    FIT_SIDES = ("base",)  # CausalGym fits its directions on the base states, grouped by type

    def __init__(
        self,
        task: str = "agr_sv_num_pp",
        templates: str | None = None,
        lm: str = DEFAULT_LM,
        region: str | None = None,
        control: str | None = None,
        batch_size: int = 4,
        eval_batch_size: int = 16,
        train_pairs: int = 200,
        eval_pairs: int = 50,
        seed: int = 0,
        dev_seed: int = 1,
        padding_side: str = "right",
        multitask: bool = False,
        positions: str = OWN,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_positions(positions)
        if positions == OFFICIAL:  # the official fit states, base states at the source's index, are the
            self.FIT_SIDES = ("source",)  # source states of the swaps (train holds each pair and its swap)
        self.template = load_task(task, templates)  # validates the file and the task name
        if region is None:
            region = self.template.label_region
        if region not in self.template.regions:
            raise ValueError(
                f"Unknown region {region!r} for task {task!r}; regions: {', '.join(self.template.regions)}"
            )
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
        if control is not None and control not in CONTROL_TASKS:
            raise ValueError(f"Unknown control task {control!r}; choose one of {sorted(CONTROL_TASKS)}")
        for name, value in (
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
            ("train_pairs", train_pairs),
            ("eval_pairs", eval_pairs),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.task, self.region, self.lm = task, region, lm
        self.pairs = self.build_splits()  # cheap, and fails before any model is loaded
        label_token_ids(self.template, load_tokenizer(lm), control)  # label words sharing a token: refused now
        self.splits: dict[str, list[Example]] = {}

    def build_splits(self) -> dict[str, list[Pair]]:
        """The task's splits by its sizes and seeds (`split_pairs`)."""
        hp = self.hparams
        return split_pairs(self.template, hp.train_pairs, hp.eval_pairs, hp.seed, hp.dev_seed, hp.multitask)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.tokenizer = load_tokenizer(self.lm)
        label_ids = label_token_ids(self.template, self.tokenizer, self.hparams.control)
        for split, pairs in self.pairs.items():
            kind = ISO if split == "train_iso" else CAUSE
            examples = tokenize_pairs(pairs, self.tokenizer, label_ids, self.hparams.control, kind)
            if self.hparams.positions == OFFICIAL:
                examples = [at_base_index(e) for e in examples]
            kept = [e for e in examples if self.region in e.base_positions and self.region in e.source_positions]
            if len(kept) < len(examples):
                warnings.warn(
                    f"{split}: skipped {len(examples) - len(kept)} of {len(examples)} pairs of {self.task!r} "
                    f"where region {self.region!r} is empty",
                    stacklevel=2,
                )
            if not kept:
                raise EmptyRegionError(
                    f"Region {self.region!r} of task {self.task!r} is empty in every {split} pair; "
                    f"choose another of: {', '.join(self.template.regions)}"
                )
            refuse_identical_pairs(kept, split, f"task {self.task!r}")
            self.splits[split] = kept
        self.splits["train"] = self.splits["train"] + self.splits.pop("train_iso", [])

    def loader(
        self, split: str, batch_size: int, shuffle: bool = False, seed: int | None = None, shard: bool = True
    ) -> DataLoader:
        """Batches of one split ("train", "dev" or "eval"), collated for this region; `seed` fixes
        the shuffled order (default: drawn from torch's global generator); `shard=False`: all of
        it on every process."""
        collate_fn = partial(
            collate_pairs,
            region=self.region,
            pad_id=self.tokenizer.pad_token_id,
            padding_side=self.hparams.padding_side,
        )
        return split_loader(self.splits[split], batch_size, collate_fn, self.trainer if shard else None, shuffle, seed)

    def metric_callbacks(self) -> list:
        """What this data is scored by: the log odds-ratio and IIA."""
        return [OddsCallback()]

    def usage_example(self) -> dict[str, str]:
        """The first eval pair: its base as the prompt, its source, and the text of the site's
        region in each (`generate --span` / `--source_span`)."""
        pair = self.pairs["eval"][0]
        (b0, b1), (s0, s1) = pair.base.spans[self.region], pair.source.spans[self.region]
        return {
            "prompt": pair.base.text,
            "source": pair.source.text,
            "span": pair.base.text[b0:b1],
            "source_span": pair.source.text[s0:s1],
        }

    def site_labels(self, batch: PairBatch, side: str) -> list[str]:
        """The class of each site state a closed-form intervention is fitted on: its sentence's
        type (e.g. singular or plural; CausalGym's code groups the base states by it), not the
        label word's token (a type has several words: ' is', ' was', ...)."""
        return list(batch.side(side).types)
