"""Frozen LMs larger than one device (`lit_interventions.core.sharding`): a device map spreads the LM
with accelerate, 8/4-bit weights come from bitsandbytes. On a CPU-only machine a device map that
puts blocks and the LM head on "disk" runs every forward through accelerate's dispatch hooks
(AlignDevicesHook loads the offloaded weights on the fly): its numbers must equal the unsharded
model's. Quantized LMs are compared with a float LM holding their dequantized weights."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule

from lit_interventions.core.batch import PairBatch, Side
from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.forward import logits_at, read_layers
from lit_interventions.core.lm import load_lm
from lit_interventions.core.sharding import LoadOptions, execution_device, input_device, is_dispatched
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.interchange import InterchangeModule
from tests.conftest import HIDDEN, LAYERS
from tests.helpers import token_batch

# --- bad values: one line naming the value and what is allowed, before anything loads ---------


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(device_map="everywhere"), "device_map='everywhere' is neither a placement strategy (auto, balanced"),
        (dict(device_map={"model.layers.0": "gpu7"}), "device_map['model.layers.0']='gpu7' is not a device"),
        (dict(device_map={"model.layers.0": -1}), "device_map['model.layers.0']=-1: a GPU index is >= 0"),
        (dict(device_map={}), "device_map={} is empty"),
        (dict(device_map=1.5), "device_map=1.5: use None, one of auto, balanced"),
        (dict(quantization="3bit"), "quantization='3bit' is not supported; choose one of 8bit, 4bit or None"),
        (dict(device_map="auto", max_memory={"cpu": "lots"}), "max_memory['cpu']='lots' is not a memory size"),
        (dict(device_map="auto", max_memory=["cpu"]), "max_memory=['cpu']: use a dict {device: size}"),
        (dict(max_memory={0: "10GiB"}), "max_memory is read by the placement strategies only"),
        (dict(offload_folder="/tmp/x"), "offload_folder holds weights a device_map places on 'disk'"),
    ],
)
def test_bad_options_are_one_line_before_any_load(options, message):
    with pytest.raises(ValueError) as err:
        load_lm("/no/such/model", "float32", **options)  # the options fail first: the path is never read
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        InterchangeModule(lm="/no/such/model", **options)  # the module checks them before its config
    assert message in str(err.value)


def test_calm_and_steer_eval_refuse_bad_placement_before_any_work(tmp_path):
    from lit_interventions.studies.calm import run_calm
    from lit_interventions.studies.steer import run_steer_eval

    with pytest.raises(ValueError, match="device_map='everywhere' is neither a placement strategy"):
        run_calm(lm="/no/such/model", device_map="everywhere", out=str(tmp_path / "calm"))
    with pytest.raises(ValueError, match="quantization='3bit' is not supported"):
        run_steer_eval(dictionary="/no/such/dictionary", quantization="3bit", out=str(tmp_path / "steer"))
    assert not list(tmp_path.iterdir())


def test_a_device_map_naming_a_missing_module_is_refused_before_loading(tiny_lm_dir):
    with pytest.raises(
        ValueError,
        match=r"device_map names modules this model does not have: 'model.layer.1'; "
        r"its modules include lm_head, model, model.embed_tokens, model.layers",
    ):
        load_lm(tiny_lm_dir("llama"), "float32", {"": "cpu", "model.layer.1": "cpu"})


def test_options_normalise_and_key_the_cache():
    """Equal options give one key whatever the dict order and spelling; quantization implies
    device_map="auto"; the defaults keep the empty key (load_lm(x) and load_lm(x, "float32")
    share one copy, as before)."""
    assert LoadOptions().key() == ""
    a = LoadOptions({"model.layers.1": "disk", "model.embed_tokens": "0"}, max_memory=None)
    b = LoadOptions({"model.embed_tokens": 0, "model.layers.1": "disk"})
    assert a.key() == b.key() and LoadOptions.from_key(a.key()) == b
    assert a.device_map == {"model.layers.1": "disk", "model.embed_tokens": 0}
    auto = LoadOptions("auto", max_memory={"0": "20GiB", "cpu": 10**9})
    assert auto.max_memory == {0: "20GiB", "cpu": 10**9} and LoadOptions.from_key(auto.key()) == auto
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert LoadOptions(quantization="4bit").device_map == "auto"


# --- a device map on a CPU-only machine: blocks and the head offloaded to disk ------------------


def split_map(model, first_on_disk: int) -> dict:
    """Everything on the CPU but blocks first_on_disk.. and the LM head (with the input embeddings
    when they share its weights), which go to disk."""
    blocks = decoder_layers(model)
    names = {module: name for name, module in model.named_modules()}
    prefix = model.base_model_prefix
    device_map = {
        f"{prefix}.{child}": "cpu" for child, module in model.base_model.named_children() if module is not blocks
    }
    device_map.update({f"{names[blocks]}.{i}": "cpu" if i < first_on_disk else "disk" for i in range(len(blocks))})
    device_map["lm_head"] = "disk"
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:  # tied: kept together
        device_map.update(
            {name: "disk" for name, module in model.named_modules() if module is model.get_input_embeddings()}
        )
    return device_map


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("offload"))


def _sharded(tiny_lm_dir, arch, offload_dir):
    plain = load_lm(tiny_lm_dir(arch))
    options = dict(device_map=split_map(plain, 1), offload_folder=offload_dir)
    return plain, load_lm(tiny_lm_dir(arch), "float32", **options), options


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_offloaded_blocks_give_the_same_states_and_logits(tiny_lm_dir, arch, offload_dir):
    plain, sharded, options = _sharded(tiny_lm_dir, arch, offload_dir)
    assert sharded is not plain and load_lm(tiny_lm_dir(arch), "float32", **options) is sharded  # cached by options
    blocks = decoder_layers(sharded)
    hooks = [getattr(module, "_hf_hook", None) for module in blocks[1].modules()]
    offloading = [hook for hook in hooks if getattr(hook, "offload", False)]
    assert offloading and type(offloading[0]).__name__ == "AlignDevicesHook"  # loads the weights on the fly
    assert all(p.device.type == "meta" for p in blocks[1].parameters())  # no weights held between forwards
    assert is_dispatched(sharded) and not is_dispatched(plain) and input_device(sharded) == torch.device("cpu")
    assert execution_device(blocks[2]) == torch.device("cpu")

    ids, mask, last = token_batch(plain.config.vocab_size, lengths=(9, 5, 7))
    src_ids, src_mask, _ = token_batch(plain.config.vocab_size, lengths=(6, 9, 8), seed=1)
    positions = last - 1
    vocab = torch.tensor([[3, 4], [5, 6], [7, 8]])
    torch.testing.assert_close(logits_at(sharded, ids, mask, last), logits_at(plain, ids, mask, last), rtol=0, atol=0)
    torch.testing.assert_close(
        logits_at(sharded, ids, mask, last, vocab=vocab),  # the gather from the offloaded head
        logits_at(plain, ids, mask, last, vocab=vocab),
        rtol=0,
        atol=0,
    )
    layers = list(range(-1, LAYERS))
    states = read_layers(sharded, layers, ids, mask)
    expected = read_layers(plain, layers, ids, mask)
    for layer in layers:
        torch.testing.assert_close(states[layer], expected[layer], rtol=0, atol=0)
    torch.manual_seed(0)
    direction = FixedSubspaceIntervention(torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1))
    for layer in layers:
        source = read_layers(plain, [layer], src_ids, src_mask)[layer][torch.arange(3), positions]
        edit = lambda h: direction(h, source)  # noqa: E731
        full = logits_at(plain, ids, mask, last, layer, positions, edit)
        torch.testing.assert_close(logits_at(sharded, ids, mask, last, layer, positions, edit), full, rtol=0, atol=0)
        # the cached fast path: blocks below the layer skipped (their dispatch hooks put back after)
        torch.testing.assert_close(
            logits_at(sharded, ids, mask, last, layer, positions, edit, start_states=states[layer]),
            full,
            rtol=1e-5,
            atol=1e-6,
        )
    assert all("forward" in block.__dict__ for block in blocks)  # accelerate's wrapped forwards survive the skip
    torch.testing.assert_close(logits_at(sharded, ids, mask, last), logits_at(plain, ids, mask, last), rtol=0, atol=0)


def test_prefix_cache_on_offloaded_blocks(tiny_lm_dir, offload_dir):
    """Keys and values of the blocks above the layer, computed once with offloaded blocks, feed
    the same logits as the full forward of the unsharded model."""
    plain, sharded, _ = _sharded(tiny_lm_dir, "llama", offload_dir)
    ids, mask, last = token_batch(plain.config.vocab_size, lengths=(12, 9, 10))
    sites = torch.tensor([8, 4, 6])
    zeros = torch.zeros(3, dtype=torch.long)
    batch = PairBatch(Side.of(ids, mask, sites), Side.of(ids.flip(0), mask.flip(0), sites), zeros, zeros, zeros)
    layer = 0
    cache = ActivationCache(sharded, [layer])
    cache.fill([batch], batch_size=2)
    c, above = cache.prefix(layer, batch.base)
    assert c == 4 and above.shape[:3] == (LAYERS - 1, 2, 3)
    start = cache.states(layer, batch.base)
    real = mask[..., None].bool()  # the cache holds zeros at padding; fill batches differ: float noise
    torch.testing.assert_close(start, read_layers(plain, [layer], ids, mask)[layer] * real, rtol=1e-5, atol=1e-6)
    source = cache.at_site(layer, batch.source)
    torch.manual_seed(0)
    direction = FixedSubspaceIntervention(torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1))
    edit = lambda h: direction(h, source)  # noqa: E731
    torch.testing.assert_close(
        logits_at(sharded, ids, mask, last, layer, sites, edit, start_states=start, prefix=(c, above)),
        logits_at(plain, ids, mask, last, layer, sites, edit),
        rtol=1e-5,
        atol=1e-6,
    )


def _train_das(lm_dir, cache: bool, **options):
    L.seed_everything(0)
    module = InterchangeModule(lm=lm_dir, layer=1, cache=cache, lr=0.05, **options)
    data = CausalGymDataModule(task="agr_sv_num_pp", lm=lm_dir, train_pairs=8, eval_pairs=4)
    trainer = L.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, data)
    return module, trainer.callback_metrics


@pytest.mark.parametrize("cache", [True, False])
def test_das_trained_on_an_offloaded_lm_equals_the_unsharded_one(tiny_lm_dir, offload_dir, cache):
    lm_dir = tiny_lm_dir("llama")
    device_map = split_map(load_lm(lm_dir), 1)
    sharded, sharded_metrics = _train_das(lm_dir, cache, device_map=device_map, offload_folder=offload_dir)
    plain, plain_metrics = _train_das(lm_dir, cache)
    assert is_dispatched(sharded.lm) and not is_dispatched(plain.lm)
    assert sharded.hparams.device_map == device_map  # saved, so a checkpoint reloads it the same way
    assert "lm" not in dict(sharded.named_modules()) and all(k.startswith("intervention") for k in sharded.state_dict())
    basis = sharded.intervention.basis.detach()
    torch.testing.assert_close(basis, plain.intervention.basis.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(basis, RotatedSpaceIntervention(HIDDEN).basis.detach())  # training moved it
    for name in ("val/odds", "val/iia", "val/loss"):
        assert sharded_metrics[name].item() == pytest.approx(plain_metrics[name].item(), rel=1e-5, abs=1e-6)


def test_auto_strategy_with_max_memory_offloads_and_matches(tiny_lm_dir, offload_dir):
    """device_map="auto" with a small CPU budget: accelerate's planner sends what does not fit
    to disk; logits and DAS gradients equal the unsharded model's."""
    lm_dir = tiny_lm_dir("llama")
    plain = load_lm(lm_dir)
    sharded = load_lm(lm_dir, "float32", "auto", None, {"cpu": "100KB"}, offload_dir)
    assert "disk" in sharded.hf_device_map.values()
    ids, mask, last = token_batch(plain.config.vocab_size)
    grads = []
    for model in (sharded, plain):
        torch.manual_seed(0)
        das = RotatedSpaceIntervention(HIDDEN)
        source = read_layers(model, [1], ids.flip(0), mask.flip(0))[1][torch.arange(3), last - 1]
        logits = logits_at(model, ids, mask, last, 1, last - 1, lambda h: das(h, source))
        logits.logsumexp(-1).sum().backward()
        grads.append((logits.detach(), [p.grad for p in das.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["reft_r1", "ssv", "loreft"])
def test_steering_on_an_offloaded_lm_equals_the_unsharded_one(tiny_lm_dir, tokenizer, offload_dir, method):
    """The steering modules' LM loss and its gradient (ReFT-r1 and SSV through `residual_hook`
    at every token, LoReFT through `lm_loss`) are the same with blocks on disk."""
    from lit_interventions.interventions.additive import ReFTR1Dictionary
    from lit_interventions.modules.steering import SteeringModule
    from lit_interventions.modules.steering_loreft import LoReFTModule
    from tests.test_axbench_methods import CONCEPTS, collate, make_rows

    lm_dir = tiny_lm_dir("llama")
    options = dict(device_map=split_map(load_lm(lm_dir), 1), offload_folder=offload_dir)
    batch = collate(make_rows(tokenizer)[::5])
    results = []
    for placement in (options, {}):
        torch.manual_seed(0)
        if method == "loreft":
            module = LoReFTModule(lm=lm_dir, layer=1, rank=2, **placement)
            loss = module.loss(batch)
        else:
            reft_r1 = {"reft_r1": ReFTR1Dictionary(topk=2)}
            module = SteeringModule(
                lm=lm_dir, layer=1, method=reft_r1.get(method, method), concept_names=CONCEPTS, **placement
            )
            if method == "ssv":
                torch.nn.init.normal_(module.dictionary.weight)
            lm_loss, l1 = module._steered_loss(batch)
            loss = lm_loss + 0.1 * l1
        loss.backward()
        assert is_dispatched(module.lm) == bool(placement)
        results.append(
            (loss.detach(), torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]))
        )
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert results[1][1].abs().max() > 0
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


def test_generation_from_an_offloaded_lm_equals_the_unsharded_one(tiny_lm_dir, tokenizer, offload_dir):
    """The steering evaluation's generation (and the judge's inputs) go to where the embeddings compute, not
    to `model.device` (the first parameter's: "meta" when it is offloaded)."""
    from lit_interventions.metrics.judge_local import generate_replies

    plain, _, _ = _sharded(tiny_lm_dir, "gemma3", offload_dir)  # tied: the embeddings are on disk too
    sharded = load_lm(tiny_lm_dir("gemma3"), "float32", split_map(plain, 0), offload_folder=offload_dir)
    assert sharded.device.type == "meta" and input_device(sharded) == torch.device("cpu")
    texts = ["The dog is here.", "The dog"]
    replies = generate_replies(sharded, tokenizer, texts, max_new_tokens=4)
    assert replies == generate_replies(plain, tokenizer, texts, max_new_tokens=4) and all(replies)


# --- 8-bit and 4-bit frozen weights (bitsandbytes) -----------------------------------------------


def _bitsandbytes_cpu() -> str | None:
    """Why bitsandbytes cannot quantize on this machine's CPU, or None."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'lit-interventions[quant]')"
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear8bitLt(64, 8, has_fp16_weights=False, threshold=0.0).to("cpu")
        layer(torch.ones(2, 64))
    except Exception as err:  # no CPU backend in this build
        return f"bitsandbytes has no working CPU backend here ({type(err).__name__}: {err})"
    return None


needs_bitsandbytes = pytest.mark.skipif(_bitsandbytes_cpu() is not None, reason=str(_bitsandbytes_cpu()))


def _dequantized(quantized, lm_dir):
    """A float copy of the LM holding the quantized LM's weights, dequantized."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    state = model.state_dict()
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state[f"{name}.weight"] = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):  # row-wise absmax: W = CB * SCB / 127
            state[f"{name}.weight"] = module.weight.data.float() * module.weight.SCB.float()[:, None] / 127
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


# 8-bit: bitsandbytes casts the activations to float16 for the int8 matmul (its CPU backend too)
@needs_bitsandbytes
@pytest.mark.parametrize("quantization,layer_type,tol", [("4bit", "Linear4bit", 1e-5), ("8bit", "Linear8bitLt", 2e-2)])
def test_quantized_lm_runs_the_intervention_path(tiny_lm_dir, quantization, layer_type, tol):
    """A quantized frozen LM gives the logits and the DAS gradient of a float LM holding its
    dequantized weights (4-bit: equal; 8-bit: within the float16 cast of the activations), after
    a forward without gradients (the read of f(s)) as in training."""
    lm_dir = tiny_lm_dir("llama")
    quantized = load_lm(lm_dir, "float32", "cpu", quantization)  # bitsandbytes' CPU backend, also on a GPU machine
    assert is_dispatched(quantized) and quantized.is_quantized
    assert type(decoder_layers(quantized)[0].mlp.up_proj).__name__ == layer_type
    reference = _dequantized(quantized, lm_dir)
    ids, mask, last = token_batch(reference.config.vocab_size)
    results = []
    for model in (quantized, reference):
        torch.manual_seed(0)
        das = RotatedSpaceIntervention(HIDDEN)
        source = read_layers(model, [0], ids.flip(0), mask.flip(0))[0][torch.arange(3), last - 1]  # no gradients
        logits = logits_at(model, ids, mask, last, 0, last - 1, lambda h: das(h, source))
        logits.pow(2).sum().backward()
        results.append((logits.detach(), torch.cat([p.grad.flatten() for p in das.parameters()])))
    (logits, grad), (expected_logits, expected_grad) = results
    torch.testing.assert_close(logits, expected_logits, rtol=tol, atol=tol)
    assert expected_grad.abs().max() > 0.1  # the gradient through the LM is not zero...
    torch.testing.assert_close(
        grad, expected_grad, rtol=tol, atol=tol * expected_grad.abs().max().item()
    )  # ...and right


@needs_bitsandbytes
def test_das_trains_on_a_4bit_lm(tiny_lm_dir):
    module, metrics = _train_das(tiny_lm_dir("llama"), True, quantization="4bit")
    assert module.lm.is_quantized and module.hparams.quantization == "4bit"
    assert not torch.allclose(module.intervention.basis.detach(), RotatedSpaceIntervention(HIDDEN).basis.detach())
    assert torch.isfinite(metrics["val/loss"])


# --- several GPUs: blocks on different devices (GPU-only) ---------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: blocks on cuda:0 and cuda:1")
def test_blocks_on_two_gpus_give_the_unsharded_numbers(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    plain = load_lm(lm_dir).to("cuda:0")
    device_map = {name: 0 if place == "cpu" else 1 for name, place in split_map(plain, 1).items()}
    sharded = load_lm(lm_dir, "float32", device_map)
    assert execution_device(decoder_layers(sharded)[2]) == torch.device("cuda:1")
    ids, mask, last = (t.to("cuda:0") for t in token_batch(plain.config.vocab_size))
    vocab = torch.tensor([[3, 4], [5, 6], [7, 8]], device="cuda:0")
    for layer in range(-1, LAYERS):
        torch.manual_seed(0)
        das = RotatedSpaceIntervention(HIDDEN).to("cuda:0")
        outs = []
        for model in (sharded, plain):
            das.zero_grad()
            start = read_layers(model, [layer], ids, mask)[layer]
            rows = torch.arange(3, device="cuda:0")
            source = read_layers(model, [layer], ids.flip(0), mask.flip(0))[layer][rows, last - 1]
            logits = logits_at(
                model, ids, mask, last, layer, last - 1, lambda h: das(h, source), start_states=start, vocab=vocab
            )
            assert logits.device == torch.device("cuda:0") and start.device == torch.device("cuda:0")
            logits.sum().backward()
            outs.append((logits.detach(), torch.cat([p.grad.flatten() for p in das.parameters()])))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_cli_places_the_lm_with_a_device_map(tmp_path, tiny_lm_dir, offload_dir, capsys):
    """`--model.device_map` / `--model.max_memory` / `--model.offload_folder` from the command
    line reach load_lm; a bad value is one error line before any work."""
    import train

    lm_dir = tiny_lm_dir("llama")
    args = [
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={lm_dir}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.train_pairs=4",
        "--data.eval_pairs=2",
        "--trainer.enable_progress_bar=false",
        "--model.device_map=auto",
        "--model.max_memory={cpu: 100KB}",
        f"--model.offload_folder={offload_dir}",
    ]
    cli = train.main(args=args)
    assert cli.model.hparams.max_memory == {"cpu": "100KB"} and "disk" in cli.model.lm.hf_device_map.values()
    assert torch.isfinite(cli.trainer.callback_metrics["val/odds"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main(args=args[:-3] + ["--model.quantization=2bit"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "quantization='2bit' is not supported; choose one of 8bit, 4bit" in err[-1]
