"""The detection window, `detect_on: content | response` (`SteeringModule.detection_mask`,
`AUROCCallback`, `metrics/detection.py`), by hand on a planted latent; and every AUROC table of
docs/results.md names the window it was pooled over.

AxBench's rule (stanfordnlp/axbench, and `modules/steering.py`'s docstring): a text's detection
score is max_i Ψ(h_i) over every token after the chat prefix, instruction and response
(`content`); ours also offers the response text alone (`response`). Neither pools the chat
prefix. The planted latent is 5 on the instruction tokens of the positives, 1 on the response
tokens of every row and 9 on the chat prefix of the negatives: over the content every positive
(5) outscores every negative (1), AUROC 1; over the response every row scores 1, a tie, AUROC
exactly 0.5; a window that pooled the prefix would rank the negatives first (AUROC 0)."""

import re

import pytest
import torch

from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.modules.steering import SteeringModule
from tests.helpers import ROOT
from tests.test_axbench_methods import CONCEPTS, collate, make_rows

PREFIX = 1  # the chat prefix: the first token of each row (collate's content_mask starts after it)


def _planted_states(batch, hidden_size: int) -> torch.Tensor:
    """(batch, seq, d): zero but coordinate 0, the planted latent h·e₀ described above."""
    content, response = batch["content_mask"].bool(), batch["response_mask"].bool()
    instruction = content & ~response
    positive = (batch["label"] == 1)[:, None]
    latent = torch.zeros(batch["input_ids"].shape)
    latent[instruction & positive] = 5.0
    latent[response] = 1.0
    latent[:, :PREFIX] = torch.where(positive, 0.0, 9.0).expand(-1, PREFIX)
    states = torch.zeros(*latent.shape, hidden_size)
    states[..., 0] = latent
    return states


def _auroc(module, batches) -> dict:
    """What the `AUROCCallback` computes over these batches from the module's `_evaluate` output."""
    callback = AUROCCallback()
    metric = callback.make_metric(None, module)
    for batch in batches:
        callback.update(metric, module._evaluate(batch), batch)
    return metric.compute()


@pytest.fixture
def module(tiny_lm_dir):
    module = SteeringModule(lm=tiny_lm_dir("llama"), layer=1, method="diffmean", concept_names=CONCEPTS)
    with torch.no_grad():
        module.dictionary.weight.zero_()
        module.dictionary.weight[:, 0] = 1.0  # every concept's row e₀: Ψ(h) = h·e₀, the planted latent
    module.states = lambda batch: _planted_states(batch, module.dictionary.weight.shape[1])
    return module


def test_the_planted_windows_by_hand(tokenizer, module):
    rows = make_rows(tokenizer, n_per_concept=6, n_negative=8, seed=1, train=False)
    batches = [collate(rows[i : i + 5], prefix=PREFIX) for i in range(0, len(rows), 5)]
    batch = batches[0]
    assert (batch["content_mask"].bool() & ~batch["response_mask"].bool()).any(dim=1).all()  # an instruction
    for window, auroc in (("content", 1.0), ("response", 0.5)):
        module.hparams.detect_on = window
        pooled = module._evaluate(batch)["pool_mask"]
        expected = batch["response_mask"].bool() if window == "response" else batch["content_mask"].bool()
        assert torch.equal(pooled, expected)  # the content starts after the chat prefix; no end-of-turn here
        result = _auroc(module, batches)
        assert result["auroc"].item() == auroc
        assert result["auroc_per_concept"].tolist() == [auroc] * len(CONCEPTS)


# --- docs/results.md: each AUROC table names its window ----------------------------------------------

WINDOW = re.compile(r"`detect_on: (content|response)`")


def _axbench_detection_section(text: str) -> list[str]:
    """The lines of results.md's AxBench section up to its steering part: its detection tables."""
    lines = text.splitlines()
    start = lines.index("## AxBench")
    end = next(i for i in range(start + 1, len(lines)) if re.match(r"#{2,3} ", lines[i]) and "Steering" in lines[i])
    return lines[start:end]


def _tables(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last + 1) line indices of each markdown table."""
    spans, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def stated_windows(lines: list[str], first: int, last: int, before: int, after: int) -> set[str]:
    """The windows a table names: its header's columns ("content", "response ..."), else the first
    `detect_on: X` in the text after it (its footnote), up to the next table or heading, else in the
    paragraph before it (from `before`, the end of the previous table or heading)."""
    header = [cell.strip().lower() for cell in lines[first].strip("|").split("|")]
    named = {w for w in ("content", "response") for cell in header if cell.startswith(w)}
    if named:
        return named
    for span in (lines[last:after], lines[before:first]):
        found = WINDOW.search("\n".join(span))
        if found:
            return {found.group(1)}
    return set()


def test_every_auroc_table_of_the_results_names_its_window():
    lines = _axbench_detection_section((ROOT / "docs/results.md").read_text())
    tables = _tables(lines)
    headings = [i for i, line in enumerate(lines) if line.startswith("#")]
    assert tables, "results.md's AxBench section holds no detection table"
    for k, (first, last) in enumerate(tables):
        before = max([i + 1 for i in headings if i < first] + [tables[k - 1][1] if k else 0])
        after = min([i for i in headings if i > last] + [tables[k + 1][0] if k + 1 < len(tables) else len(lines)])
        windows = stated_windows(lines, first, last, before, after)
        assert windows, (
            f"the AUROC table at line {first} of results.md's AxBench section names no window: {lines[first]}"
        )


def test_a_table_that_names_no_window_is_caught():
    lines = ["intro", "| method | AUROC |", "|---|---|", "| DiffMean | 0.99 |", "", "After it."]
    assert stated_windows(lines, 1, 4, 0, len(lines)) == set()
    lines[-1] = "Pooled over the response text (`detect_on: response`)."
    assert stated_windows(lines, 1, 4, 0, len(lines)) == {"response"}
    assert stated_windows(["| run | content | response only |"], 0, 1, 0, 1) == {"content", "response"}
