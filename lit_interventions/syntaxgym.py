"""SyntaxGym evaluation: region surprisal of a frozen LM against each suite's predictions.

    python -m lit_interventions.syntaxgym --suites DIR_OR_FILES --lm NAME --out FILE

A suite (SyntaxGym JSON: `meta`, `predictions`, `items`) has items; an item has conditions; a
condition is a list of regions with `content`. A prediction is a formula over region
surprisals, e.g. `[(5;%reduced_ambig%) > (5;%unreduced_ambig%)] & [...]`, where
`(5;%reduced_ambig%)` is S(region 5 | condition reduced_ambig) in bits (see
`lit_interventions.surprisal` for how S is computed: `meta.metric` sum or mean).

    item correct    = 1 if every prediction holds for the item
    suite accuracy  = mean over the suite's items
    SG score        = mean over suites of the suite accuracy

Formula grammar (lowest precedence first; binary operators are left-associative):

    formula    := comparison (("&" | "|") comparison)*
    comparison := sum (("<" | ">" | "=") sum)?
    sum        := signed (("+" | "-") signed)*
    signed     := "-" signed | atom
    atom       := region | number | "[" formula "]" | "(" formula ")"
    region     := "(" (integer | "*") ";" "%" condition "%" ")"

`a = b` holds when |a - b| <= 1e-3 + 1e-5 |b| (SyntaxGym's tolerance); `(*;%c%)` is the sum
over all regions of condition c. `&`/`|` need true/false operands; `<`, `>`, `=`, `+`, `-`
need numbers; a whole formula must be true/false.

The output CSV has the header `suite,items,accuracy` and one row per suite; its last row is
`SG score,<total items over all suites>,<mean accuracy over suites>`.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Union

import torch

from lit_interventions.lm import DEFAULT_LM, DTYPES, load_lm, load_tokenizer
from lit_interventions.surprisal import METRICS, region_surprisals

EQUALITY_RTOL, EQUALITY_ATOL = 1e-5, 1e-3
SG_SCORE_ROW = "SG score"

# (condition name, region number) -> S in bits
RegionValues = dict[tuple[str, int], float]


# ---------------------------------------------------------------- formula syntax tree


@dataclass(frozen=True)
class RegionRef:
    """(region;%condition%): S(region | condition); region None stands for `*`, all regions."""

    region: int | None
    condition: str
    is_truth = False

    def evaluate(self, values: RegionValues) -> float:
        if self.region is None:
            return sum(value for (condition, _), value in values.items() if condition == self.condition)
        return values[self.condition, self.region]


@dataclass(frozen=True)
class Number:
    value: float
    is_truth = False

    def evaluate(self, values: RegionValues) -> float:
        return self.value


@dataclass(frozen=True)
class Negative:
    operand: "Node"
    is_truth = False

    def evaluate(self, values: RegionValues) -> float:
        return -self.operand.evaluate(values)


def _is_close(left: float, right: float) -> bool:
    return abs(left - right) <= EQUALITY_ATOL + EQUALITY_RTOL * abs(right)


ARITHMETIC: dict[str, Callable[[float, float], float]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "=": _is_close,
}
LOGICAL: dict[str, Callable[[bool, bool], bool]] = {"&": lambda a, b: a and b, "|": lambda a, b: a or b}


@dataclass(frozen=True)
class BinaryOp:
    """left op right; `is_truth` says whether the result is true/false (else a number)."""

    op: str
    left: "Node"
    right: "Node"

    @property
    def is_truth(self) -> bool:
        return self.op in COMPARISONS or self.op in LOGICAL

    def evaluate(self, values: RegionValues):
        rule = {**ARITHMETIC, **COMPARISONS, **LOGICAL}[self.op]
        return rule(self.left.evaluate(values), self.right.evaluate(values))


Node = Union[RegionRef, Number, Negative, BinaryOp]


def region_refs(node: Node) -> list[RegionRef]:
    """Every (region;%condition%) the formula reads, in order."""
    if isinstance(node, RegionRef):
        return [node]
    if isinstance(node, Negative):
        return region_refs(node.operand)
    if isinstance(node, BinaryOp):
        return region_refs(node.left) + region_refs(node.right)
    return []


# ---------------------------------------------------------------- formula tokenizer + parser

TOKEN_PATTERNS = [
    ("region", r"\(\s*(?:\d+|\*)\s*;\s*%[^%]+%\s*\)"),
    ("number", r"\d+(?:\.\d*)?|\.\d+"),
    ("op", r"[-+<>=&|]"),
    ("open", r"[\[(]"),
    ("close", r"[\])]"),
    ("space", r"\s+"),
]
TOKEN_REGEX = re.compile("|".join(f"(?P<{kind}>{pattern})" for kind, pattern in TOKEN_PATTERNS))
REGION_REGEX = re.compile(r"\(\s*(\d+|\*)\s*;\s*%([^%]+)%\s*\)")
CLOSING = {"[": "]", "(": ")"}


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    position: int


class FormulaError(ValueError):
    """A formula that does not parse; the message names the suite and the formula."""


def tokenize_formula(formula: str) -> list[Token]:
    tokens, position = [], 0
    while position < len(formula):
        match = TOKEN_REGEX.match(formula, position)
        if match is None:
            raise SyntaxError(f"unexpected character {formula[position]!r} at position {position}")
        if match.lastgroup != "space":
            tokens.append(Token(match.lastgroup, match.group(), position))
        position = match.end()
    return tokens


class _Parser:
    """Recursive descent over the token list; one method per grammar rule (module docstring)."""

    def __init__(self, tokens: list[Token], length: int):
        self.tokens, self.index, self.length = tokens, 0, length

    def peek(self) -> Token | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def take(self) -> Token:
        token = self.peek()
        if token is None:
            raise SyntaxError(f"the formula ends early (position {self.length})")
        self.index += 1
        return token

    def at_op(self, ops: dict) -> bool:
        token = self.peek()
        return token is not None and token.kind == "op" and token.text in ops

    def formula(self) -> Node:
        node = self.comparison()
        while self.at_op(LOGICAL):
            op = self.take()
            node = _typed(BinaryOp(op.text, node, self.comparison()), op, operands_truth=True)
        return node

    def comparison(self) -> Node:
        node = self.sum()
        if self.at_op(COMPARISONS):
            op = self.take()
            node = _typed(BinaryOp(op.text, node, self.sum()), op, operands_truth=False)
            if self.at_op(COMPARISONS):
                raise SyntaxError(f"chained comparison at position {self.peek().position}; bracket each one")
        return node

    def sum(self) -> Node:
        node = self.signed()
        while self.at_op(ARITHMETIC):
            op = self.take()
            node = _typed(BinaryOp(op.text, node, self.signed()), op, operands_truth=False)
        return node

    def signed(self) -> Node:
        if self.at_op({"-": None}):
            op = self.take()
            operand = self.signed()
            if operand.is_truth:
                raise SyntaxError(f"'-' at position {op.position} needs a number, not a comparison")
            return Negative(operand)
        return self.atom()

    def atom(self) -> Node:
        token = self.take()
        if token.kind == "region":
            region, condition = REGION_REGEX.fullmatch(token.text).groups()
            return RegionRef(None if region == "*" else int(region), condition)
        if token.kind == "number":
            return Number(float(token.text))
        if token.kind == "open":
            node = self.formula()
            if self.peek() is None:
                raise SyntaxError(f"{token.text!r} at position {token.position} is never closed")
            close = self.take()
            if close.text != CLOSING[token.text]:
                raise SyntaxError(
                    f"{token.text!r} at position {token.position} is closed by {close.text!r} at position "
                    f"{close.position}; expected {CLOSING[token.text]!r}"
                )
            return node
        raise SyntaxError(f"unexpected {token.text!r} at position {token.position}")


def _typed(node: BinaryOp, op: Token, operands_truth: bool) -> BinaryOp:
    """Reject `&` over numbers and `<`, `>`, `=`, `+`, `-` over comparisons."""
    wanted = "comparisons" if operands_truth else "numbers"
    for operand in (node.left, node.right):
        if operand.is_truth != operands_truth:
            raise SyntaxError(f"{op.text!r} at position {op.position} needs {wanted} on both sides")
    return node


def parse_formula(formula: str, suite: str = "<no suite>") -> Node:
    """The syntax tree of a prediction formula; FormulaError (a ValueError) if it does not parse."""
    try:
        tokens = tokenize_formula(formula)
        parser = _Parser(tokens, len(formula))
        node = parser.formula()
        if parser.peek() is not None:
            extra = parser.peek()
            raise SyntaxError(f"unexpected {extra.text!r} at position {extra.position}")
        if not node.is_truth:
            raise SyntaxError("a prediction must be a comparison (<, >, =), possibly joined with & or |")
    except SyntaxError as err:
        raise FormulaError(f"suite {suite!r}: cannot parse formula {formula!r}: {err.msg}") from None
    return node


# ---------------------------------------------------------------- suites


@dataclass(frozen=True)
class Prediction:
    formula: str
    tree: Node

    def holds(self, values: RegionValues) -> bool:
        return bool(self.tree.evaluate(values))


@dataclass(frozen=True)
class Suite:
    name: str
    metric: str
    predictions: list[Prediction]
    items: list[dict]


def _check_regions_exist(name: str, prediction: Prediction, items: list[dict]) -> None:
    """Every (region;%condition%) a formula reads must exist in every item."""
    for item in items:
        regions = {
            condition["condition_name"]: {region["region_number"] for region in condition["regions"]}
            for condition in item["conditions"]
        }
        for ref in region_refs(prediction.tree):
            if ref.condition not in regions:
                raise ValueError(
                    f"suite {name!r}: formula {prediction.formula!r} reads condition {ref.condition!r}, which item "
                    f"{item.get('item_number')} lacks; its conditions are {sorted(regions)}"
                )
            if ref.region is not None and ref.region not in regions[ref.condition]:
                raise ValueError(
                    f"suite {name!r}: formula {prediction.formula!r} reads region {ref.region} of condition "
                    f"{ref.condition!r}, which item {item.get('item_number')} lacks; its regions are "
                    f"{sorted(regions[ref.condition])}"
                )


def _check_item(where: str, item) -> None:
    """An item is {"conditions": [{"condition_name", "regions": [{"region_number", "content"}]}]}."""
    conditions = item.get("conditions") if isinstance(item, dict) else None
    if not isinstance(conditions, list) or not conditions:
        raise ValueError(f"{where}: item {item!r:.80} has no 'conditions' list")
    for condition in conditions:
        regions = condition.get("regions") if isinstance(condition, dict) else None
        if not isinstance(regions, list) or "condition_name" not in condition:
            raise ValueError(f"{where}: condition {condition!r:.80} needs a 'condition_name' and a 'regions' list")
        for region in regions:
            if not isinstance(region, dict) or not isinstance(region.get("region_number"), int) or not isinstance(
                region.get("content"), str
            ):
                raise ValueError(
                    f"{where}: region {region!r:.80} needs an integer 'region_number' and a string 'content'"
                )


def suite_from_json(data: dict, source: str) -> Suite:
    """A checked Suite from SyntaxGym JSON; `source` (a path) names it in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a SyntaxGym suite is a JSON object with meta, predictions and items")
    meta = data.get("meta") or {}
    name = meta.get("name") or Path(source).stem
    metric = meta.get("metric", "sum")
    if metric not in METRICS:
        raise ValueError(
            f"suite {name!r} ({source}): meta.metric={metric!r} is not supported; choose one of {list(METRICS)}"
        )
    items = data.get("items")
    if not isinstance(items, list) or not items:
        raise ValueError(f"suite {name!r} ({source}) has no items; a suite needs a non-empty 'items' list")
    for item in items:
        _check_item(f"suite {name!r} ({source})", item)
    raw = data.get("predictions")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"suite {name!r} ({source}) has no predictions; a suite needs a non-empty 'predictions' list")
    predictions = []
    for entry in raw:
        if not isinstance(entry, dict) or entry.get("type", "formula") != "formula" or "formula" not in entry:
            raise ValueError(f"suite {name!r} ({source}): prediction {entry!r} is not of type 'formula'")
        predictions.append(Prediction(entry["formula"], parse_formula(entry["formula"], suite=name)))
    for prediction in predictions:
        _check_regions_exist(name, prediction, items)
    return Suite(name, metric, predictions, items)


def load_suite(path: str | Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suite file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    return suite_from_json(data, str(path))


def suite_paths(paths: list[str]) -> list[Path]:
    """A directory stands for every *.json in it (sorted); files are taken as given."""
    found = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            if not files:
                raise FileNotFoundError(f"no *.json suite files in directory {path}")
            found.extend(files)
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"--suites path not found: {path} (give a directory of *.json or suite files)")
    return found


# ---------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class SuiteResult:
    name: str
    item_correct: list[bool]
    # per item: (condition, region number) -> S in bits
    item_values: list[RegionValues]

    @property
    def items(self) -> int:
        return len(self.item_correct)

    @property
    def accuracy(self) -> float:
        return sum(self.item_correct) / len(self.item_correct)


def _wanted_regions(suite: Suite, condition: str, numbers: list[int]) -> set[int]:
    """Indices (0-based) of the condition's regions that some prediction reads."""
    refs = [ref for prediction in suite.predictions for ref in region_refs(prediction.tree)]
    refs = [ref for ref in refs if ref.condition == condition]
    if any(ref.region is None for ref in refs):
        return set(range(len(numbers)))
    read = {ref.region for ref in refs}
    return {index for index, number in enumerate(numbers) if number in read}


def evaluate_suite(suite: Suite, model, tokenizer, batch_size: int = 16, all_regions: bool = False) -> SuiteResult:
    """Score every condition of every item, then check each item's predictions.

    Only the regions the predictions read are scored (their (condition, region) keys fill
    `item_values`), unless `all_regions` asks for every region.
    """
    keys, sentences, wanted = [], [], []
    for item_index, item in enumerate(suite.items):
        for condition in item["conditions"]:
            name, numbers = condition["condition_name"], [region["region_number"] for region in condition["regions"]]
            keys.append((item_index, name, numbers))
            sentences.append([region["content"] for region in condition["regions"]])
            wanted.append(set(range(len(numbers))) if all_regions else _wanted_regions(suite, name, numbers))
    surprisals = region_surprisals(
        model, tokenizer, sentences, metric=suite.metric, batch_size=batch_size, wanted_regions=wanted
    )
    item_values: list[RegionValues] = [{} for _ in suite.items]
    for (item_index, condition, numbers), values, indices in zip(keys, surprisals, wanted):
        for index in indices:
            item_values[item_index][condition, numbers[index]] = values[index]
    correct = [all(prediction.holds(values) for prediction in suite.predictions) for values in item_values]
    return SuiteResult(suite.name, correct, item_values)


def sg_score(results: list[SuiteResult]) -> float:
    """Mean over suites of the suite accuracy."""
    return sum(result.accuracy for result in results) / len(results)


def write_csv(results: list[SuiteResult], out: Path) -> None:
    """suite,items,accuracy per suite, then the `SG score` row (total items, mean accuracy)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["suite", "items", "accuracy"])
        for result in results:
            writer.writerow([result.name, result.items, f"{result.accuracy:.6f}"])
        writer.writerow([SG_SCORE_ROW, sum(result.items for result in results), f"{sg_score(results):.6f}"])


def _arguments(argv: list[str] | None):
    from jsonargparse import ActionConfigFile

    from lit_interventions.commands import Parser, resolve_configs

    parser = Parser(
        prog="lit-interventions syntaxgym",
        description="SyntaxGym accuracy of a frozen LM: per-suite accuracy and the SG score (mean over suites).",
        default_config_files=[],
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with these options")
    parser.add_argument("--suites", type=str, required=True, nargs="+",
                        help="a directory of *.json suites, or suite files")  # fmt: skip
    parser.add_argument("--lm", type=str, default=DEFAULT_LM, help="what lit_interventions.lm.load_lm accepts")
    parser.add_argument("--out", type=str, required=True, help="CSV: suite,items,accuracy; last row 'SG score'")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=16, help="sentences per forward pass")
    parser.add_argument("--dtype", type=Literal[tuple(sorted(DTYPES))], default="float32", help="the LM's dtype")
    parser.add_argument("--threads", type=int | None, default=None,
                        help="torch CPU threads (default: torch's choice); 1 is much faster when other processes share the cores")  # fmt: skip
    return parser, parser.parse_args(resolve_configs(argv))


def main(argv: list[str] | None = None) -> list[SuiteResult]:
    """`lit-interventions syntaxgym` (and `python -m lit_interventions.syntaxgym`)."""
    from lit_interventions.commands import fail

    parser, args = _arguments(argv)
    out = Path(args.out)
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch_size={args.batch_size} must be a positive integer")
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads={args.threads} must be a positive integer")
            torch.set_num_threads(args.threads)
        suites = [load_suite(path) for path in suite_paths(_flat(args.suites))]  # all checked before the LM loads
        started = time.perf_counter()
        model, tokenizer = load_lm(args.lm, args.dtype), load_tokenizer(args.lm)
        results = []
        for suite in suites:
            results.append(evaluate_suite(suite, model, tokenizer, batch_size=args.batch_size))
            print(f"{suite.name:<28} items {results[-1].items:>3}  accuracy {results[-1].accuracy:.3f}", flush=True)
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))
    score = sg_score(results)
    write_csv(results, out)
    print(f"{SG_SCORE_ROW:<28} suites {len(results):>2}  accuracy {score:.3f}")
    print(f"wrote {out} ({time.perf_counter() - started:.1f} s with model loading)")
    print(f"files in {out.parent}", flush=True)
    return results


def _flat(values) -> list[str]:
    """--suites a b c, --suites '[a, b]' or a YAML list: one flat list of paths."""
    flat = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        flat.extend(_flat(value) if isinstance(value, (list, tuple)) else [str(value)])
    return flat


if __name__ == "__main__":
    main(sys.argv[1:])
