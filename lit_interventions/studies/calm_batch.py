"""One batch of a CALM task's test prompts (`TaskBatch`): the LM's next-token logits with h + δ
written at the site, and the counts that one intervention do(Z = z′) adds to its (method,
property) tally: top-k overlap, top-1 change, the targeted probe's success and accuracy, and the
collateral damage to the other properties' probes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from lit_interventions.core.sites import logits_at
from lit_interventions.interventions.attacks import add
from lit_interventions.metrics.competence import competence_scores
from lit_interventions.studies.calm_data import Prompt, _labels, _pad


@dataclass
class TaskBatch:
    """Test prompts of one task, padded, with their site states and the probes' view of them."""

    prompts: list[Prompt]
    ids: torch.Tensor  # (batch, seq)
    mask: torch.Tensor  # (batch, seq)
    start: torch.Tensor  # (batch, seq, d): the residual stream at the layer, read once
    sites: torch.Tensor  # (batch,)
    last: torch.Tensor  # (batch,)
    h: torch.Tensor  # (batch, d): f(x) at the site, on the CPU
    truth: dict[str, torch.Tensor]  # property -> class ids (batch,), −1 where the value is not kept
    before: dict[str, torch.Tensor]  # property -> the probe's prediction on h (batch,)

    @torch.no_grad()
    def logits(self, model, layer: int, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (batch, vocab) of the LM, with h + δ written at the site if δ is given."""
        edit = None if delta is None else add(delta.to(self.ids.device))
        return (
            logits_at(
                model,
                self.ids,
                self.mask,
                self.last,
                layer=layer,
                site_positions=self.sites,
                intervention=edit,
                start_states=self.start,
            )
            .float()
            .cpu()
        )


@torch.no_grad()
def make_batch(prompts, states, h, data, classes, probes, pad_id, device) -> TaskBatch:
    """The batch of these test prompts: padded ids and states (right-padded to the widest) on `device`,
    the site and prediction positions, h, each property's class ids and its probe's prediction on h."""
    ids, mask = _pad(prompts, pad_id)
    width = ids.shape[1]
    start = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, width - len(s))) for s in states])
    return TaskBatch(
        prompts,
        ids.to(device),
        mask.to(device),
        start.to(device),
        torch.tensor([p.site for p in prompts], device=device),
        torch.tensor([p.last for p in prompts], device=device),
        h,
        {p: _labels(data, prompts, p, c) for p, c in classes.items()},
        {p: probe.predict(h) for p, probe in probes.items()},
    )


@torch.no_grad()
def record(
    t: Counter,
    batch: TaskBatch,
    probes,
    prop: str,
    target,
    delta,
    clean,
    edited,
    k_max: int,
    candidates: torch.Tensor | None = None,
) -> None:
    """Add one batch of do(prop = target) to the counts of a (method, property); the top-k overlap
    and the top-1 change are taken within `candidates` (the task's answer vocabulary) if given."""
    t["n"] += len(target)
    t["overlap"] += (
        competence_scores(clean, edited, torch.zeros(len(target), dtype=torch.bool), k_max, candidates).sum().item()
    )
    if candidates is not None:
        clean, edited = clean[:, candidates], edited[:, candidates]
    t["top1_changed"] += (edited.argmax(-1) != clean.argmax(-1)).sum().item()
    moved = batch.h + delta
    for other, probe in probes.items():
        truth, after = batch.truth[other], probe.predict(moved)
        known = truth >= 0
        if other == prop:
            t["target_success"] += (after == target).sum().item()
            t["known"] += known.sum().item()
            t["acc_before"] += (batch.before[other] == truth)[known].sum().item()
            t["acc_after"] += (after == truth)[known].sum().item()
        else:  # collateral damage: the other properties' probes
            t["collateral_n"] += known.sum().item()
            t["collateral_before"] += (batch.before[other] == truth)[known].sum().item()
            t["collateral_after"] += (after == truth)[known].sum().item()
