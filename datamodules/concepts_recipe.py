"""AxBench's recipe for concept data, in our own words: the prompts the generator answers, the
reading of its genre replies, our built-in instructions, the input files, and the plan of
generations (`plan_rows`) that `concepts_build.py` runs.

AxBench (`axbench/scripts/generate.py`, `axbench/utils/dataset.py`, instruction mode): per concept,
(1) the generator names the concept's genre, text, code or math (`get_concept_genres`); (2)
training positives are replies to instructions of that genre that work the concept in
(`response_with_concept`); (3) a shared negative pool, concept id -1, holds plain replies to
instructions of each genre (`get_model_continues`); (4) the eval split has, per concept, positives
to held-out instructions and negatives, replies written to avoid the concept
(`response_without_concept`), each row carrying the concept's id. The prompt texts here are ours;
docs/differences.md lists where we depart from the recipe.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

from lit_interventions.core.files import read_utf8

GENRES = ("text", "code", "math")
EMPTY_CONCEPT = "EEEEE"  # output_concept of the negative pool (AxBench's marker)
STAGES = ("genre", "pool", "positive", "eval_positive", "eval_negative")

GENRE_PROMPT = """Sort a concept into one of three kinds of writing.
Text: everyday language, stories, opinions, descriptions.
Code: programming languages, software, markup, queries.
Math: numbers, equations, geometry, proofs.

For example, "birds that migrate in winter" is Text, "error handling in Rust" is Code and "solving
quadratic equations" is Math.

Concept: {concept}

Reply with a single word: Text, Code or Math."""

POSITIVE_PROMPT = """Here is a request:

{instruction}

Answer it, and make {concept} a clear part of your answer, even where that strays from the request.
Let the concept show through what you write instead of repeating its description word for word.
Give the answer alone, with no introduction or comment about it."""

NEGATIVE_PROMPT = """Here is a request:

{instruction}

Answer it naturally. Leave out {concept} entirely: no mention of it and no hint of it.
Give the answer alone, with no introduction or comment about it."""

# Instructions written by us; per genre, the even positions of a seeded shuffle train, the odd ones
# are held out for the eval split.
INSTRUCTIONS = {
    "text": [
        "Describe a good way to spend a rainy Sunday afternoon.",
        "Write a short note thanking a neighbour for their help.",
        "What should someone pack for a weekend trip?",
        "Give three tips for keeping a houseplant alive.",
        "Tell a short story about a lost key.",
        "Explain why people enjoy visiting museums.",
        "Write a postcard from a seaside town.",
        "How can a small team run better meetings?",
        "Describe the view from a mountain top at dawn.",
        "Suggest a plan for learning a new language.",
        "Write a product description for a wooden chair.",
        "What makes a good birthday present?",
        "Summarise the plot of a heist movie you invent.",
        "Give advice to someone starting their first job.",
        "Describe a busy market on a Saturday morning.",
        "Write a short poem about an old bicycle.",
    ],
    "code": [
        "Write a Python function that reverses the words in a sentence.",
        "Show how to read a CSV file and print its first row.",
        "Write a function that checks whether a number is prime.",
        "Explain what a hash map is, with a short example.",
        "Write a shell command that counts the lines of every .txt file in a folder.",
        "Show a class that represents a bank account with deposit and withdraw.",
        "Write a function that merges two sorted lists.",
        "How do you handle a missing key when reading a dictionary?",
        "Write a loop that prints the numbers from 1 to 20 that are divisible by 3.",
        "Show how to sort a list of records by one field.",
        "Write a function that returns the most common letter in a string.",
        "Explain recursion with a small code example.",
        "Write a snippet that retries a network call three times.",
        "Show how to write unit tests for a function that adds two numbers.",
        "Write a function that converts Celsius to Fahrenheit.",
        "How would you remove duplicates from an array while keeping the order?",
    ],
    "math": [
        "What is 15 percent of 240?",
        "Solve 3x + 7 = 25 for x.",
        "Explain how to find the area of a triangle.",
        "What is the sum of the integers from 1 to 50?",
        "Simplify the fraction 84/126.",
        "A train travels 180 km in 2.5 hours. What is its average speed?",
        "Explain what a prime factorisation is, using 60.",
        "What is the probability of rolling two sixes with two dice?",
        "Find the next number in the sequence 2, 6, 18, 54.",
        "Convert 0.375 to a fraction.",
        "Explain the difference between mean and median.",
        "How many diagonals does a hexagon have?",
        "Solve the system x + y = 10 and x - y = 4.",
        "What is the derivative of x squared plus 3x?",
        "Estimate the square root of 50 to one decimal place.",
        "A rectangle has perimeter 30 and width 5. What is its length?",
    ],
}


@dataclass(frozen=True)
class Concept:
    name: str
    genre: str | None  # None: the generator decides


@dataclass(frozen=True)
class Job:
    """One generation: the user turn the generator answers and where its reply goes."""

    stage: str  # one of STAGES
    concept: int  # index into the concept list; -1 for the negative pool
    genre: str
    instruction: str  # the row's `input` (the concept for a genre job)
    prompt: str  # the user turn sent to the generator
    seed: int


def _lines(path: Path, what: str) -> list[tuple[int, str]]:
    """(line number, text) of the non-blank lines of a UTF-8 text file that are not `#` comments."""
    if not path.is_file():
        raise ValueError(f"--{what} {path}: no such file")
    try:
        text = read_utf8(path)
    except ValueError as err:  # names the file and the first bad byte
        raise ValueError(f"--{what} {err}") from None
    except OSError as err:
        raise ValueError(f"--{what} {path}: cannot be read ({err.strerror or type(err).__name__})") from None
    return [
        (n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")
    ]


def _split_genre(path: Path, what: str, number: int, line: str, genre_first: bool) -> tuple[str, str | None]:
    """(text, genre) of a line `text<TAB>genre` (concepts) or `genre<TAB>text` (prompts)."""
    if "\t" not in line:
        return line, None
    left, right = (part.strip() for part in line.split("\t", 1))
    genre, text = (left, right) if genre_first else (right, left)
    if genre.lower() not in GENRES or not text or "\t" in text:
        layout = "GENRE<TAB>INSTRUCTION" if genre_first else "CONCEPT<TAB>GENRE"
        raise ValueError(
            f"--{what} {path}, line {number}: {line!r} is not {layout} with GENRE one of {', '.join(GENRES)}"
        )
    return text, genre.lower()


def read_concepts(path: str | Path) -> list[Concept]:
    """The concept list: one concept a line, optionally `concept<TAB>genre` to fix its genre."""
    path = Path(path)
    concepts, seen = [], {}
    for number, line in _lines(path, "concepts"):
        name, genre = _split_genre(path, "concepts", number, line, genre_first=False)
        if name in seen:
            raise ValueError(f"--concepts {path}, line {number}: {name!r} repeats line {seen[name]}; list each once")
        seen[name] = number
        concepts.append(Concept(name, genre))
    if not concepts:
        raise ValueError(f"--concepts {path}: no concepts (one a line; blank lines and # comments are skipped)")
    return concepts


def read_prompts(path: str | Path | None) -> dict[str, list[str]]:
    """Instructions per genre: a file of one instruction a line, `genre<TAB>instruction` for one
    genre only (an untagged line serves every genre); None: our built-in instructions."""
    if path is None:
        return {genre: list(items) for genre, items in INSTRUCTIONS.items()}
    path = Path(path)
    by_genre: dict[str, list[str]] = {genre: [] for genre in GENRES}
    for number, line in _lines(path, "prompts"):
        text, genre = _split_genre(path, "prompts", number, line, genre_first=True)
        for g in GENRES if genre is None else (genre,):
            by_genre[g].append(text)
    if not any(by_genre.values()):
        raise ValueError(f"--prompts {path}: no instructions (one a line; blank lines and # comments are skipped)")
    return by_genre


def check_prompts(prompts: dict[str, list[str]], concepts: list[Concept], path) -> None:
    """Every genre a concept may get needs two instructions (one to train on, one held out)."""
    needed = GENRES if any(c.genre is None for c in concepts) else sorted({c.genre for c in concepts})
    for genre in needed:
        if len(prompts[genre]) < 2:
            raise ValueError(
                f"--prompts {path}: {len(prompts[genre])} instruction(s) for genre {genre!r}; each genre a concept "
                "may get needs at least 2 (untagged lines serve every genre)"
            )


def parse_genre(reply: str) -> str:
    """The genre a reply names: the first of the words text, code, math (or mathematics) and none
    in it; none, or no such word, is text (AxBench's fallback in `get_concept_genres`, which
    takes text, code, math in that order wherever they appear)."""
    match = re.search(r"\b(text|code|math|mathematics|maths|none)\b", reply.lower())
    word = match.group(1) if match else "none"
    return {"none": "text", "mathematics": "math", "maths": "math"}.get(word, word)


def job_seed(seed: int, *parts) -> int:
    """A 31-bit seed for one generation, from the run's seed and where the generation sits."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def split_instructions(prompts: dict[str, list[str]], seed: int) -> dict[str, tuple[list[str], list[str]]]:
    """Per genre, (train, held-out) instructions: the even and odd positions of a seeded shuffle."""
    split = {}
    for genre, items in prompts.items():
        order = list(items)
        random.Random(job_seed(seed, "instructions", genre)).shuffle(order)
        split[genre] = (order[0::2], order[1::2])
    return split


def _take(items: list[str], n: int, offset: int) -> list[str]:
    """n instructions from `items`, cycling, starting at `offset`."""
    return [items[(offset + k) % len(items)] for k in range(n)] if items else []


def genre_jobs(concepts: list[Concept], seed: int) -> list[Job]:
    """One genre question per concept whose genre the list does not fix."""
    return [
        Job("genre", i, "", c.name, GENRE_PROMPT.format(concept=c.name), job_seed(seed, "genre", i))
        for i, c in enumerate(concepts)
        if c.genre is None
    ]


def plan_rows(
    names: list[str],
    genres: list[str],
    prompts: dict[str, list[str]],
    per_concept: int,
    eval_per_concept: int,
    seed: int,
) -> list[Job]:
    """Every row's generation, in order: the negative pool (`per_concept` plain replies for each
    genre the concepts have), then per concept its training positives, eval positives and eval
    negatives (the negatives answer the same held-out instructions as the positives). Each concept
    starts at its own offset in the instructions, so concepts of one genre do not all answer the
    same ones first. AxBench: the pool in `DatasetFactory.__init__`, the positives in
    `create_train_df`, the eval rows in `create_eval_df` (without its hard negatives)."""
    split = split_instructions(prompts, seed)
    jobs = []
    for genre in [g for g in GENRES if g in genres]:
        for k, instruction in enumerate(_take(split[genre][0], per_concept, 0)):
            jobs.append(Job("pool", -1, genre, instruction, instruction, job_seed(seed, "pool", genre, k)))
    for i, (name, genre) in enumerate(zip(names, genres)):
        train, held_out = split[genre]
        stages = (
            ("positive", _take(train, per_concept, i), POSITIVE_PROMPT),
            ("eval_positive", _take(held_out, eval_per_concept, i), POSITIVE_PROMPT),
            ("eval_negative", _take(held_out, eval_per_concept, i), NEGATIVE_PROMPT),
        )
        for stage, instructions, template in stages:
            for k, instruction in enumerate(instructions):
                prompt = template.format(instruction=instruction, concept=name)
                jobs.append(Job(stage, i, genre, instruction, prompt, job_seed(seed, stage, name, k)))
    return jobs
