"""SyntaxGym prediction formulas: parse `[(5;%reduced_ambig%) > (5;%unreduced_ambig%)] & ...`
into a syntax tree and evaluate it on one item's region surprisals.

`(5;%reduced_ambig%)` is S(region 5 | condition reduced_ambig) in bits (see
`lit_interventions.core.surprisal` for how S is computed: `meta.metric` sum or mean).

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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

EQUALITY_RTOL, EQUALITY_ATOL = 1e-5, 1e-3

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
    operand: Node
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
    left: Node
    right: Node

    @property
    def is_truth(self) -> bool:
        return self.op in COMPARISONS or self.op in LOGICAL

    def evaluate(self, values: RegionValues):
        rule = {**ARITHMETIC, **COMPARISONS, **LOGICAL}[self.op]
        return rule(self.left.evaluate(values), self.right.evaluate(values))


Node = RegionRef | Number | Negative | BinaryOp


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
