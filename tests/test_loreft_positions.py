"""LoReFT at several layers on the prompt's first and last tokens (AxBench's `f5+l5`): which
positions, which layers, training, saving and loading, bad artifacts, the AxBench config."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.artifacts.steering_files import LoReFTSteering
from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.forward import final_logits
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import load_lm
from lit_interventions.core.positions import Positions, PositionTracker
from lit_interventions.interventions.loreft import loreft
from lit_interventions.modules.steering_loreft import LoReFTModule, instruction_ends
from lit_interventions.modules.steering_objective import lm_loss
from lit_interventions.modules.steering_registry import load_steering_checkpoint
from tests.helpers import ONE_QUIET_EPOCH, run_command
from tests.test_loreft import _fit

PROMPTS, RESPONSES = [12, 7, 3, 9], [4, 6, 3, 2]  # row 3 is a negative (label 0)
LABELS = [1, 1, 1, 0]
# f5+l5 of prompts of 12, 7 and 3 tokens: min(n // 2, 5) first and last (AxBench / pyreft)
F5L5 = {0: [0, 1, 2, 3, 4, 7, 8, 9, 10, 11], 1: [0, 1, 2, 4, 5, 6], 2: [0, 2]}


def _batch(padding: str, width: int = 16) -> dict[str, torch.Tensor]:
    """Rows of prompt + response token ids (PROMPTS, RESPONSES), padded to `width` on `padding`'s side."""
    generator = torch.Generator().manual_seed(0)
    rows = {
        k: torch.zeros(len(PROMPTS), width, dtype=torch.long) for k in ("input_ids", "attention_mask", "response_mask")
    }
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        length = prompt + response
        offset = width - length if padding == "left" else 0
        rows["input_ids"][i, offset : offset + length] = torch.randint(3, 200, (length,), generator=generator)
        rows["attention_mask"][i, offset : offset + length] = 1
        rows["response_mask"][i, offset + prompt : offset + length] = 1
    return {**rows, "label": torch.tensor(LABELS), "concept_id": torch.zeros(len(PROMPTS), dtype=torch.long)}


def _offset(padding: str, row: int, width: int = 16) -> int:
    return width - PROMPTS[row] - RESPONSES[row] if padding == "left" else 0


def _chosen(mask: torch.Tensor) -> dict[int, list[int]]:
    return {row: mask[row].nonzero()[:, 0].tolist() for row in range(mask.shape[0])}


@pytest.mark.parametrize("padding", ["right", "left"])
def test_f5_l5_picks_the_first_and_last_five_prompt_tokens_whatever_the_padding(padding):
    chosen = _chosen(instruction_ends(_batch(padding), 5, 5))
    expected = {row: [_offset(padding, row) + p for p in F5L5.get(row, [])] for row in range(3)}
    expected[3] = [_offset(padding, 3) + p for p in [0, 1, 2, 3, 5, 6, 7, 8]]  # 9 tokens: 4 and 4
    assert chosen == expected


def test_while_generating_f5_l5_picks_left_padded_prompt_tokens_and_no_generated_token():
    tracker = PositionTracker()
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS[:3]):
        mask[row, 12 - prompt :] = 1
    tracker._new_prompt(None, mask, (3, 12))
    tracker.past, tracker.width = 0, 12
    chosen = _chosen(tracker.mask(Positions.parse("f5+l5"), 3, torch.device("cpu")))
    assert chosen == {row: [12 - PROMPTS[row] + p for p in F5L5[row]] for row in range(3)}
    tracker.past, tracker.width = 12, 1  # a generated token's forward
    assert not tracker.mask(Positions.parse("f5+l5"), 3, torch.device("cpu")).any()
    assert str(Positions.parse("f5+l5")) == "f5+l5" and Positions.parse("l3").indices == (0, 3)


@contextmanager
def _block_edits(model):
    """{block: [(its output, what the next part reads), per forward]}: a hook added after this
    one (a steering edit) makes the two differ."""
    blocks = decoder_layers(model)
    readers = [*blocks[1:], model.base_model.norm]
    records = {i: [] for i in range(len(blocks))}

    def tensor(value):
        return (value[0] if isinstance(value, tuple) else value).detach().clone()

    handles = []
    for i, (block, reader) in enumerate(zip(blocks, readers)):
        handles.append(block.register_forward_hook(lambda m, a, out, i=i: records[i].append([tensor(out)])))
        handles.append(
            reader.register_forward_pre_hook(
                lambda m, a, kw, i=i: records[i][-1].append(tensor(a[0] if a else kw["hidden_states"])),
                with_kwargs=True,
            )
        )
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def _phi(module, layer, hidden):
    return module.interventions[str(layer)](hidden).detach()


@pytest.mark.parametrize("padding", ["right", "left"])
def test_training_edits_exactly_those_positions_at_exactly_those_layers(tiny_lm_dir, padding):
    torch.manual_seed(0)
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layers=[0, 2], positions="f5+l5")
    batch = _batch(padding)
    with _block_edits(module.lm) as records, torch.no_grad():
        module.loss(batch)
    positives = [row for row, label in enumerate(LABELS) if label == 1]  # lm_loss runs the positive rows
    for layer, ((before, after),) in records.items():
        if layer == 1:
            assert torch.equal(before, after)  # no edit at a layer not listed
            continue
        changed = (after - before).abs().amax(-1) > 0
        assert _chosen(changed) == {
            i: [_offset(padding, row) + p for p in F5L5[row]] for i, row in enumerate(positives)
        }
        torch.testing.assert_close(after[changed], _phi(module, layer, before[changed]))


def test_generation_edits_the_prompt_once_and_no_generated_token(tiny_lm_dir, tokenizer):
    torch.manual_seed(0)
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layers=[1, 2], positions="f2+l3")
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS[:3]):  # left-padded prompts of 12, 7 and 3 tokens
        mask[row, 12 - prompt :] = 1
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0)) * mask
    with _block_edits(module.lm) as records, module.steer() as model, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = {}
    for row, n in enumerate(PROMPTS[:3]):
        first, half = 12 - n, n // 2
        expected[row] = [first + p for p in range(min(half, 2))] + [first + p for p in range(n - min(half, 3), n)]
    for layer, calls in records.items():
        assert len(calls) == 3  # the prompt, then one forward per generated token after the first
        (before, after), *decoding = calls
        changed = (after - before).abs().amax(-1) > 0
        assert _chosen(changed) == (expected if layer in (1, 2) else {0: [], 1: [], 2: []})
        assert all(torch.equal(b, a) for b, a in decoding)


def test_one_layer_at_every_position_is_the_single_layer_loreft(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    torch.manual_seed(3)
    single = LoReFTModule(lm=lm, layer=2)
    torch.manual_seed(3)
    listed = LoReFTModule(lm=lm, layers=[2], positions="all")
    batch = _batch("right")
    intervention = single.intervention
    R, W, b = intervention.rotation.detach(), intervention.source.weight.detach(), intervention.source.bias.detach()
    with torch.no_grad(), residual_hook(single.lm, 2, lambda h: loreft(h, R, W, b)):
        by_hand = lm_loss(single.lm, batch)  # Φ at every position after block 2
    with torch.no_grad():
        assert torch.equal(single.loss(batch), by_hand)
        assert torch.equal(listed.loss(batch), by_hand)
    tensors, card = single.export()
    assert single.single_site and set(tensors) == {"rotation", "weight", "bias"}
    assert list(card)[-4:] == ["layer", "rank", "positions", "hidden_size"] and card["positions"] == "all"


def _loader(tokenizer, padding="right"):
    """A planted task: every prompt is followed by the same response."""
    prompt = tokenizer("The dog is here. The dog", return_tensors="pt").input_ids[0]
    response = tokenizer(" give give give dog give", return_tensors="pt").input_ids[0]
    ids = torch.cat([prompt, response])
    rows = [
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": (torch.arange(len(ids)) >= len(prompt)).long(),
            "label": torch.tensor(1),
            "concept_id": torch.tensor(0),
        }
        for _ in range(8)
    ]
    return DataLoader(rows, batch_size=4)


@torch.no_grad()
def _loss(module, loader):
    module.eval()
    return float(sum(module.loss(b) for b in loader) / len(loader))


@torch.no_grad()
def _logits(module, ids):
    with module.steer() as model:
        return final_logits(model, model.base_model(input_ids=ids).last_hidden_state)


def test_training_on_the_prompt_ends_lowers_the_loss_and_round_trips(tiny_lm_dir, tokenizer, tmp_path):
    lm = tiny_lm_dir("llama")
    torch.manual_seed(0)
    module = LoReFTModule(lm=lm, layers=[0, 1, 2], positions="f2+l2", lr=1e-1, concept="dogs")
    loader = _loader(tokenizer)
    clean = float(lm_loss(load_lm(lm), next(iter(loader))))
    before = _loss(module, loader)
    _fit(module, loader, tmp_path, steps=60)
    after = _loss(module, loader)
    # the tiny LM's small random head caps what any edit reaches (about 0.3 below `clean` here)
    assert after < before - 0.2 and after < clean - 0.2, (clean, before, after)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["kind"] == "steering"
        and config["class_path"] == "lit_interventions.modules.steering_loreft.LoReFTModule"
    )
    assert (config["layers"], config["positions"], config["rank"], config["concept"]) == ([0, 1, 2], "f2+l2", 4, "dogs")
    assert set(load_file(tmp_path / "intervention.safetensors")) == {
        f"layers.{layer}.{part}" for layer in (0, 1, 2) for part in ("rotation", "weight", "bias")
    }
    ids = next(iter(loader))["input_ids"]
    loaded = load_steering_checkpoint(tmp_path)
    assert type(loaded) is LoReFTModule and str(loaded.positions) == "f2+l2"
    # R is rebuilt through the orthogonal parametrization: equal up to float32 round-off
    torch.testing.assert_close(_logits(loaded, ids), _logits(module, ids), rtol=0, atol=1e-6)
    assert _loss(loaded, loader) == pytest.approx(after, abs=1e-6)
    steering = from_pretrained(tmp_path)  # the weights and their edits, without the LM
    assert type(steering) is LoReFTSteering and str(steering.positions) == "f2+l2"
    hidden = torch.randn(3, 32)
    for layer, intervention in module.by_layer().items():
        with torch.no_grad():
            want = intervention(hidden, None)
        torch.testing.assert_close(steering.by_layer[layer](hidden, None), want, rtol=0, atol=1e-6)
    assert abs(float(lm_loss(load_lm(lm), next(iter(loader)))) - clean) < 1e-6  # the shared LM is untouched


def test_an_old_single_layer_card_loads_as_before(tiny_lm_dir, tmp_path):
    from lit_interventions.artifacts.intervention_files import write_tensors

    torch.manual_seed(1)
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layer=1, rank=2)
    card = {"method": "loreft", "model": tiny_lm_dir("llama"), "concept": "c", "concept_id": None, "metrics": {}}
    write_tensors(tmp_path, module.intervention.export(), {**card, "layer": 1, "rank": 2, "positions": "all"})
    loaded = load_steering_checkpoint(tmp_path)
    assert loaded.hparams.layer == 1 and loaded.hparams.layers is None and str(loaded.positions) == "all"
    hidden = torch.randn(2, 5, 32)
    torch.testing.assert_close(loaded.intervention(hidden), module.intervention(hidden), rtol=0, atol=1e-6)


def test_a_lightning_checkpoint_of_several_layers_loads_by_its_hyper_parameters(tiny_lm_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    module = LoReFTModule(lm=tiny_lm_dir("llama"), layers=[2, 0], positions="l4", lr=1e-1)
    trainer = _fit(module, _loader(tokenizer), tmp_path, steps=2)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    loaded = load_steering_checkpoint(tmp_path / "run.ckpt")
    assert list(loaded.by_layer()) == [2, 0] and str(loaded.positions) == "f0+l4"
    for layer, intervention in module.by_layer().items():
        for (name, ours), theirs in zip(intervention.export().items(), loaded.by_layer()[layer].export().values()):
            torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def saved(tiny_lm_dir, tmp_path):
    """A saved LoReFT at layers [0, 2], f5+l5, rank 4 (its directory)."""
    torch.manual_seed(0)
    LoReFTModule(lm=tiny_lm_dir("llama"), layers=[0, 2], positions="f5+l5").save(tmp_path / "run")
    return tmp_path / "run"


def _orthonormal(rank, width):
    return torch.linalg.qr(torch.randn(width, rank)).Q.T.contiguous()


CARD_FAULTS = [
    ({"layers": "6"}, r"layers='6' must be a non-empty list"),
    ({"layers": [0, 0]}, r"layers=\[0, 0\] names a layer twice"),
    ({"layers": [0, 9]}, r"layers=\[0, 9\]: \[9\] out of range; this model has 3 layers"),
    ({"positions": "f5-l5"}, r"positions='f5-l5': use 'all' or fN\+lM"),
    ({"positions": "f0+l0"}, r"positions='f0\+l0': use 'all' or fN\+lM"),
    ({"rank": 0}, r"rank=0 must be a positive integer"),
    ({"rank": 3}, r"LoReFT tensor layers.0.bias has shape \(4,\); rank 3 needs \(3,\)"),
    ({"class_path": "builtins.eval"}, r"'builtins.eval' is not a registered steering module, so nothing was imported"),
]


@pytest.mark.parametrize("change, message", CARD_FAULTS, ids=[str(c) for c, _ in CARD_FAULTS])
def test_a_bad_card_is_one_line_naming_the_field(saved, change, message):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as err:
        load_steering_checkpoint(saved)
    assert "\n" not in str(err.value)


TENSOR_FAULTS = [
    (lambda t: t.pop("layers.2.bias"), r"LoReFT tensors for layers \[0, 2\] miss \['layers.2.bias'\]"),
    (lambda t: t.update({"layers.1.bias": torch.zeros(4)}), r"unexpected \['layers.1.bias'\]"),
    (lambda t: t.update({"layers.2.rotation": 2 * t["layers.2.rotation"]}), r"layers.2.rotation: rows are not orthonormal"),
    (lambda t: t.update({"layers.0.weight": torch.zeros(4, 31)}), r"layers.0.weight has shape \(4, 31\); rank 4 needs \(4, 32\)"),
    (lambda t: t["layers.0.bias"].__setitem__(0, float("nan")), r"tensor 'layers.0.bias' has 1 NaN or infinite"),
    (
        lambda t: t.update({k: (_orthonormal(4, 16) if k.endswith("rotation") else v[..., :16]) for k, v in t.items()}),
        r"trained on hidden size 16, but .* has hidden size 32",
    ),
]  # fmt: skip


@pytest.mark.parametrize("change, message", TENSOR_FAULTS, ids=[m[:24] for _, m in TENSOR_FAULTS])
def test_bad_tensors_are_one_line_naming_the_tensor(saved, change, message):
    tensors = load_file(saved / "intervention.safetensors")
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, saved / "intervention.safetensors")
    with pytest.raises(ValueError, match=message) as err:
        load_steering_checkpoint(saved)
    assert "\n" not in str(err.value)


def test_bad_arguments_are_one_line(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"layer=1 and layers=\[0\]: give one of them"):
        LoReFTModule(lm=lm, layer=1, layers=[0])
    with pytest.raises(ValueError, match=r"positions='first5'"):
        LoReFTModule(lm=lm, positions="first5")
    with pytest.raises(ValueError, match=r"layers=\[\]"):
        LoReFTModule(lm=lm, layers=[])


def test_the_axbench_loreft_config_trains_through_train_py(tiny_lm_dir, tmp_path):
    result = run_command(
        "train.py", "fit", "--config", "configs/loreft_axbench.yaml", f"--model.lm={tiny_lm_dir('llama')}",
        "--model.layers=[0,2]", "--data.concept_dir=examples/data/axbench", "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={tmp_path}", *ONE_QUIET_EPOCH,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["layers"], config["positions"], config["rank"]) == ([0, 2], "f5+l5", 4)
    module = load_steering_checkpoint(tmp_path)
    assert list(module.by_layer()) == [0, 2] and str(module.positions) == "f5+l5"
    assert "val/loss" in config["metrics"]  # validated after the epoch
