"""LoReFT at several layers on the prompt's ends, outside its module: `lit_interventions.apply`
on a saved run, and the pyvene export against pyvene run with AxBench's unit locations."""

from __future__ import annotations

import pytest
import torch

from lit_interventions.export.cli import main
from lit_interventions.export.pyvene_interventions import pyvene
from lit_interventions.inference.apply import apply
from lit_interventions.modules.steering_loreft import LoReFTModule

PROMPTS = [14, 11, 10]  # at least 10 tokens each: f5+l5 is 10 positions in every row


def _prompts(vocab_size: int, width: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (as AxBench's steering batches), ids and attention mask, (3, width)."""
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for row, n in enumerate(PROMPTS):
        mask[row, width - n :] = 1
    ids = torch.randint(3, vocab_size, mask.shape, generator=torch.Generator().manual_seed(0))
    return ids * mask, mask


def _f5_l5(mask: torch.Tensor) -> list[list[int]]:
    """AxBench's unit locations of f5+l5 for left-padded rows: prompt index + the row's padding."""
    locations = []
    for row in mask:
        first, n = int(row.argmax()), int(row.sum())
        locations.append([first + i for i in [0, 1, 2, 3, 4, n - 5, n - 4, n - 3, n - 2, n - 1]])
    return locations


@pytest.fixture
def run(tiny_lm_dir, tmp_path):
    torch.manual_seed(0)
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layers=[0, 2], positions="f5+l5")
    module.save(tmp_path / "run")
    return module, tmp_path / "run"


@torch.no_grad()
def test_apply_on_a_saved_run_equals_the_module_steering(run, tiny_lm):
    module, directory = run
    model = tiny_lm("llama")
    ids, mask = _prompts(model.config.vocab_size)
    clean = model(input_ids=ids, attention_mask=mask).logits
    with module.steer(model):
        ours = model(input_ids=ids, attention_mask=mask).logits
    with apply(model, str(directory)):
        applied = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(applied[real], ours[real], rtol=0, atol=1e-5)
    assert (ours[real] - clean[real]).abs().max() > 1e-3
    with apply(model, str(directory), positions="f1+l1"):  # a request's positions replace the saved ones
        other = model(input_ids=ids, attention_mask=mask).logits
    assert (other[real] - applied[real]).abs().max() > 1e-4


@torch.no_grad()
def test_pyvene_with_axbench_unit_locations_gives_our_logits(run, tiny_lm, tmp_path):
    module, directory = run
    main(["--artifact", str(directory), "--to", "pyvene", "--out", str(tmp_path / "pv")])
    model = tiny_lm("llama")
    intervenable = pyvene.IntervenableModel.load(str(tmp_path / "pv"), model)
    assert len(intervenable.interventions) == 2
    ids, mask = _prompts(model.config.vocab_size)
    locations = _f5_l5(mask)  # the same locations for each layer's intervention (share_weights)
    _, theirs = intervenable(
        {"input_ids": ids, "attention_mask": mask}, unit_locations={"sources->base": (None, [locations] * 2)}
    )
    with module.steer(model):
        ours = model(input_ids=ids, attention_mask=mask).logits
    clean = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - theirs.logits[real]).abs().max().item() < 1e-5
    assert (ours[real] - clean[real]).abs().max().item() > 1e-3
    every = [list(range(ids.shape[1]))] * len(ids)  # the same interventions at every position differ
    _, everywhere = intervenable({"input_ids": ids, "attention_mask": mask}, unit_locations={"base": [every, every]})
    assert (ours[real] - everywhere.logits[real]).abs().max().item() > 1e-3
