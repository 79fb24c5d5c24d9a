"""SyntaxGym scoring: region surprisals of each item, its predictions checked, suite accuracy,
the SG score and the CSV.

    item correct    = 1 if every prediction holds for the item
    suite accuracy  = mean over the suite's items
    SG score        = mean over suites of the suite accuracy, without the suites the official
                      analysis leaves out (`fgd-embed3`, `fgd-embed4`, `nn-nv-rpl`, `gardenpath*`:
                      31 of the 34 published suites); `SG score (all suites)` counts every suite
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_interventions.core.surprisal import aggregate, encode_regions, region_surprisals
from lit_interventions.core.tokens import pad_batch
from lit_interventions.studies.syntaxgym.formulas import RegionValues, region_refs
from lit_interventions.studies.syntaxgym.suites import Suite

SG_SCORE_ROW = "SG score"
ALL_SUITES_ROW = "SG score (all suites)"
# the suites the analysis of Hu et al. 2020 (syntactic-generalization's notebooks/main.py) leaves out
EXCLUDED_SUITES = re.compile(r"^fgd-embed[34]|^gardenpath|^nn-nv")


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


def evaluate_suite(
    suite: Suite, model, tokenizer, batch_size: int = 16, all_regions: bool = False, attach_punctuation: bool = False
) -> SuiteResult:
    """Score every condition of every item, then check each item's predictions.

    Only the regions the predictions read are scored (their (condition, region) keys fill
    `item_values`), unless `all_regions` asks for every region. Regions are joined with spaces as
    syntaxgym-core joins them, unless attach_punctuation (`surprisal.join_regions`).
    """
    keys, sentences, wanted = [], [], []
    for item_index, item in enumerate(suite.items):
        for condition in item["conditions"]:
            name, numbers = condition["condition_name"], [region["region_number"] for region in condition["regions"]]
            keys.append((item_index, name, numbers))
            sentences.append([region["content"] for region in condition["regions"]])
            wanted.append(set(range(len(numbers))) if all_regions else _wanted_regions(suite, name, numbers))
    surprisals = region_surprisals(
        model,
        tokenizer,
        sentences,
        metric=suite.metric,
        batch_size=batch_size,
        wanted_regions=wanted,
        attach_punctuation=attach_punctuation,
    )
    item_values: list[RegionValues] = [{} for _ in suite.items]
    for (item_index, condition, numbers), values, indices in zip(keys, surprisals, wanted):
        for index in indices:
            item_values[item_index][condition, numbers[index]] = values[index]
    return judged(suite, item_values)


def evaluate_suite_forward(
    suite: Suite, model, tokenizer, batch_size: int = 16, attach_punctuation: bool = False
) -> SuiteResult:
    """`evaluate_suite` with each batch run through the LM's own forward, `model(input_ids,
    attention_mask)` (right padding, every position's logits), rather than its body and the head
    on the wanted tokens alone: a hook that follows the LM's forward (the position tracker of
    `inference.apply`) sees every sentence, so an LM under `apply` is scored with its edit. The
    same surprisals, s(x_t) = -log_softmax(logits_{t-1})[x_t] / ln 2 in bits, aggregated per
    region by `meta.metric`; only the regions the predictions read fill `item_values`."""
    entries = []  # (item index, condition, region numbers, encoded sentence, wanted region indices)
    for item_index, item in enumerate(suite.items):
        for condition in item["conditions"]:
            name, numbers = condition["condition_name"], [region["region_number"] for region in condition["regions"]]
            encoded = encode_regions(
                tokenizer, [region["content"] for region in condition["regions"]], attach_punctuation
            )
            entries.append((item_index, name, numbers, encoded, _wanted_regions(suite, name, numbers)))
    entries.sort(key=lambda entry: len(entry[3].token_ids))  # little padding in a batch
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    item_values: list[RegionValues] = [{} for _ in suite.items]
    for first in range(0, len(entries), batch_size):
        batch = entries[first : first + batch_size]
        bits = forward_surprisals(model, [entry[3].token_ids for entry in batch], pad_id)
        for (item_index, name, numbers, encoded, wanted), values in zip(batch, bits):
            per_region = aggregate(values, encoded.token_regions, len(numbers), suite.metric)
            for index in wanted:
                item_values[item_index][name, numbers[index]] = per_region[index]
    return judged(suite, item_values)


@torch.no_grad()
def forward_surprisals(model, token_ids: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """s(x_t) = -log2 p(x_t | x_<t) of every token t >= 1 of each sentence (t = 0: nan), from one
    call of the LM's forward on the right-padded batch; on the CPU."""
    input_ids, attention_mask, _ = pad_batch(token_ids, pad_id)
    device = model.get_input_embeddings().weight.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    bits = torch.cat([torch.full_like(log_probs[:, :1], math.nan), -log_probs / math.log(2)], dim=1).cpu()
    return [bits[row, : len(ids)] for row, ids in enumerate(token_ids)]


def judged(suite: Suite, item_values: list[RegionValues]) -> SuiteResult:
    """The suite's result from its items' region surprisals: an item is correct when every
    prediction holds for it."""
    correct = [all(prediction.holds(values) for prediction in suite.predictions) for values in item_values]
    return SuiteResult(suite.name, correct, item_values)


def sg_score(results: list[SuiteResult], all_suites: bool = False) -> float:
    """Mean over suites of the suite accuracy: over the suites the official analysis counts (not
    `EXCLUDED_SUITES`), or over every suite with all_suites=True. NaN when no suite counts."""
    counted = counted_suites(results, all_suites)
    return sum(result.accuracy for result in counted) / len(counted) if counted else math.nan


def counted_suites(results: list[SuiteResult], all_suites: bool = False) -> list[SuiteResult]:
    """The suites an SG score averages (see `sg_score`)."""
    return [result for result in results if all_suites or not EXCLUDED_SUITES.search(result.name)]


def score_rows(results: list[SuiteResult]) -> list[tuple[str, int, int, float]]:
    """The two summary rows, (name, suites, items, score): `SG score (all suites)`, then the
    official analysis's `SG score`, each over the suites it counts."""
    rows = []
    for name, all_suites in ((ALL_SUITES_ROW, True), (SG_SCORE_ROW, False)):
        counted = counted_suites(results, all_suites)
        rows.append((name, len(counted), sum(result.items for result in counted), sg_score(results, all_suites)))
    return rows


def write_csv(results: list[SuiteResult], out: Path) -> None:
    """suite,items,accuracy per suite, then the `SG score (all suites)` row and, last, the `SG score`
    row of the official analysis (each with the items of the suites it counts)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["suite", "items", "accuracy"])
        for result in results:
            writer.writerow([result.name, result.items, f"{result.accuracy:.6f}"])
        for name, _, items, score in score_rows(results):
            writer.writerow([name, items, f"{score:.6f}"])
