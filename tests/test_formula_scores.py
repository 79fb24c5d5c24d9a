"""The scores the studies report, against the official rules on planted inputs: CausalGym's task
accuracy (the share of eval pairs where the clean model ranks y_b strictly above y_s, plot.py's
`acc = base_p_src < base_p_base`), its IIA with an exact tie (eval.py's `p_src > p_base`: a tie
is not a flip), and the RAVEL sweep's Cause and Iso columns (each the module's own test metric)."""

import csv

import torch

from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.lm import load_lm
from lit_interventions.metrics.odds import InterchangeOdds
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.studies import ravel_sweep
from lit_interventions.studies.causalgym_scoring import task_accuracy
from lit_interventions.studies.causalgym_tasks import _region_data


def _data(lm, task="agr_sv_num_pp"):
    return _region_data(task, None, lm, None, None, {"train_pairs": 4, "eval_pairs": 8, "seed": 0})


# --- CausalGym's task accuracy --------------------------------------------------------------------


def test_task_accuracy_counts_a_strict_win_of_y_b_on_planted_logits(tiny_lm_dir, monkeypatch):
    # Planted clean label logits (columns y_b, y_s) for the 16 eval rows, in loader order: y_b
    # strictly above in 5 rows, an exact tie in 2 (not a win, as the official `<`), below in 9.
    # Acc = 5/16; inverting the comparison gives 9/16, counting ties 7/16.
    planted = torch.tensor(
        [[2.0, 1.0]] * 3 + [[0.5, 0.5]] + [[1.0, 3.0]] * 4 + [[4.0, -1.0]] * 2 + [[7.0, 7.0]] + [[-2.0, 0.0]] * 5
    )
    lm = tiny_lm_dir("llama")
    data = _data(lm)
    given = []

    def clean_logits(self, batch, vocab=None):
        rows = planted[len(given) : len(given) + len(batch)]
        given.extend(range(len(batch)))
        return rows.to(self.device)

    monkeypatch.setattr(InterchangeModule, "clean_logits", clean_logits)
    cache = ActivationCache(load_lm(lm), [1])
    assert task_accuracy(data, lm, cache, batch_size=5) == 5 / 16  # four batches: 5, 5, 5, 1 rows
    assert len(given) == len(planted) == 16


def test_task_accuracy_is_the_clean_model_ranking_by_hand(tiny_lm_dir):
    # The real model: each eval row's base sentence through the plain HF forward, the logits of
    # y_b and y_s at the base's last token; the share where y_b's is strictly larger (agr_gender,
    # where the tiny model's share is not 1/2: an inverted comparison gives another).
    lm = tiny_lm_dir("llama")
    data = _data(lm, "agr_gender")
    model = load_lm(lm)
    right = total = 0
    with torch.no_grad():
        for batch in data.loader("eval", 64):
            logits = model(input_ids=batch.base.input_ids, attention_mask=batch.base.attention_mask).logits
            last = logits[torch.arange(len(logits)), batch.base.last]
            y_b = last.gather(1, batch.base.label[:, None])[:, 0]
            y_s = last.gather(1, batch.source.label[:, None])[:, 0]
            right += (y_b > y_s).sum().item()
            total += len(last)
    assert total == 16 and 2 * right != total  # not 1/2: an inverted comparison gives another share
    assert task_accuracy(data, lm, ActivationCache(model, [1])) == right / total


# --- IIA's tie rule ------------------------------------------------------------------------------


def test_iia_counts_an_exact_tie_as_no_flip():
    # Label logits, columns (y_b, y_s). Intervened: row 0 an exact tie (p*(y_s) = p*(y_b): not a
    # flip, eval.py's strict `p_src > p_base`), row 1 flipped, row 2 not, row 3 a tie at large
    # logits. IIA = 1/4 (a tie counted: 3/4).
    clean = torch.tensor([[1.0, 0.0], [2.0, -1.0], [0.0, 0.0], [3.0, 1.0]])
    intervened = torch.tensor([[0.25, 0.25], [0.0, 2.0], [1.5, -0.5], [20.0, 20.0]])
    metric = InterchangeOdds()
    metric.update_labels(clean, intervened)
    result = metric.compute()
    assert result["iia"].item() == 0.25
    # odds, row by row: (1 - 0) + (0.25 - 0.25) = 1; (2 + 1) + (2 - 0) = 5; 0 + (-0.5 - 1.5) = -2;
    # (3 - 1) + 0 = 2; mean 6/4
    assert result["odds"].item() == 1.5


def test_iia_tie_on_full_vocabulary_logits():
    # The same rule through `update` (full logits, label ids): y_s and y_b at equal logits.
    intervened = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    base = torch.zeros(2, 4)
    metric = InterchangeOdds()
    metric.update(base, intervened, torch.tensor([1, 2]), torch.tensor([2, 0]))  # row 0 a tie, row 1 flipped
    assert metric.compute()["iia"].item() == 0.5


# --- the RAVEL sweep's columns -------------------------------------------------------------------

PLANTED = {  # (method, attribute): the module's test metrics, Cause ≠ Iso everywhere
    ("full_swap", "Country"): {"cause": 0.25, "iso": 0.75},
    ("full_swap", "Continent"): {"cause": 0.5, "iso": 1.0},
    ("das", "Country"): {"cause": 1.0, "iso": 0.0},
    ("das", "Continent"): {"cause": 0.125, "iso": 0.625},
}


def test_ravel_sweep_rows_carry_the_module_cause_and_iso(tmp_path, tiny_lm_dir, monkeypatch):
    def run_cell(method, attribute, options, epochs, data_options, seed):
        scores = PLANTED[(method, attribute)]
        metrics = {f"test/{k}": v for k, v in scores.items()}
        metrics["test/disentangle"] = (scores["cause"] + scores["iso"]) / 2
        return metrics | {"test/change/Country": 0.5, "test/change/Continent": 0.25}

    monkeypatch.setattr(ravel_sweep, "run_cell", run_cell)
    out = tmp_path / "out"
    lines = ravel_sweep.run_ravel_sweep(
        methods=["full_swap", "das"],
        attributes=["Country", "Continent"],
        lm=tiny_lm_dir("llama"),
        layer=1,
        out=str(out),
    )
    with (out / "summary.csv").open() as f:
        summary = {(r["method"], r["attribute"]): r for r in csv.DictReader(f)}
    assert set(summary) == set(PLANTED)
    for cell, scores in PLANTED.items():
        row = summary[cell]
        assert (float(row["cause"]), float(row["iso"])) == (scores["cause"], scores["iso"]), cell
        assert float(row["disentangle"]) == (scores["cause"] + scores["iso"]) / 2, cell
    # the per-method averages, by hand: full_swap Cause (0.25 + 0.5)/2, Iso (0.75 + 1)/2; das
    # Cause (1 + 0.125)/2, Iso (0 + 0.625)/2
    with (out / "table.csv").open() as f:
        table = {r["method"]: r for r in csv.DictReader(f)}
    assert {m: (float(r["cause"]), float(r["iso"])) for m, r in table.items()} == {
        "full_swap": (0.375, 0.875),
        "das": (0.5625, 0.3125),
    }
    averages = {line["method"]: (line["cause"], line["iso"]) for line in lines if line["attribute"] == "average"}
    assert averages == {"full_swap": (0.375, 0.875), "das": (0.5625, 0.3125)}
