"""The log odds-ratio and IIA against values computed by hand."""

import math

import pytest
import torch

from lit_interventions.metrics.odds import InterchangeOdds, log_odds_ratio

# Three examples over a 3-token vocabulary.
BASE = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
INTERVENED = torch.tensor([[0.0, 1.0, 5.0], [3.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
Y_BASE = torch.tensor([0, 2, 1])
Y_SOURCE = torch.tensor([1, 0, 2])
# By hand: log p(y_b|b)/p(y_s|b) is the logit gap (the softmax normaliser cancels):
#   ex 0: (2 - 0) + (1 - 0) = 3;  ex 1: (0 - 0) + (3 - 1) = 2;  ex 2: (4 - 0) + (1 - 2) = 3
#   IIA: p* ranks y_s over y_b in ex 0 (1 > 0) and ex 1 (3 > 1), not in ex 2 (1 < 2).
EXPECTED = [3.0, 2.0, 3.0]


def test_log_odds_ratio_by_hand():
    assert log_odds_ratio(BASE, INTERVENED, Y_BASE, Y_SOURCE).tolist() == pytest.approx(EXPECTED)


def test_log_odds_ratio_from_probabilities():
    p, q = BASE.softmax(-1), INTERVENED.softmax(-1)
    for i in range(3):
        b, s = Y_BASE[i], Y_SOURCE[i]
        by_definition = math.log((p[i, b] / p[i, s]) * (q[i, s] / q[i, b]))
        assert log_odds_ratio(
            BASE[i : i + 1], INTERVENED[i : i + 1], Y_BASE[i : i + 1], Y_SOURCE[i : i + 1]
        ).item() == (pytest.approx(by_definition, abs=1e-5))


def test_no_effect_gives_zero():
    assert log_odds_ratio(BASE, BASE, Y_BASE, Y_SOURCE).abs().max().item() == 0.0


def test_metric_accumulates_over_batches():
    metric = InterchangeOdds()
    metric.update(BASE[:2], INTERVENED[:2], Y_BASE[:2], Y_SOURCE[:2])
    metric.update(BASE[2:], INTERVENED[2:], Y_BASE[2:], Y_SOURCE[2:])
    result = metric.compute()
    assert result["odds"].item() == pytest.approx(8 / 3)
    assert result["iia"].item() == pytest.approx(2 / 3)
    metric.reset()
    metric.update(BASE[2:], INTERVENED[2:], Y_BASE[2:], Y_SOURCE[2:])
    assert metric.compute()["iia"].item() == 0.0
