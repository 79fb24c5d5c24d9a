"""ReFT-r1's optimizer step (SteeringModule, configs/reft_r1.yaml), one step by hand against one
Lightning step on the tiny llama.

The order, as `modules/steering.py` documents it: the loss −log p(response) + λ·L1 is
backpropagated; the gradient component parallel to each row is removed, g_c ← g_c − (g_c·w_c) w_c
(`on_before_optimizer_step`, which Lightning runs before it clips); the gradient norm over the
dictionary is clipped (`trainer.gradient_clip_val`: 1.0 in the config, AxBench's, which the tiny
model's gradient, of norm about 0.04, never reaches; the test clips at 0.01 so that it acts); AdamW steps at the
schedule's learning rate (warmup 0: the full lr at step 0); each row is renormalised,
w_c ← w_c / ‖w_c‖ (`on_train_batch_end`)."""

import lightning as L
import pytest
import torch
import yaml

from lit_interventions.interventions.additive import ReFTR1Dictionary
from lit_interventions.modules.steering import SteeringModule
from tests.helpers import ROOT
from tests.test_axbench_methods import CONCEPTS, SyntheticConcepts, _trainer

LR, L1, CLIP = 1e-2, 0.5, 0.01


def test_the_config_clips_at_axbenchs_norm():
    assert yaml.safe_load((ROOT / "configs/reft_r1.yaml").read_text())["trainer"]["gradient_clip_val"] == 1.0


def _module(lm):
    # constant λ (no ramp), so the first step's gradient has the L1 term too
    method = ReFTR1Dictionary(topk=2, l1=L1, l1_ramp=False)
    return SteeringModule(lm=lm, layer=1, method=method, concept_names=CONCEPTS, lr=LR)


def _by_hand(module, batch) -> dict:
    """One step of the documented order, each formula written out here."""
    w = module.dictionary.weight.detach().clone()
    lm_loss, l1 = module._steered_loss(batch)
    (lm_loss + L1 * l1).backward()
    g = module.dictionary.weight.grad.detach().clone()
    perp = g - (g * w).sum(-1, keepdim=True) * w  # no radial component
    scale = min(1.0, CLIP / (perp.norm().item() + 1e-6))  # torch's clip_grad_norm_ coefficient
    used = perp * scale
    # AdamW's first step (β1 0.9, β2 0.999, ε 1e-8, no weight decay): bias-corrected m̂ = g, v̂ = g²
    stepped = w - LR * used / (used.abs() + 1e-8)
    return {
        "grad": g,
        "perp": perp,
        "used": used,
        "stepped": stepped,
        "final": stepped / stepped.norm(dim=-1, keepdim=True),
    }


def test_one_reft_r1_step_by_hand_equals_one_lightning_step(tmp_path, tiny_lm_dir, tokenizer):
    lm = tiny_lm_dir("llama")
    data = SyntheticConcepts(tokenizer)
    batch = next(iter(data.train_dataloader()))  # the first batch Lightning draws (seeded shuffle)
    hand_module = _module(lm)
    start = hand_module.dictionary.weight.detach().clone()
    hand = _by_hand(hand_module, batch)
    # the planted step is one where each part matters: a radial gradient to remove, a norm to clip
    assert hand["grad"].norm() > 1.02 * hand["perp"].norm() and hand["perp"].norm() > 2 * CLIP

    seen = {}

    class Seen(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # before the module's
            weight = pl_module.dictionary.weight
            seen["stepped"] = weight.detach().clone()
            seen["exp_avg"] = trainer.optimizers[0].state[weight]["exp_avg"].clone()  # (1 − β1)·g at step 1
            seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    module = _module(lm)
    assert torch.equal(module.dictionary.weight.detach(), start)
    trainer = _trainer(tmp_path, max_steps=1, gradient_clip_val=CLIP, limit_val_batches=0, callbacks=[Seen()])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    # the gradient AdamW stepped with: the parallel part removed, then clipped to norm CLIP
    torch.testing.assert_close(seen["exp_avg"] / 0.1, hand["used"], atol=1e-6, rtol=1e-4)
    assert (seen["exp_avg"] / 0.1).norm().item() == pytest.approx(CLIP, rel=1e-4)
    torch.testing.assert_close(seen["stepped"], hand["stepped"], atol=1e-6, rtol=0)
    torch.testing.assert_close(module.dictionary.weight.detach(), hand["final"], atol=1e-6, rtol=0)
    torch.testing.assert_close(module.dictionary.weight.norm(dim=-1), torch.ones(2), atol=1e-6, rtol=0)
