"""LoReFT and LoRA steering baselines: the formula by hand, training, what is trainable and saved."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.artifacts.steering_files import LoRAAdapter
from lit_interventions.cli.commands import run
from lit_interventions.core.forward import final_logits
from lit_interventions.core.lm import load_lm
from lit_interventions.core.parts import attention_output_modules
from lit_interventions.interventions.loreft import LoReFTIntervention, loreft
from lit_interventions.modules.steering_baselines import LoRAModule
from lit_interventions.modules.steering_loreft import LoReFTModule
from lit_interventions.modules.steering_objective import lm_loss
from lit_interventions.modules.steering_registry import load_steering_checkpoint


def test_loreft_matches_formula_by_hand():
    torch.manual_seed(0)
    module = LoReFTIntervention(8, rank=3)
    R, W, b = module.rotation.detach(), module.source.weight.detach(), module.source.bias.detach()
    assert torch.allclose(R @ R.T, torch.eye(3), atol=1e-5)  # orthonormal rows
    h = torch.randn(2, 5, 8)
    expected = torch.empty_like(h)
    for i in range(2):
        for t in range(5):
            x = h[i, t]
            expected[i, t] = x + R.T @ (W @ x + b - R @ x)
    assert torch.allclose(module(h), expected, atol=1e-5)
    assert not torch.allclose(module(h), h, atol=1e-3)  # not the identity at initialisation


def test_loreft_with_w_equal_r_and_zero_bias_is_identity():
    torch.manual_seed(1)
    module = LoReFTIntervention(8, rank=2)
    with torch.no_grad():
        module.source.weight.copy_(module.rotation)
        module.source.bias.zero_()
    h = torch.randn(4, 8)
    assert torch.allclose(module(h), h, atol=1e-5)
    R = torch.linalg.qr(torch.randn(8, 2)).Q.T
    assert torch.allclose(loreft(h, R, R, torch.zeros(2)), h, atol=1e-5)


def test_loreft_export_roundtrip_and_bad_rank():
    torch.manual_seed(2)
    module = LoReFTIntervention(8, rank=2)
    copy = LoReFTIntervention.from_tensors(module.export())
    h = torch.randn(3, 8)
    assert torch.allclose(copy(h), module(h), atol=1e-5)
    with pytest.raises(ValueError, match="rank=9"):
        LoReFTIntervention(8, rank=9)


def _batches(tokenizer, n=8, length=24):
    """Positive rows with a fixed response, plus one negative row per batch (ignored by the loss)."""
    text = "The dog is here. The dog is here. The dog is here."
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :length]
    rows = []
    for i in range(n):
        response = torch.zeros(len(ids), dtype=torch.long)
        response[len(ids) // 3 :] = 1
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "response_mask": response,
                "label": torch.tensor(int(i % 4 != 3)),
                "concept_id": torch.tensor(0),
            }
        )
    return DataLoader(rows, batch_size=4)


def test_lm_loss_ignores_negative_rows(tiny_lm, tokenizer):
    model = tiny_lm("llama")
    batch = next(iter(_batches(tokenizer)))
    positive = {k: v[batch["label"] == 1] for k, v in batch.items()}
    assert torch.allclose(lm_loss(model, batch), lm_loss(model, positive))
    # by hand: full logits, shifted, on response tokens only
    logits = final_logits(model, model.base_model(input_ids=positive["input_ids"]).last_hidden_state)
    mask = positive["response_mask"][:, 1:].bool()
    manual = torch.nn.functional.cross_entropy(logits[:, :-1][mask], positive["input_ids"][:, 1:][mask])
    assert torch.allclose(lm_loss(model, batch), manual, atol=1e-5)


def _fit(module, loader, tmp_path, steps=30):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return trainer


@torch.no_grad()
def _loss(module, loader):
    module.eval()
    return float(sum(module.loss(b) for b in loader) / len(loader))


def test_validation_loss_is_the_token_mean_over_the_split(tiny_lm_dir, tokenizer):
    """val/loss weighs each batch by its response tokens, so it is the mean over every response
    token of the split whatever the batching (DDP processes batch the split differently)."""
    rows = list(_batches(tokenizer, n=6).dataset)
    for i, row in enumerate(rows):  # responses of different lengths
        row["response_mask"] = (torch.arange(len(row["input_ids"])) >= 2 + i).long()
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layer=2, rank=4)
    torch.nn.init.normal_(module.intervention.source.weight)  # a steering that changes the loss
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    losses = [
        trainer.validate(module, DataLoader(rows, batch_size=size), verbose=False)[0]["val/loss"] for size in (6, 4, 1)
    ]
    with torch.no_grad():
        whole = float(module.loss(next(iter(DataLoader(rows, batch_size=6)))))
    assert losses == pytest.approx([whole] * 3, rel=1e-5)


def test_loreft_training_lowers_lm_loss_and_saves_only_the_intervention(tiny_lm_dir, tokenizer, tmp_path):
    lm = tiny_lm_dir("llama")
    module = LoReFTModule(lm=lm, layer=2, rank=4, lr=1e-1, concept="dogs")
    loader = _batches(tokenizer)
    clean = float(lm_loss(load_lm(lm), next(iter(loader))))
    before = _loss(module, loader)
    _fit(module, loader, tmp_path, steps=60)
    after = _loss(module, loader)
    assert after < before - 0.3 and after < clean - 0.3, (clean, before, after)
    assert all(k.startswith("intervention.") for k in module.state_dict())
    assert {k for k, _ in module.named_parameters() if _.requires_grad} == {
        "intervention.rotate.parametrizations.weight.original",
        "intervention.source.weight",
        "intervention.source.bias",
    }
    tensors = load_file(tmp_path / "intervention.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {"rotation": (4, 32), "weight": (4, 32), "bias": (4,)}
    loaded = load_steering_checkpoint(tmp_path)
    assert loaded.hparams.layer == 2 and loaded.hparams.concept == "dogs"
    assert abs(_loss(loaded, loader) - after) < 1e-4
    intervention = from_pretrained(tmp_path)  # the pure intervention, as for any other method
    assert type(intervention) is LoReFTIntervention
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(intervention(hidden), module.intervention(hidden).detach(), rtol=1e-5, atol=1e-5)
    # the shared frozen LM is unchanged outside the steering block
    assert abs(float(lm_loss(load_lm(lm), next(iter(loader)))) - clean) < 1e-6


def test_lora_adapter_on_o_proj_changes_output_and_saves_only_adapter(tiny_lm_dir, tokenizer, tmp_path):
    lm = tiny_lm_dir("llama")
    module = LoRAModule(lm=lm, rank=2, lr=5e-2, concept="dogs")
    assert module.hparams.target_modules == ["o_proj"] and module.hparams.alpha == 32
    loader = _batches(tokenizer)
    clean = float(lm_loss(load_lm(lm), next(iter(loader))))
    assert abs(float(lm_loss(module.lm, next(iter(loader)))) - clean) < 1e-6  # B = 0 at init
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("adapter.") and "lora_" in n and "o_proj" in n for n in trainable)
    assert len(trainable) == 2 * 3  # A and B in each of the 3 layers
    assert set(module.state_dict()) == {f"adapter.{n.split('.', 1)[1]}" for n in trainable}
    _fit(module, loader, tmp_path, steps=30)
    after = _loss(module, loader)
    assert after < clean - 0.2, (clean, after)
    tensors = load_file(tmp_path / "intervention.safetensors")
    assert len(tensors) == 6 and all("lora_" in k and "o_proj" in k for k in tensors)
    loaded = load_steering_checkpoint(tmp_path)
    assert abs(_loss(loaded, loader) - after) < 1e-4
    config = json.loads((tmp_path / "config.json").read_text())  # the one artifact format
    assert config["kind"] == "steering" and config["class_path"].endswith("LoRAModule") and config["rank"] == 2
    assert "o_proj" in config["site"] and (tmp_path / "README.md").is_file()
    by_kind = from_pretrained(tmp_path)  # the adapter's weights and edits, without the LM
    assert type(by_kind) is LoRAAdapter and by_kind.scaling == loaded.scaling
    for key, value in loaded.export()[0].items():
        torch.testing.assert_close(by_kind.tensors[key], value.float(), rtol=0, atol=0, msg=key)
    assert abs(float(lm_loss(load_lm(lm), next(iter(loader)))) - clean) < 1e-6  # shared LM untouched


def test_rslora_scales_by_alpha_over_root_rank_and_keeps_it_through_saving(tiny_lm_dir, tokenizer, tmp_path):
    lm = tiny_lm_dir("llama")
    module = LoRAModule(lm=lm, rank=4, alpha=8, rslora=True, lr=5e-2)
    peft_layer = next(m for name, m in module._frozen["peft"].named_modules() if name.endswith("o_proj"))
    assert peft_layer.scaling["default"] == module.scaling == 8 / 2  # α/√r, not α/r = 2
    loader = _batches(tokenizer)
    _fit(module, loader, tmp_path, steps=5)
    loaded = load_steering_checkpoint(tmp_path)
    assert loaded.hparams.rslora is True and loaded.scaling == 4.0
    adapter = from_pretrained(tmp_path)
    assert adapter.scaling == 4.0 and adapter.peft_adapter()[0].use_rslora is True
    assert abs(_loss(loaded, loader) - _loss(module, loader)) < 1e-5
    assert json.loads((tmp_path / "config.json").read_text())["rslora"] is True
    assert loaded.peft_adapter()[0].use_rslora is True  # `export --to peft` writes it to adapter_config.json


def test_the_axbench_lora_config_trains_rslora_with_dropout_on_its_layers(tiny_lm_dir, tmp_path):
    argv = [
        "fit", "--config", "lora_axbench.yaml", f"--model.lm={tiny_lm_dir('llama')}", "--model.layers=[0,2]",
        "--data.concept_dir=examples/data/axbench", "--trainer.max_epochs=2", "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    cli = run(argv)
    module = cli.model
    adapted = {name.replace("__", ".").split(".layers.")[1].split(".")[0] for name in module.adapter}
    assert adapted == {"0", "2"} and module.scaling == 32 / 2  # α/√r, r = 4
    assert {d["default"].p for d in module._frozen["dropouts"]} == {0.05}
    batches = len(cli.datamodule.train_dataloader())  # 18 a batch, 2 accumulated a step
    assert cli.trainer.global_step == 2 * -(-batches // 2)


@pytest.mark.parametrize(
    "arch, target", [("gpt2", "attn.c_proj"), ("gpt_neox", "attention.dense"), ("gemma3", "o_proj")]
)
def test_lora_target_is_the_attention_output_projection(tiny_lm, arch, target):
    assert attention_output_modules(tiny_lm(arch)) == [target]


def test_bad_arguments_raise(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match="layer=7"):
        LoReFTModule(lm=lm, layer=7)
    with pytest.raises(ValueError, match="nonexistent_proj"):
        LoRAModule(lm=lm, target_modules=["nonexistent_proj"])
