"""CausalGym templates: read the published schema and sample span-aligned minimal pairs.

Schema (CausalGym, Arora et al. 2024, §3.2), one entry per task:

    {task: {"templates": ["{name} {completion} because"],
            "label": "name",                       # or a list of names
            "labels": {"he": ["he"], "she": ["she"]},
            "variables": {"name": {"he": [...], "she": [...]}, "completion": ["walked", ...]},
            "result_prepend_space": true}}

A variable named `head.part` (`vp.verb`, `vp.cont`) is one part of the head variable `head`:
the parts of one head list equally many options, and a pair takes every part at one index,
drawn once per head variable, so the i-th verb comes with the i-th continuation.

A template is cut into *regions*: each `{variable}` (with the space before it) is a region named
after the variable, and each stretch of literal text between variables is a region named by
its text ("because"). Pairs are aligned at the last token of each region.
"""

from __future__ import annotations

import json
import random
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from lit_interventions.core.files import read_utf8

BUILTIN_TEMPLATES = Path(__file__).parent / "data" / "causalgym.json"
_PIECES = re.compile(r"( ?\{[^{}]+\})")  # a variable with its leading space, kept by re.split
_VARIABLE = re.compile(r"^ ?\{([^{}]+)\}$")


@dataclass(frozen=True)
class Region:
    name: str
    variable: str | None  # None for literal text
    text: str  # the literal text, or the template's "{var}" (with its leading space, if any)


@dataclass
class Sentence:
    text: str
    spans: dict[str, tuple[int, int]]  # region name -> [start, end) characters, whitespace excluded
    label: str


@dataclass
class Pair:
    base: Sentence
    source: Sentence
    base_type: str
    source_type: str

    def swapped(self) -> Pair:
        return Pair(self.source, self.base, self.source_type, self.base_type)


def head_variable(variable: str) -> str | None:
    """The head variable a dotted part belongs to (`vp` for `vp.verb`); None for a plain name."""
    return variable.split(".")[0] if "." in variable else None


def split_regions(template: str) -> list[Region]:
    """Cut a template into regions, in order. Repeated literal names get a `#2`, `#3` suffix."""
    regions, seen = [], {}
    for piece in _PIECES.split(template):
        if not piece:
            continue
        match = _VARIABLE.match(piece)
        name = match.group(1) if match else (piece.strip() or piece)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        regions.append(Region(name, match.group(1) if match else None, piece))
    return regions


@dataclass
class TaskTemplate:
    """One CausalGym task: its templates, label variable(s), label words per type and options."""

    name: str
    templates: list[str]
    label_variables: list[str]
    labels: dict[str, list[str]]
    variables: dict[str, list[str] | dict[str, list[str]]]
    result_prepend_space: bool = True
    label_prepend_space: bool = False
    regions: list[str] = field(init=False)

    def __post_init__(self):
        names: list[str] = []
        for template in self.templates:
            for region in split_regions(template):
                if region.name not in names:
                    names.append(region.name)
        self.regions = names

    @property
    def types(self) -> list[str]:
        return list(self.labels)

    @property
    def label_region(self) -> str:
        """The default site: the label variable. Where every label variable can be empty (the
        absent comma of garden_npz_obj, the reduced relative of garden_mvrr), one side of every
        pair has no position there, so the region just before it is used instead."""
        for var in self.label_variables:
            if all(all(options) for options in self.variables[var].values()):
                return var
        regions = [r.name for r in split_regions(self.templates[0])]
        index = regions.index(self.label_variables[0])
        return regions[index - 1] if index > 0 else self.label_variables[0]

    @property
    def scored_regions(self) -> list[str]:
        """The regions OverallOdds and selectivity are taken over: from the first region, in
        template order, that is a label variable, on (the official `das.py` loops from
        `first_var_pos`). Earlier regions precede the alternation: under causal attention base
        and source states are identical there and every method scores exactly 0."""
        first = next((i for i, name in enumerate(self.regions) if name in self.label_variables), 0)
        return self.regions[first:]

    def label_words(self) -> dict[str, list[str]]:
        """Label words per type, exactly as they are tokenised."""
        prefix = " " if self.result_prepend_space else ""
        return {t: [prefix + word for word in words] for t, words in self.labels.items()}

    def _fill(self, region: Region, option: str) -> str:
        """The option with the template's space before it; an empty option takes no space."""
        if not option:
            return ""
        lead = " " if self.label_prepend_space and region.variable in self.label_variables else ""
        return (" " if region.text.startswith(" ") else "") + lead + option

    def distinct_pairs(self, same_type: bool = False) -> int:
        """How many distinct pairs `sample_pair` can draw (a pair and its swap counted once): per
        template and ordered pair of types, the product of the option counts of its regions, a
        head variable counted once by its distinct rows of parts; halved,
        as every ordered pair has its swap. Identical texts from different choices count twice, so
        this is an upper bound, exact for the built-in tasks. `same_type`: Iso pairs."""
        ordered = 0
        for template in self.templates:
            for base_type in self.types:
                for source_type in self.types:
                    if (base_type == source_type) == same_type:
                        ordered += self._choices(template, base_type, source_type, same_type)
        return ordered // 2

    def _choices(self, template: str, base_type: str, source_type: str, same_type: bool = False) -> int:
        count, parts = 1, {}
        for region in split_regions(template):
            options = self.variables.get(region.variable) if region.variable else None
            if options is None:
                continue
            if region.variable in self.label_variables:
                count *= len(set(options[base_type])) * len(set(options[source_type]))
            elif head_variable(region.variable) is not None:  # counted once per head variable, below
                parts.setdefault(head_variable(region.variable), set()).add(region.variable)
            else:  # shared by a Cause pair's sentences; sampled for each of an Iso pair's
                count *= len(set(options)) ** (2 if same_type else 1)
        for names in parts.values():
            names = sorted(names)
            rows = {tuple(self.variables[name][i] for name in names) for i in range(len(self.variables[names[0]]))}
            count *= len(rows) ** (2 if same_type else 1)
        return count

    def sample_pair(self, rng: random.Random, same_type: bool = False) -> Pair:
        """§3.2: types t1 ≠ t2; label variables take options of t1 (base) / t2 (source); every
        other variable takes one option shared by both sentences. The dotted parts of one head
        variable (`vp.verb`, `vp.cont`) take their options at one index, drawn once per pair for
        that head variable where its first part appears, so the parts stay together.

        `same_type` samples an Iso pair instead (for the multi-task loss of MDAS/MDBM): both
        sentences of one type, every variable sampled for each sentence on its own (a head
        variable's index too), so the source differs from the base in everything but what
        decides the label."""
        base_type, source_type = (rng.choice(self.types),) * 2 if same_type else rng.sample(self.types, 2)
        template = rng.choice(self.templates)
        base_parts, source_parts = [], []
        indices: dict[str, tuple[int, int]] = {}  # head variable -> its (base, source) index
        for region in split_regions(template):
            if region.variable is None:
                base_parts.append((region.name, region.text))
                source_parts.append((region.name, region.text))
                continue
            base_choice, source_choice = self._draw(region.variable, rng, base_type, source_type, same_type, indices)
            base_parts.append((region.name, self._fill(region, base_choice)))
            source_parts.append((region.name, self._fill(region, source_choice)))
        words = self.label_words()
        return Pair(
            _sentence(base_parts, rng.choice(words[base_type])),
            _sentence(source_parts, rng.choice(words[source_type])),
            base_type,
            source_type,
        )

    def _draw(
        self,
        variable: str,
        rng: random.Random,
        base_type: str,
        source_type: str,
        same_type: bool,
        indices: dict[str, tuple[int, int]],
    ) -> tuple[str, str]:
        """One variable's (base, source) options; `indices` holds each head variable's index."""
        options = self.variables[variable]
        if variable in self.label_variables:
            return rng.choice(options[base_type]), rng.choice(options[source_type])
        head = head_variable(variable)
        if head is not None:
            if head not in indices:
                base_index = rng.randrange(len(options))
                indices[head] = (base_index, rng.randrange(len(options)) if same_type else base_index)
            base_index, source_index = indices[head]
            return options[base_index], options[source_index]
        if same_type:
            return rng.choice(options), rng.choice(options)
        choice = rng.choice(options)
        return choice, choice


def _sentence(parts: list[tuple[str, str]], label: str) -> Sentence:
    text, spans = "", {}
    for name, piece in parts:
        start = len(text) + (len(piece) - len(piece.lstrip()))
        text += piece
        end = len(text.rstrip())
        if end > start:  # an empty option ("") leaves the region without a position
            spans[name] = (start, end)
    return Sentence(text, spans, label)


def _fail(path: Path | str, task: str, key: str, why: str) -> ValueError:
    return ValueError(f"Malformed template file {path}: task {task!r}, key {key!r}: {why}")


def _check_parts(path: Path | str, task: str, variables: dict, label_variables: list[str]) -> None:
    """The dotted parts of one head variable are drawn at one index: equally many options."""
    sizes: dict[str, tuple[str, int]] = {}
    for var, options in variables.items():
        head = head_variable(var)
        if head is None or var in label_variables:
            continue
        first, size = sizes.setdefault(head, (var, len(options)))
        if len(options) != size:
            raise _fail(
                path,
                task,
                f"variables.{var}",
                f"{len(options)} options, but {first!r} of the same head variable {head!r} has {size}; "
                "the parts of one head variable are drawn at one index, so they need equally many options",
            )


def parse_task(name: str, spec: dict, path: Path | str = "<dict>") -> TaskTemplate:
    """Validate one task entry of the schema and build its TaskTemplate."""
    if not isinstance(spec, dict):
        raise _fail(path, name, name, "each task must be a JSON object")
    for key in ("templates", "label", "labels", "variables"):
        if key not in spec:
            raise _fail(path, name, key, "missing (needed: templates, label, labels, variables)")
    templates = spec["templates"]
    if isinstance(templates, str):
        templates = [templates]
    if not templates or not all(isinstance(t, str) and t for t in templates):
        raise _fail(path, name, "templates", "must be a non-empty list of strings")
    labels = spec["labels"]
    if not isinstance(labels, dict) or len(labels) < 2:
        raise _fail(path, name, "labels", "must map at least two types to lists of label words")
    for label_type, words in labels.items():
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w for w in words):
            raise _fail(path, name, f"labels.{label_type}", "must be a non-empty list of non-empty strings")
    label_variables = spec["label"] if isinstance(spec["label"], list) else [spec["label"]]
    variables = spec["variables"]
    if not isinstance(variables, dict):
        raise _fail(path, name, "variables", "must be an object from variable name to options")
    for var in label_variables:
        options = variables.get(var)
        if not isinstance(options, dict) or set(options) != set(labels):
            raise _fail(
                path, name, f"variables.{var}", f"the label variable must map each type {sorted(labels)} to options"
            )
    for var, options in variables.items():
        lists = options.values() if isinstance(options, dict) else [options]
        if not all(isinstance(opts, list) and opts and all(isinstance(o, str) for o in opts) for opts in lists):
            raise _fail(path, name, f"variables.{var}", "options must be non-empty lists of strings")
        if isinstance(options, dict) and var not in label_variables:
            raise _fail(path, name, f"variables.{var}", "only label variables may have options per type")
    _check_parts(path, name, variables, label_variables)
    for template in templates:
        for region in split_regions(template):
            if region.variable is not None and region.variable not in variables:
                raise _fail(path, name, "templates", f"{template!r} uses {{{region.variable}}}, not in variables")
    return TaskTemplate(
        name=name,
        templates=list(templates),
        label_variables=label_variables,
        labels={t: list(w) for t, w in labels.items()},
        variables=variables,
        result_prepend_space=bool(spec.get("result_prepend_space", True)),
        label_prepend_space=bool(spec.get("label_prepend_space", False)),
    )


def _fetch(directory: Path) -> str:
    """How to get CausalGym's published templates into `directory`."""
    out = shlex.quote(str(directory))
    return (
        f"fetch CausalGym's templates with `lit-interventions data causalgym --out {out}` and pass "
        f"--data.templates {shlex.quote(str(directory / 'templates.json'))}"
    )


def load_templates(path: str | Path | None = None) -> dict[str, dict]:
    """The raw task entries of a template file (default: our built-in file of 29 tasks)."""
    path = Path(path) if path is not None else BUILTIN_TEMPLATES
    if path.is_dir():
        inside = path / "templates.json"
        if inside.is_file():
            raise FileNotFoundError(f"--data.templates {path} is a directory; pass the file in it: {inside}")
        raise FileNotFoundError(
            f"--data.templates {path} is a directory, not a JSON file, and holds no templates.json; {_fetch(path)}"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"Template file not found: {path} (--data.templates must name a JSON file); "
            f"{_fetch(path.parent if path.suffix == '.json' else path)}"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"Template file {path} is empty; {_fetch(path.parent)}")
    try:
        text = read_utf8(path)  # UTF-8, a byte-order mark first left out
    except OSError as err:
        raise ValueError(f"Template file {path} cannot be read ({err.strerror or type(err).__name__})") from None
    except ValueError as err:  # not UTF-8: it names the file and the first bad byte
        raise ValueError(f"Malformed template file {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"Malformed template file {path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})"
        ) from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"Malformed template file {path}: the top level must be an object from task name to task")
    return data


def load_task(task: str, path: str | Path | None = None) -> TaskTemplate:
    data = load_templates(path)
    if task not in data:
        raise ValueError(f"Unknown task {task!r} in {path or BUILTIN_TEMPLATES}; tasks: {', '.join(data)}")
    return parse_task(task, data[task], path or BUILTIN_TEMPLATES)


def sample_pairs(
    task: TaskTemplate,
    n: int,
    seed: int,
    exclude: set[str] = frozenset(),
    max_tries_per_pair: int = 200,
    same_type: bool = False,
) -> list[Pair]:
    """n distinct pairs, none of whose sentences is in `exclude`; each also added swapped (2n).
    `same_type`: Iso pairs (`TaskTemplate.sample_pair`)."""
    available = task.distinct_pairs(same_type)
    if n > available:  # refused at once: sampling for more would spin for n * max_tries_per_pair draws
        raise ValueError(
            f"{n} pairs asked for, but task {task.name!r} has only {available} distinct pairs; "
            f"ask for at most {available} (train_pairs, eval_pairs)."
        )
    rng = random.Random(seed)
    pairs, seen = [], set()
    tries = 0
    while len(pairs) < n:
        tries += 1
        if tries > n * max_tries_per_pair:
            raise ValueError(
                f"Task {task.name!r} yields only {len(pairs)} distinct pairs of the {n} asked for"
                + (f" with no sentence among the other splits' {len(exclude)}" if exclude else "")
                + "; add options to its variables or ask for fewer pairs."
            )
        pair = task.sample_pair(rng, same_type)
        key = (pair.base.text, pair.source.text)
        if key in seen or (key[::-1]) in seen or pair.base.text in exclude or pair.source.text in exclude:
            continue
        seen.add(key)
        pairs.append(pair)
    return pairs + [pair.swapped() for pair in pairs]
