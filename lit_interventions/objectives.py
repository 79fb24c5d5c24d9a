"""Training objectives of interchange interventions, as components: the module computes the
intervened logits at the base's last token, the objective turns them into a loss.

- `CounterfactualLoss` (CausalGym §3.3): −log p_{f←f*}(y_s | b, s), the source's label.
- `CauseIsoLoss` (RAVEL §4): L_Cause on the Cause examples; with `multitask` (MDAS / MDBM) plus
  the mean over the queried attributes of L_Iso on the Iso examples (the answer must not change).

Both add `sparsity`·penalty() of a `Penalised` intervention (DBM: λ‖σ(m/T)‖₁).
`build_objective(method)` builds the objective a method spec names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_interventions.core.batch import CAUSE, ISO, LABEL_KEYS, PairBatch  # ISO, CAUSE: the `kind` of an example
from lit_interventions.interventions.base import import_class
from lit_interventions.interventions.capabilities import Penalised
from lit_interventions.interventions.registry import MethodSpec

ROWS_AT_ONCE = 4  # rows of each float32 chunk: 1 and 4 rows measured alike on 262k logits, 16 and 64 slower


class _RowCrossEntropy(torch.autograd.Function):
    """−log softmax(z)_y per row, in float32, a few rows at a time (see `cross_entropy_rows`).

    Each chunk is converted into one float32 buffer and (log-)softmaxed into another, both reused
    for every chunk: the same kernels as `torch.log_softmax(chunk, dtype=torch.float32)` (so the
    same bits), without allocating two fresh 4 MB tensors per chunk, which on a CPU costs a page
    fault per 4 KiB page each time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        losses = []
        for y, z, found in _in_float32(logits, labels):
            torch.ops.aten._log_softmax.out(z, -1, False, out=found)
            losses.append(-found.gather(1, y[:, None])[:, 0])
        return torch.cat(losses)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels = ctx.saved_tensors
        out = torch.empty_like(logits)
        for (y, z, p), g, o in zip(_in_float32(logits, labels), grad.split(ROWS_AT_ONCE), out.split(ROWS_AT_ONCE)):
            torch.ops.aten._softmax.out(z, -1, False, out=p)  # ∂/∂z = (softmax(z) − onehot(y)) · grad, per row
            p[torch.arange(len(p)), y] -= 1
            o.copy_(p.mul_(g[:, None]))
        return out, None


def _in_float32(logits: torch.Tensor, labels: torch.Tensor):
    """(its labels, the chunk in float32, a float32 buffer of its shape) for each chunk of
    `ROWS_AT_ONCE` rows of `logits`; the two buffers are the same for every chunk."""
    shape = (min(ROWS_AT_ONCE, len(logits)), logits.shape[1])
    converted = torch.empty(shape, dtype=torch.float32, device=logits.device)
    spare = torch.empty(shape, dtype=torch.float32, device=logits.device)
    for chunk, y in zip(logits.split(ROWS_AT_ONCE), labels.split(ROWS_AT_ONCE)):
        z = converted[: len(chunk)]
        z.copy_(chunk)
        yield y, z, spare[: len(chunk)]


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels, reduction="none")`, (batch,) float32, without a
    float32 copy of all of a bfloat16 model's logits: the log-softmax runs in float32 a few rows
    at a time (in cache), once forward and once backward, and the gradient comes back in the
    logits' dtype, as the conversion's backward would round it. On 360 × 262k logits (the sweep's
    DAS step) 0.15 s instead of 0.77 s on a 2-core CPU. On a GPU, where many small chunks would
    cost a kernel launch each, it is that `F.cross_entropy`."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits (batch, vocab) and labels (batch,); got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if logits.device.type != "cpu":
        return F.cross_entropy(logits.float(), labels, reduction="none")
    return _RowCrossEntropy.apply(logits, labels)


class Objective:
    """A loss on the intervened logits (batch, vocab) of a batch, in two steps: `row_losses`, one
    loss per row, (batch,) float32, and `reduce`, those rows to the batch's loss (the mean by
    default). `task_loss` is the two in turn. The one-site module calls `task_loss`; the grid
    module (`MultiSiteInterchangeModule`) calls `row_losses` once on every site's rows stacked,
    then `reduce` on each site's own rows, so each site's loss is the one it would get alone.
    `uses_iso` says whether the objective needs Iso examples in the training batches (the data
    module is asked for them)."""

    uses_iso = False

    def __init__(self, sparsity: float = 0.0):
        if not 0.0 <= sparsity < float("inf"):
            raise ValueError(f"sparsity={sparsity!r} must be a finite number >= 0")
        self.sparsity = sparsity

    def row_losses(self, logits: torch.Tensor, batch: PairBatch) -> torch.Tensor:
        """One loss per row of `batch`, (batch,)."""
        raise NotImplementedError(f"{type(self).__name__} defines no row_losses(logits, batch)")

    def reduce(self, losses: torch.Tensor, batch: PairBatch) -> torch.Tensor:
        """The batch's loss from its rows' `losses`: their mean."""
        return losses.mean()

    def task_loss(self, logits: torch.Tensor, batch: PairBatch) -> torch.Tensor:
        return self.reduce(self.row_losses(logits, batch), batch)

    def __call__(self, logits: torch.Tensor, batch: PairBatch, intervention: nn.Module | None = None) -> torch.Tensor:
        loss = self.task_loss(logits, batch)  # in float32 (`cross_entropy_rows`)
        if self.sparsity:
            if not isinstance(intervention, Penalised):
                raise ValueError(
                    f"sparsity={self.sparsity} needs an intervention with a penalty() (a mask); "
                    f"got {type(intervention).__name__}"
                )
            loss = loss + self.sparsity * intervention.penalty()
        return loss

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def build_objective(method: MethodSpec) -> Objective | None:
    """The training objective `method.objective` names ({class_path, init_args}; None: the
    loop's default)."""
    if method.objective is None:
        return None
    built = import_class(method.objective["class_path"])(**method.objective.get("init_args", {}))
    if not isinstance(built, Objective):
        raise ValueError(f"method {method.name!r}: objective {method.objective['class_path']!r} is not an Objective")
    return built


class CounterfactualLoss(Objective):
    """−log p_{f←f*}(y | b, s), y the labels `label_key` names (`PairBatch.labels`): "source_label"
    (CausalGym: the source's label), "base_label" or "label" (the target)."""

    def __init__(self, label_key: str = "source_label", sparsity: float = 0.0):
        super().__init__(sparsity)
        if label_key not in LABEL_KEYS:
            raise ValueError(f"label_key={label_key!r}; choose one of {LABEL_KEYS}")
        self.label_key = label_key

    def row_losses(self, logits, batch):
        return cross_entropy_rows(logits, batch.labels(self.label_key))


class CauseIsoLoss(Objective):
    """L_Cause (+ with `multitask`, the mean over the attributes present of each one's L_Iso):
    RAVEL's DAS/DBM and, multi-task, MDAS/MDBM."""

    def __init__(self, multitask: bool = False, sparsity: float = 0.0):
        super().__init__(sparsity)
        self.multitask = multitask
        self.uses_iso = multitask

    def row_losses(self, logits, batch):
        return cross_entropy_rows(logits, batch.target)

    def reduce(self, losses, batch):
        return multitask_reduce(losses, batch.attribute, batch.kind, self.multitask)


def multitask_loss(
    logits: torch.Tensor, label: torch.Tensor, attribute: torch.Tensor, kind: torch.Tensor, multitask: bool
) -> torch.Tensor:
    """L_Cause (+ with `multitask`, the mean over the attributes present of each one's L_Iso)."""
    return multitask_reduce(cross_entropy_rows(logits, label), attribute, kind, multitask)


def multitask_reduce(
    losses: torch.Tensor, attribute: torch.Tensor, kind: torch.Tensor, multitask: bool
) -> torch.Tensor:
    """L_Cause = the mean of the Cause rows' `losses` (−log p*(target), (batch,) float32); with
    `multitask`, + the mean over the attributes present of each one's L_Iso (the mean of its Iso
    rows' losses)."""
    parts = []
    cause = kind == CAUSE
    if cause.any():
        parts.append(losses[cause].mean())
    if multitask:
        iso = kind == ISO
        per_attribute = [losses[iso & (attribute == a)].mean() for a in attribute[iso].unique()]
        if per_attribute:
            parts.append(torch.stack(per_attribute).mean())
    if not parts:  # a batch of Iso examples only, without multitask: nothing to learn from
        return losses.sum() * 0.0
    return torch.stack(parts).sum()
