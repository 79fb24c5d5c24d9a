"""SyntaxGym speed: our suite scoring against lm-zoo's Hugging Face loop, same run, LM and suites.

- ours: `lit-interventions syntaxgym` (`studies.syntaxgym.evaluate_suite`, `core.surprisal`): a
  suite's sentences sorted by length and scored in right-padded batches of `--batch_size`, one
  forward of the decoder body per batch, and the LM head (262k rows on Gemma 3) only on the
  positions before the tokens of the regions a prediction reads;
- reference: the structure of lm-zoo's `HuggingFaceBackend.get_surprisals`
  (`lm_zoo/backends/python.py`), the backend SyntaxGym calls for a `huggingface://` model: one
  sentence at a time, tokenised alone, a (1, T) forward of the whole causal LM (logits at every
  position), a log-softmax over the vocabulary at every position, then per token
  s_t = -log p(x_t | x_<t) / ln 2 read one `.item()` at a time (s_0 = 0, the first token has no
  context). syntaxgym-core then sums each region's token surprisals.

Both sides use the project's sentence joining, BOS handling and token-to-region alignment
(`surprisal.encode_regions`) and its region aggregation (`surprisal.aggregate`), so only the loop
differs. Every region surprisal ours computes is compared with the reference's, relative to its
size: |ours - reference| <= `--tolerance` x max(1, |reference|) (1e-4 in float32: a batch of
padded rows and a single row sum their float32 products in other orders, which moves a region of
10 bits by up to about 1.5e-4 bits on gemma-3-270m). The script prints the largest difference,
then the timings; a region past the tolerance is named on one line after them (exit status 1).
In bfloat16 the rounding is coarser, so `--tolerance` must be given explicitly there.

Each side runs in a fresh process (`measure.alternate`); loading the LM and reading the suites
are not timed. Prints the seconds per side, the peak RSS (and CUDA memory), then `ratio=X` last.

    python benchmarks/syntaxgym_speed.py --suites_dir /work/shared/data/syntaxgym --device cpu
    python benchmarks/syntaxgym_speed.py --suites number_src mvrr --repeat 3
    python benchmarks/syntaxgym_speed.py --device cuda --dtype bfloat16 --tolerance 0.5
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from measure import alternate, report

from lit_interventions.core.lm import DEFAULT_LM, DTYPES, check_device, load_lm, load_tokenizer
from lit_interventions.core.surprisal import aggregate, encode_regions
from lit_interventions.studies.syntaxgym.score import evaluate_suite, judged, sg_score
from lit_interventions.studies.syntaxgym.suites import Suite, load_suite, suite_paths

FLOAT32_TOLERANCE = 1e-4
# the default sample: one suite of each of the 10 families of phenomena (10,068 of the 34 suites'
# 45,816 gemma-3 tokens); `--suites all` runs every suite
SAMPLE = (
    "center_embed",
    "cleft",
    "fgd_object",
    "mvrr",
    "nn-nv-rpl",
    "npi_orc_any",
    "npz_ambig",
    "number_orc",
    "reflexive_orc_fem",
    "subordination",
)
# per suite: its name, then per item {(condition, region number): S in bits}
Scores = list[tuple[str, list[dict]]]


@torch.no_grad()
def sentence_surprisals(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """lm-zoo's HF backend on one sentence: s_0 = 0 and, for t >= 1,
        s(x_t) = -log2 p(x_t | x_<t) = -log_softmax(logits_{t-1})[x_t] / ln 2
    from one (1, T) forward with logits and a log-softmax at every position."""
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=device)[None]  # (1, T)
    log_probs = model(input_ids=ids).logits.float().log_softmax(dim=-1)[0]  # (T, vocab)
    return [0.0] + [-log_probs[t - 1, token_ids[t]].item() / math.log(2) for t in range(1, len(token_ids))]


def reference_suite(suite: Suite, model: torch.nn.Module, tokenizer) -> list[dict]:
    """Every region of every condition of every item, one sentence per forward."""
    item_values = []
    for item in suite.items:
        values = {}
        for condition in item["conditions"]:
            contents = [region["content"] for region in condition["regions"]]
            encoded = encode_regions(tokenizer, contents)
            bits = torch.tensor(sentence_surprisals(model, encoded.token_ids), dtype=torch.float64)
            per_region = aggregate(bits, encoded.token_regions, len(contents), suite.metric)
            for region, value in zip(condition["regions"], per_region):
                values[condition["condition_name"], region["region_number"]] = value
        item_values.append(values)
    return item_values


def _setup(paths: list[str], lm: str, dtype: str, device: str, threads: int | None):
    """The suites, the LM on `device` and its tokenizer, and the seconds this took (not timed)."""
    start = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    suites = [load_suite(path) for path in paths]
    model, tokenizer = load_lm(lm, dtype).to(device), load_tokenizer(lm)
    return suites, model, tokenizer, time.perf_counter() - start


def run_ours(paths, lm, dtype, device, batch_size, threads) -> tuple[float, Scores]:
    """`lit-interventions syntaxgym`'s scoring of every suite: (setup seconds, scores)."""
    suites, model, tokenizer, setup = _setup(paths, lm, dtype, device, threads)
    results = [evaluate_suite(suite, model, tokenizer, batch_size=batch_size) for suite in suites]
    return setup, [(result.name, result.item_values) for result in results]


def run_reference(paths, lm, dtype, device, batch_size, threads) -> tuple[float, Scores]:
    """lm-zoo's loop over every suite: (setup seconds, scores). `batch_size` is unused (one
    sentence per forward)."""
    suites, model, tokenizer, setup = _setup(paths, lm, dtype, device, threads)
    return setup, [(suite.name, reference_suite(suite, model, tokenizer)) for suite in suites]


def largest_difference(ours: Scores, reference: Scores) -> float:
    """The largest |ours - reference| over every region ours scored, in bits (nan pairs skipped)."""
    return max(
        (
            abs(value - expected[key])
            for (_, our_items), (_, reference_items) in zip(ours, reference, strict=True)
            for values, expected in zip(our_items, reference_items, strict=True)
            for key, value in values.items()
            if not (math.isnan(value) and math.isnan(expected[key]))
        ),
        default=0.0,
    )


def first_difference(ours: Scores, reference: Scores, tolerance: float) -> str | None:
    """None when every region surprisal of ours is within `tolerance` x max(1, |reference|) bits of
    the reference's
    (nan equals nan: the mean of a region without tokens); else a line naming the first that is not."""
    for (name, our_items), (_, reference_items) in zip(ours, reference, strict=True):
        for index, (values, expected) in enumerate(zip(our_items, reference_items, strict=True), 1):
            for (condition, region), value in values.items():
                other = expected[condition, region]
                if math.isnan(value) and math.isnan(other):
                    continue
                if not abs(value - other) <= tolerance * max(1.0, abs(other)):
                    return (
                        f"suite {name!r}, item {index}, condition {condition!r}, region {region}: "
                        f"ours {value!r} bits, reference {other!r} bits (tolerance {tolerance})"
                    )
    return None


def accuracy_of(scores: Scores, suites: list[Suite]) -> float:
    """The SG score (official analysis's suites) of `scores`, the suites' predictions checked."""
    return sg_score([judged(suite, items) for suite, (_, items) in zip(suites, scores, strict=True)])


class _Parser(argparse.ArgumentParser):
    """argparse with a bad argument reported on one line (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = _Parser(
        prog="syntaxgym_speed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suites_dir", default="data/syntaxgym", help="the published suites' directory")
    parser.add_argument(
        "--suites",
        nargs="+",
        default=list(SAMPLE),
        help="suite names in --suites_dir, or all (default: one per family)",
    )
    parser.add_argument("--lm", default=DEFAULT_LM, help="what lit_interventions.core.lm.load_lm accepts")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch_size", type=int, default=16, help="ours: sentences per forward")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (both sides)")
    parser.add_argument("--repeat", type=int, default=1, help="alternate ours and the reference n times")
    parser.add_argument(
        "--tolerance", type=float, default=None, help="relative to max(1, |S|) (default 1e-4; required off float32)"
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "repeat", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be a positive integer")
    try:
        check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    if args.tolerance is None:
        if args.dtype != "float32":
            parser.error(f"--dtype {args.dtype} rounds differently per batch: give --tolerance")
        args.tolerance = FLOAT32_TOLERANCE
    if not 0 <= args.tolerance < math.inf:
        parser.error(f"--tolerance={args.tolerance} must be a non-negative number")
    directory = Path(args.suites_dir)
    if not directory.is_dir() or not any(directory.glob("*.json")):
        parser.error(
            f"--suites_dir {directory} holds no SyntaxGym suites; fetch them with "
            f"`lit-interventions data syntaxgym --out {directory}`"
        )
    paths = [str(path) for path in suite_paths([str(directory)])]
    if args.suites != ["all"]:
        known = {Path(path).stem: path for path in paths}
        unknown = [name for name in args.suites if name not in known]
        if unknown:
            parser.error(f"--suites {' '.join(unknown)}: not in {directory}; there: {' '.join(sorted(known))}")
        paths = [known[name] for name in args.suites]
    return args, paths


def main(argv: list[str] | None = None) -> None:
    args, paths = _arguments(argv)
    suites = [load_suite(path) for path in paths]  # a malformed suite stops here, before any LM loads
    settings = (paths, args.lm, args.dtype, args.device, args.batch_size, args.threads)
    ours, reference = alternate(run_ours, run_reference, args.repeat, *settings)
    difference = first_difference(ours.result, reference.result, args.tolerance)
    print(
        f"{args.lm} ({args.dtype}, {args.device}), {len(paths)} suites, "
        f"{sum(len(items) for _, items in ours.result)} items: largest region difference "
        f"{largest_difference(ours.result, reference.result):.2e} bits; SG score ours "
        f"{accuracy_of(ours.result, suites):.3f}, reference {accuracy_of(reference.result, suites):.3f}"
    )
    report("syntaxgym", ours, reference)
    if difference is not None:
        sys.exit(f"syntaxgym_speed.py: region surprisals differ: {difference}")


if __name__ == "__main__":
    main()
