"""`cross_entropy_rows`: the float32 cross-entropy of (bfloat16) logits, a few rows at a time."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lit_interventions.core.batch import PairBatch, Side
from lit_interventions.objectives import ROWS_AT_ONCE, CounterfactualLoss, cross_entropy_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, ROWS_AT_ONCE, 2 * ROWS_AT_ONCE + 3])
def test_equals_the_float_cross_entropy_and_its_gradient(dtype, rows):
    # the reference: the conversion to float32, then F.cross_entropy; its backward rounds the
    # gradient to the logits' dtype, as ours returns it
    torch.manual_seed(0)
    logits = (torch.randn(rows, 5000) * 4).to(dtype)
    labels = torch.randint(0, 5000, (rows,))
    weights = torch.rand(rows)  # a different upstream gradient per row
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = cross_entropy_rows(ours_in, labels)
    ref = F.cross_entropy(ref_in.float(), labels, reduction="none")
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert ours.dtype == torch.float32 and ours_in.grad.dtype == dtype
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        ours_in.grad.float(), ref_in.grad.float(), rtol=0, atol=2e-6 if dtype == torch.float32 else 4e-3
    )
    # by hand, in float64: −log softmax(z)_y
    exact = torch.logsumexp(logits.double(), -1) - logits.double()[torch.arange(rows), labels]
    torch.testing.assert_close(ours.double(), exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunk_gets_the_bits_of_its_own_rows_float32_softmax(dtype):
    # the chunks share two float32 buffers: each row's loss and gradient must still be exactly
    # those of its own float32 (log-)softmax, whatever chunk came before it (the last one shorter)
    torch.manual_seed(1)
    rows = 2 * ROWS_AT_ONCE + 3
    logits = (torch.randn(rows, 5000) * 4).to(dtype)
    logits[ROWS_AT_ONCE] += 50.0  # a chunk whose values differ wildly from the one before
    labels = torch.randint(0, 5000, (rows,))
    weights = torch.rand(rows)
    ours_in = logits.clone().requires_grad_()
    ours = cross_entropy_rows(ours_in, labels)
    (ours * weights).sum().backward()
    as_float, index = logits.float(), torch.arange(rows)
    assert torch.equal(ours, -torch.log_softmax(as_float, -1)[index, labels])
    expected = torch.softmax(as_float, -1)
    expected[index, labels] -= 1
    assert torch.equal(ours_in.grad, (expected * weights[:, None]).to(dtype))


def test_counterfactual_loss_is_the_mean_over_rows():
    logits, labels = torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([0, 1])
    # rows: log 2; log(1 + e²) − 0
    expected = (torch.log(torch.tensor(2.0)) + torch.log1p(torch.exp(torch.tensor(2.0)))) / 2
    side, zeros = Side.of(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)), labels * 0
    batch = PairBatch(side, replace(side, label=labels), zeros, zeros, zeros)  # y_s: the source's labels
    assert CounterfactualLoss()(logits, batch).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="label_key='target'; choose one of"):
        CounterfactualLoss(label_key="target")


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"logits \(batch, vocab\) and labels \(batch,\)"):
        cross_entropy_rows(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))
