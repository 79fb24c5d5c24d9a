"""RAVEL DataModule: (entity, template) pairs the model answers correctly, turned into Cause and
Iso interchange examples (Huang et al. 2024, §3-4). Reading the published files and encoding a
prompt: `datamodules/ravel_files.py`; the example records: `ravel_examples.py` (batched by
`core.batch.collate_pairs`); the model's cached answers: `ravel_answers.py`."""

from __future__ import annotations

import random
from functools import partial

from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.ravel_answers import (
    AnswerCache,
    _value_tokens,
    answer_hit,
    greedy_tokens,
    named_value,
)
from lit_interventions.datamodules.ravel_examples import REGION, Query, RavelExample
from lit_interventions.datamodules.ravel_files import (
    SPLITS,
    encode_prompt,
    load_ravel,
    value_separator,
)
from torch.utils.data import DataLoader

from lit_interventions.callbacks.metrics import DisentangleCallback
from lit_interventions.core.batch import CAUSE, ISO, PairBatch, collate_pairs
from lit_interventions.core.lm import DEFAULT_LM, load_lm, load_tokenizer
from lit_interventions.core.loaders import split_loader
from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.metrics.disentangle import AVERAGES, DevDisentangle

# ---------------------------------------------------------------------------------------------
# DataModule: filtered (entity, template) pairs -> Cause / Iso interchange examples
# ---------------------------------------------------------------------------------------------


SPLIT_SETTINGS = ("entity", "context")
SOURCES = ("attribute", "wikipedia", "mixed")
ENTITY_TEMPLATES = ("all", "train")  # the entity split's templates: every one, or the `train` ones
CAUSE_LABELS = ("model", "gold")
ACCURACIES = {"three_tokens": 3, "first_token": 1}  # answer tokens generated and compared


def check_entity_templates(entity_templates: str, split: str) -> None:
    """`entity_templates` is one of ENTITY_TEMPLATES, and other than 'all' only on the entity split:
    a ValueError line otherwise."""
    if entity_templates not in ENTITY_TEMPLATES:
        raise ValueError(f"entity_templates={entity_templates!r}; choose one of {', '.join(ENTITY_TEMPLATES)}")
    if entity_templates != "all" and split != "entity":
        raise ValueError(
            f"entity_templates={entity_templates!r} applies to split='entity'; split={split!r} splits the "
            "templates themselves: leave entity_templates 'all'"
        )


class RavelDataModule(BenchmarkDataModule):
    """RAVEL Cause / Iso interchange examples for one entity type and target attribute A*.

    Cause: base = a template of A* filled with E, source mentions E' with A*(E') ≠ A*(E) in its
    answer tokens, label = what the model itself answers for the base template filled with E'
    (the official RAVEL pipeline's `inv_label`, the model's output for `base_prompt % E'`: the
    value its generation starts with, else the generation), and only examples where that answer
    differs from the base's are kept. Iso: base queries another attribute A of E, label = A(E).
    An answer is a value's first n tokens (`accuracy`). Every attribute counts (Latitude too).
    The site is the last token of the entity in base and source (RAVEL, Huang et al. 2024, §3).

    Args:
        lm: the LM whose tokenizer is used and whose answers filter the data.
        ravel_dir: a directory in the published layout (None: our built-in data).
        entity_type: e.g. city, physical_object.
        target_attribute: A*.
        split: `entity` (entities split, templates shared) or `context` (templates split,
            entities shared). The files' `val` is our dev (val_dataloader), `test` is test.
        entity_templates: with `split: entity`, the templates of every split's bases and
            sources: `all` (every template of the attribute, the paper's §2.1: "the same set of
            prompt templates across the three splits") or `train` (those the prompt split marks
            `train`, Wikipedia prompts too: the official `generate_ravel_instance.py`,
            `gen_entity_test_split` and `gen_train_split`). `split: context` takes `all`.
        source: `attribute` (an attribute prompt of another entity), `wikipedia` (a Wikipedia
            prompt that mentions E'), or `mixed` (each source drawn from one of the two).
        multitask: train batches also hold Iso examples (MDAS / MDBM); otherwise Cause only.
        cause_label: `model` (the model's own answer for the base template with E', as the
            official code; an example whose gold label the model would not produce itself is
            unsolvable for every method) or `gold` (the tokens of A*(E')).
        accuracy: `three_tokens` (the official rule: the model generates 3 tokens greedily and
            is right when they start with the label's first 3 tokens; the data keeps the pairs
            it answers right by that rule) or `first_token` (the argmax next token against the
            label's first token).
        average: `templates` (the official score: accuracy per prompt template, averaged within
            an attribute) or `examples` (an attribute's examples pooled).
        train_size, eval_size: Cause examples per split; Iso examples are as many again,
            spread over the other attributes (train: only with multitask).
        max_candidates: at most this many (entity, template) pairs are checked per attribute
            and split (a random subset), which bounds the filtering forward passes.
        batch_size, eval_batch_size, seed, padding_side: as in CausalGymDataModule.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        ravel_dir: str | None = None,
        entity_type: str = "city",
        target_attribute: str = "Country",
        split: str = "entity",
        source: str = "attribute",
        entity_templates: str = "all",
        multitask: bool = False,
        cause_label: str = "model",
        accuracy: str = "three_tokens",
        average: str = "templates",
        train_size: int = 1000,
        eval_size: int = 200,
        max_candidates: int = 200,
        batch_size: int = 16,
        eval_batch_size: int = 32,
        seed: int = 0,
        padding_side: str = "right",
    ):
        super().__init__()
        self.save_hyperparameters()
        if split not in SPLIT_SETTINGS:
            raise ValueError(f"split={split!r}; choose one of {', '.join(SPLIT_SETTINGS)}")
        if source not in SOURCES:
            raise ValueError(f"source={source!r}; choose one of {', '.join(SOURCES)}")
        check_entity_templates(entity_templates, split)
        if cause_label not in CAUSE_LABELS:
            raise ValueError(f"cause_label={cause_label!r}; choose one of {', '.join(CAUSE_LABELS)}")
        if accuracy not in ACCURACIES:
            raise ValueError(f"accuracy={accuracy!r}; choose one of {', '.join(ACCURACIES)}")
        if average not in AVERAGES:
            raise ValueError(f"average={average!r}; choose one of {', '.join(AVERAGES)}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
        for name, value in (
            ("train_size", train_size),
            ("eval_size", eval_size),
            ("max_candidates", max_candidates),
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.data = load_ravel(ravel_dir, entity_type)  # validates the directory and the type
        self.data.check_attribute(target_attribute)
        self.lm, self.n_tokens = lm, ACCURACIES[accuracy]
        self.attributes = self.data.attributes
        self.templates = [(a, t) for a in self.attributes for t in self.data.prompts[a]]  # the metric's groups
        self.template_index = {pair: i for i, pair in enumerate(self.templates)}
        self.group_attribute = [self.attributes.index(a) for a, _ in self.templates]
        self._named: dict[tuple[str, str], set] = {}  # (separator, attribute) -> its values' tokens
        self.target_attribute = target_attribute
        self.target_index = self.attributes.index(target_attribute)
        self.entity_names = sorted(self.data.entities)
        self.entity_index = {e: i for i, e in enumerate(self.entity_names)}
        if source != "attribute" and not self.data.wikipedia:
            raise ValueError(f"source={source!r} needs Wikipedia prompts, and {entity_type!r} has none")
        self.kept: dict[str, dict[str, int]] = {}  # split -> attribute -> (entity, template) pairs kept
        self.checked: dict[str, dict[str, int]] = {}  # split -> attribute -> pairs checked
        self.splits: dict[str, list[RavelExample]] = {}

    # -- public helpers -----------------------------------------------------------------------

    def values(self, attribute: str) -> list[str]:
        """The value of `attribute` for every entity, in the order of `entity_names` ('' if none)."""
        self.data.check_attribute(attribute)
        return [self.data.entities[e].get(attribute, "") for e in self.entity_names]

    # -- setup --------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.tokenizer = load_tokenizer(self.lm)
        self.prefix = bos_prefix(self.tokenizer)
        model = load_lm(self.lm)
        kept = {s: self.filter_split(model, s) for s in SPLITS}
        self._model, self._answers = model, AnswerCache(self.lm, self.n_tokens)  # Cause labels: the model's answers
        train_bases = {(q.entity, q.template) for qs in kept["train"].values() for q in qs}
        for s in SPLITS:
            if s != "train":  # never an eval base that is also a train base (disjoint by construction)
                kept[s] = {a: [q for q in qs if (q.entity, q.template) not in train_bases] for a, qs in kept[s].items()}
            rng = random.Random(f"{self.hparams.seed}-{s}")
            n = self.hparams.train_size if s == "train" else self.hparams.eval_size
            with_iso = s != "train" or self.hparams.multitask
            self.splits[s] = self.make_examples(kept[s], self.source_pool(kept[s], s), n, with_iso, rng, s)
        self._answers.save()
        del self._model, self._answers

    def model_answers(self, queries: list[Query]) -> list[list[int]]:
        """The model's greedy answer (n tokens) to each query, from the answer cache or computed
        (during setup only)."""
        self._answers.fill(queries, partial(self.predict_next, self._model))
        return [self._answers.get(q.ids) for q in queries]

    def predict_next(self, model, queries: list[Query]) -> list[list[int]]:
        """The model's next n tokens after each prompt, greedy (`greedy_tokens`)."""
        return greedy_tokens(model, [q.ids for q in queries], self.tokenizer.pad_token_id, self.n_tokens)

    def candidates(self, attribute: str, split: str) -> list[tuple[str, str]]:
        """(entity, template) pairs of `attribute` in `split`, at most max_candidates of them."""
        d = self.data
        if self.hparams.split == "entity":
            entities = [e for e in self.entity_names if d.entity_split.get(e) == split]
            templates = [t for t in d.prompts[attribute] if self._official_template(t)]
        else:
            entities = self.entity_names
            templates = [t for t in d.prompts[attribute] if d.prompt_split.get(t) == split]
        pairs = [(e, t) for t in templates for e in entities if d.entities[e].get(attribute)]
        rng = random.Random(f"{self.hparams.seed}-{split}-{attribute}")
        return rng.sample(pairs, min(len(pairs), self.hparams.max_candidates))

    def _official_template(self, template: str, split: str | None = None) -> bool:
        """Whether the entity split uses `template` (`entity_templates`): every one with `all`;
        with `train`, those whose split (`split`, else the prompt split's) is `train`."""
        if self.hparams.entity_templates == "all":
            return True
        return (split if split is not None else self.data.prompt_split.get(template)) == "train"

    def encode(self, entity: str, template: str, attribute: str | None) -> Query:
        """Fill %s with the entity; the site is the token holding the entity's last character."""
        return Query(entity, template, attribute, *encode_prompt(self.tokenizer, self.prefix, template, entity))

    def value_tokens(self, template: str, value: str) -> tuple[int, ...]:
        """The answer `value` is as it follows the prompt: its first n tokens."""
        return _value_tokens(self.tokenizer, value_separator(template) + value, self.n_tokens)

    def named(self, template: str, attribute: str, generated: list[int]) -> tuple[int, ...]:
        """The value of `attribute` a generation after `template` starts with (`named_value`)."""
        key = (value_separator(template), attribute)
        if key not in self._named:
            self._named[key] = {self.value_tokens(template, v) for v in self.data.values(attribute).values()}
        return named_value(generated, self._named[key])

    def filter_split(self, model, split: str) -> dict[str, list[Query]]:
        """attribute -> the pairs the model answers right: its greedy answer starts with the
        value's answer tokens (`answer_hit`). The model's answers are kept on disk (`AnswerCache`),
        so each prompt is run once per model."""
        kept = {}
        answers = AnswerCache(self.lm, self.n_tokens)
        self.kept[split], self.checked[split] = {}, {}
        for attribute in self.attributes:
            queries = [self.encode(e, t, attribute) for e, t in self.candidates(attribute, split)]
            answers.fill(queries, partial(self.predict_next, model))
            correct = [
                q
                for q in queries
                if answer_hit(
                    answers.get(q.ids), self.value_tokens(q.template, self.data.entities[q.entity][attribute])
                )
            ]
            kept[attribute] = sorted(correct, key=lambda q: (q.entity, q.template))
            self.kept[split][attribute], self.checked[split][attribute] = len(correct), len(queries)
            print(
                f"RAVEL {self.data.entity_type} {self.hparams.split}-split {split} {attribute}: "
                f"kept {len(correct)} of {len(queries)} (entity, template) pairs the model answers correctly"
            )
        answers.save()
        return kept

    def source_pool(self, kept: dict[str, list[Query]], split: str) -> dict[str, list[Query]]:
        """Source prompts of a split: kept attribute prompts and/or Wikipedia prompts."""
        pools = {}
        if self.hparams.source in ("attribute", "mixed"):
            pools["attribute"] = [q for qs in kept.values() for q in qs]
        if self.hparams.source in ("wikipedia", "mixed"):
            d = self.data
            if self.hparams.split == "entity":  # the source entity comes from the split's entities
                wiki = [
                    (p, e)
                    for p, e, s in d.wikipedia
                    if d.entity_split.get(e) == split and self._official_template(p, s)
                ]
            else:  # the prompt comes from the split's prompts
                wiki = [(p, e) for p, e, s in d.wikipedia if s == split]
            pools["wikipedia"] = [self.encode(e, p, None) for p, e in wiki]
        return {k: v for k, v in pools.items() if v}

    def make_examples(self, kept, pools, n_cause, with_iso, rng, split) -> list[RavelExample]:
        target = self.target_attribute
        examples = self.sample(kept, pools, target, target, n_cause, CAUSE, rng, split)
        if with_iso:
            others = [a for a in self.attributes if a != target and kept[a]]
            for a in sorted(set(self.attributes) - set(others) - {target}):
                print(f"RAVEL {split}: no Iso examples for {a!r} (the model answers none of its pairs right)")
            for j, attribute in enumerate(others):  # n_cause iso examples, spread evenly
                n = n_cause // len(others) + (j < n_cause % len(others))
                if n:
                    examples += self.sample(kept, pools, attribute, target, n, ISO, rng, split)
        return examples

    def sample(self, kept, pools, queried, target, n, kind, rng, split) -> list[RavelExample]:
        """n examples whose base (E, template) queries `queried`, each with a source entity E'
        whose value of `queried` differs from E's in its answer tokens (Cause: queried = A*, and
        the label is A*(E'); Iso: the label stays A(E), and a leak of E' would show)."""
        bases, d = kept[queried], self.data
        what = "Cause" if kind == CAUSE else "Iso"
        checked = self.checked[split][queried]
        if not bases:
            raise ValueError(
                f"No {what} examples for attribute {queried!r} in the {split} split: all {checked} candidate "
                f"(entity, template) pairs were dropped because the model {self.lm!r} answers them wrongly"
            )
        sources = [q for pool in pools.values() for q in pool]
        usable = self._usable_bases(bases, sources, queried)
        if not usable:
            raise ValueError(
                f"No {what} examples for attribute {queried!r} in the {split} split: of {checked} candidate pairs "
                f"{checked - len(bases)} were dropped because the model answers them wrongly, and the other "
                f"{len(bases)} have no informative source (an entity whose {queried!r} value differs in its "
                f"answer tokens) among {len(sources)} source prompts"
            )
        out, order, tried = [], [], 0
        own_answer = kind == CAUSE and self.hparams.cause_label == "model"
        while len(out) < n:
            drawn = self._draw(usable, pools, sources, n - len(out), order, rng)
            if own_answer:  # y = what the model says for the base template with E' (official `inv_label`)
                generated = self.model_answers([self.encode(src.entity, base.template, queried) for base, src in drawn])
                labels = [self.named(base.template, queried, g) for (base, _), g in zip(drawn, generated)]
            else:
                labels = [
                    self.value_tokens(base.template, d.entities[(src if kind == CAUSE else base).entity][queried])
                    for base, src in drawn
                ]
            for (base, src), label in zip(drawn, labels):
                base_label = self.value_tokens(base.template, d.entities[base.entity][queried])
                if own_answer and label == base_label:
                    continue  # the model's answer would not change: no Cause example
                out.append(self._example(base, src, base_label, label, queried, kind))
            tried += len(drawn)
            if len(out) < n and tried >= 20 * n + 200:
                raise ValueError(
                    f"No {what} examples for attribute {queried!r} in the {split} split: {len(out)} of {tried} drawn "
                    f"(base, source) pairs change the model's answer for the base template with the source entity "
                    f"(cause_label='model'); try cause_label='gold' or more max_candidates"
                )
        return out

    def _usable_bases(self, bases: list[Query], sources: list[Query], queried: str) -> list[tuple[Query, set]]:
        """(base, its informative source entities) for each base that has any: the source entities
        whose value of `queried` differs from the base entity's in its answer tokens."""
        d = self.data
        source_entities = sorted({q.entity for q in sources if d.entities[q.entity].get(queried)})
        by_token = {}  # (separator, token) -> source entities whose value starts with that token

        def token(sep, entity):
            return _value_tokens(self.tokenizer, sep + d.entities[entity][queried], self.n_tokens)

        for sep in {value_separator(b.template) for b in bases}:
            for e in source_entities:
                by_token.setdefault((sep, token(sep, e)), set()).add(e)
        usable = []
        for b in bases:
            sep = value_separator(b.template)
            ok = set(source_entities) - by_token.get((sep, token(sep, b.entity)), set())
            if ok:
                usable.append((b, ok))
        return usable

    @staticmethod
    def _draw(usable, pools, sources, n: int, order: list[int], rng) -> list[tuple[Query, Query]]:
        """n (base, source) pairs: every usable base once before any repeats (`order`, the bases
        still to draw, is refilled in place), each with a random informative source."""
        drawn = []
        for _ in range(n):
            if not order:
                order.extend(range(len(usable)))
                rng.shuffle(order)  # every base once before any repeats
            base, ok = usable[order.pop()]
            pool = pools[rng.choice(sorted(pools))]  # `mixed`: each source kind half the time
            choices = [q for q in pool if q.entity in ok] or [q for q in sources if q.entity in ok]
            drawn.append((base, rng.choice(choices)))
        return drawn

    def _example(
        self, base: Query, src: Query, base_label: tuple, label: tuple, queried: str, kind: int
    ) -> RavelExample:
        """The interchange example of base and source, with their answers (token tuples)."""
        return RavelExample(
            base.ids,
            src.ids,
            {REGION: base.entity_pos},
            {REGION: src.entity_pos},
            base_label=base_label[0],
            target=label[0],
            answers=(label, base_label),
            group=self.template_index[(queried, base.template)],
            attribute=self.attributes.index(queried),
            kind=kind,
            base_entity=self.entity_index[base.entity],
            source_entity=self.entity_index[src.entity],
            base_template=base.template,
            source_template=src.template,
        )

    # -- loaders ------------------------------------------------------------------------------

    def loader(self, split: str, batch_size: int, shuffle: bool = False, shard: bool = True) -> DataLoader:
        """Batches of one split (train, val or test); `shard=False`: all of it on every process."""
        collate_fn = partial(
            collate_pairs, region=REGION, pad_id=self.tokenizer.pad_token_id, padding_side=self.hparams.padding_side
        )
        return split_loader(self.splits[split], batch_size, collate_fn, self.trainer if shard else None, shuffle)

    def metric_callbacks(self) -> list:
        """What this data is scored by: Cause, Iso and Disentangle."""
        return [DisentangleCallback(self.group_attribute, self.hparams.average)]

    def dev_metric(self) -> DevDisentangle:
        """What a fitted intervention's candidates are chosen by on the val split: Disentangle."""
        return DevDisentangle(len(self.attributes), self.group_attribute, self.hparams.average)

    def site_labels(self, batch: PairBatch, side: str) -> list[str]:
        """The class of each site state a closed-form intervention is fitted on: the target
        attribute's value of its entity."""
        values = self.values(self.hparams.target_attribute)
        return [values[e] for e in batch.side(side).entity.tolist()]
