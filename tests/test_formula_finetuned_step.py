"""The per-concept steering baselines' loop (`FinetunedSteeringModule`: LoReFT, LoRA), one step by
hand on the tiny llama against one Lightning step, as test_formula_reft_r1_step.py does for ReFT-r1.

The loop, as `modules/steering_finetuned.py` documents it (AxBench §4: LoReFT and LoRA trained
with the LM loss on the concept's positive responses, AdamW, a linear schedule):
- the rows of the module's concept (`concept_id`) that are positives (label 1);
- loss = mean over their response tokens of −log p(token | everything before it): position t
  predicts token t + 1 wherever token t + 1 is a response token; instruction tokens, other
  concepts' rows and negatives add nothing;
- LoReFT: Φ(h) = h + Rᵀ(W h + b − R h) on the residual stream after block `layer`, every
  position; LoRA: W₀x + (α/r)·B A x on each attention output projection;
- AdamW (β 0.9 / 0.999, ε 1e-8, decoupled weight decay): at step 1, m̂ = g and v̂ = g², so
  p ← p·(1 − lr·wd) − lr·g/(|g| + ε);
- the learning rate: linear warmup over int(warmup_ratio·T) steps from 0, then linear decay to 0
  at T, the trainer's stepping batches."""

import lightning as L
import pytest
import torch

from lit_interventions.core.lm import load_lm
from lit_interventions.modules.steering_baselines import LoRAModule
from lit_interventions.modules.steering_loreft import LoReFTModule
from tests.test_axbench_methods import SyntheticConcepts, _trainer

LR, WD, LAYER, CONCEPT = 1e-2, 0.1, 1, 0


def _block_output(output):
    return output[0] if isinstance(output, tuple) else output


def _lm_loss_by_hand(model, batch) -> torch.Tensor:
    """−log p over the response tokens of the concept's positive rows, from the full logits."""
    keep = (batch["concept_id"] == CONCEPT) & (batch["label"] == 1)
    ids, mask, response = batch["input_ids"][keep], batch["attention_mask"][keep], batch["response_mask"][keep]
    logits = model(input_ids=ids, attention_mask=mask).logits
    predict = response[:, 1:].bool()  # logits at t predict the token at t + 1
    return torch.nn.functional.cross_entropy(logits[:, :-1][predict].float(), ids[:, 1:][predict])


def _adamw_first_step(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return p * (1 - LR * WD) - LR * g / (g.abs() + 1e-8)


def _first_batch(tokenizer):
    data = SyntheticConcepts(tokenizer)
    batch = next(iter(data.train_dataloader()))  # the first batch Lightning draws (seeded shuffle)
    keep = (batch["concept_id"] == CONCEPT) & (batch["label"] == 1)
    # the planted batch has what the loss must leave out: other rows and instruction tokens
    assert keep.any() and not keep.all() and (batch["attention_mask"].bool() & ~batch["response_mask"].bool()).any()
    return data, batch


def _one_lightning_step(module, data, tmp_path):
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0, logger=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["weight_decay"] == WD and optimizer.param_groups[0]["initial_lr"] == LR


def test_one_loreft_step_by_hand_equals_one_lightning_step(tmp_path, tiny_lm_dir, tokenizer):
    lm = tiny_lm_dir("llama")
    data, batch = _first_batch(tokenizer)
    module = LoReFTModule(lm=lm, layer=LAYER, rank=2, concept_id=CONCEPT, lr=LR, weight_decay=WD)
    start = {name: p.detach().clone() for name, p in module.named_parameters()}
    model = load_lm(lm)

    def phi(m, inputs, output):  # Φ(h) = h + Rᵀ(W h + b − R h), written out here
        h = _block_output(output)
        R, W, b = module.intervention.rotation, module.intervention.source.weight, module.intervention.source.bias
        edited = h + (h @ W.T + b - h @ R.T) @ R
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    handle = model.model.layers[LAYER].register_forward_hook(phi)
    try:
        loss = _lm_loss_by_hand(model, batch)
    finally:
        handle.remove()
    torch.testing.assert_close(module.loss(module._concept_rows(batch)), loss.detach(), atol=1e-5, rtol=1e-5)
    loss.backward()
    expected = {name: _adamw_first_step(start[name], p.grad) for name, p in module.named_parameters()}
    assert all(p.grad.abs().sum() > 0 for p in module.parameters())
    module.zero_grad(set_to_none=True)

    _one_lightning_step(module, data, tmp_path)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], atol=1e-6, rtol=0, msg=name)
        assert not torch.equal(p.detach(), start[name])


def _lora_pairs(module) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """{the adapted module's name in the plain LM: (A, B)}."""
    pairs = {}
    for name, sub in module._frozen["peft"].named_modules():
        if hasattr(sub, "lora_A") and "default" in sub.lora_A:
            pairs[name.removeprefix("base_model.model.")] = (sub.lora_A["default"].weight, sub.lora_B["default"].weight)
    return pairs


def test_one_lora_step_by_hand_equals_one_lightning_step(tmp_path, tiny_lm_dir, tokenizer):
    lm = tiny_lm_dir("llama")
    data, batch = _first_batch(tokenizer)
    module = LoRAModule(lm=lm, rank=2, alpha=8, concept_id=CONCEPT, lr=LR, weight_decay=WD)
    pairs = _lora_pairs(module)
    assert pairs and all(name.endswith("o_proj") for name in pairs)
    with torch.no_grad():  # peft starts B at 0 (no gradient for A): plant a B so that both move
        g = torch.Generator().manual_seed(0)
        for _, B in pairs.values():
            B.copy_(0.1 * torch.randn(B.shape, generator=g))
    start = {name: p.detach().clone() for name, p in module.named_parameters()}
    model, scale = load_lm(lm), 8 / 2  # α/r
    handles = []
    for name, (A, B) in pairs.items():

        def adapted(m, inputs, output, A=A, B=B):  # W₀x + (α/r)·B A x
            return output + scale * (inputs[0] @ A.T) @ B.T

        handles.append(model.get_submodule(name).register_forward_hook(adapted))
    try:
        loss = _lm_loss_by_hand(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(module.loss(module._concept_rows(batch)), loss.detach(), atol=1e-5, rtol=1e-5)
    loss.backward()
    expected = {name: _adamw_first_step(start[name], p.grad) for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)

    _one_lightning_step(module, data, tmp_path)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("warmup_ratio", "by_hand"), [(0.0, [1, 4 / 5, 3 / 5, 2 / 5, 1 / 5]), (0.5, [0, 1 / 2, 1, 2 / 3, 1 / 3])]
)
def test_the_schedule_by_hand(tmp_path, tiny_lm_dir, tokenizer, warmup_ratio, by_hand):
    """5 batches (36 rows, 8 a batch): T = 5; warmup int(0.5·5) = 2 steps: lr 0, lr/2, then lr·(5 − t)/3."""
    data = SyntheticConcepts(tokenizer)
    assert len(data.train_dataloader()) == 5
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layer=LAYER, rank=2, lr=LR, warmup_ratio=warmup_ratio)
    seen = []

    class Seen(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = _trainer(tmp_path, limit_val_batches=0, logger=False, callbacks=[Seen()])
    trainer.fit(module, datamodule=data)
    assert seen == pytest.approx([LR * f for f in by_hand], rel=1e-12, abs=1e-15)
