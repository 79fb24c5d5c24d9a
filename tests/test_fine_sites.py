"""The fine sites: the residual stream entering a block, attention heads (their output before the
output projection, their query, key and value), and the MLP's hidden units. Each is found
generically on every tiny architecture (OPT's MLP is inline), checked against the real module
named by hand, read and written back unchanged, and trained with DAS and fitted with DiffMean by
`train.py fit`."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_interventions.artifacts.hub import read_config
from lit_interventions.artifacts.intervention_files import load_pretrained, save_pretrained
from lit_interventions.core.blocks import HEAD_COMPONENTS, head_counts, site_width
from lit_interventions.core.forward import logits_at, position_ids, read_layers, read_site
from lit_interventions.core.parts import BLOCKS, PER_HEAD, fused_layout
from lit_interventions.core.positions import encode_text
from lit_interventions.core.sites import Site
from lit_interventions.export.cli import main as export_main
from lit_interventions.inference.apply import apply
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.modules.interchange import InterchangeModule
from tests.conftest import ARCHS, HIDDEN, LAYERS
from tests.helpers import token_batch

FINE_ARCHS = [*ARCHS, "opt"]
FINE = ["block_input", "attention_head", "query", "key", "value", "mlp_neuron"]
# the modules named by hand: blocks, attention, its output projection, q/k/v (or the fused one), MLP down projection
NAMES = {
    "llama": ("model.layers", "self_attn", "o_proj", ("q_proj", "k_proj", "v_proj"), "mlp.down_proj"),
    "gemma2": ("model.layers", "self_attn", "o_proj", ("q_proj", "k_proj", "v_proj"), "mlp.down_proj"),
    "gemma3": ("model.layers", "self_attn", "o_proj", ("q_proj", "k_proj", "v_proj"), "mlp.down_proj"),
    "opt": ("model.decoder.layers", "self_attn", "out_proj", ("q_proj", "k_proj", "v_proj"), "fc2"),
    "gpt2": ("transformer.h", "attn", "c_proj", "c_attn", "mlp.c_proj"),
    "gpt_neox": ("gpt_neox.layers", "attention", "dense", "query_key_value", "mlp.dense_4h_to_h"),
}


def _head(component):
    return 1 if component in HEAD_COMPONENTS else None


def _by_hand(model, arch, layer, component, head, ids, mask):
    """The state of `component` at every position, (batch, seq, d), from hooks on the modules named
    by hand, split into heads as each architecture's modeling code does."""
    blocks, attention, out_proj, qkv, down = NAMES[arch]
    block = model.get_submodule(blocks)[layer]
    n_heads, n_kv, hd = head_counts(model.config)
    module, side = {
        "block_input": (block, "input"),
        "attention_head": (block.get_submodule(f"{attention}.{out_proj}"), "input"),
        "mlp_neuron": (block.get_submodule(down), "input"),
    }.get(component, (None, "output"))
    if module is None:
        name = qkv if isinstance(qkv, str) else qkv[("query", "key", "value").index(component)]
        module = block.get_submodule(f"{attention}.{name}")
    seen = {}

    def on_input(module, args, kwargs):  # returns None: the input is kept
        seen["h"] = args[0] if args else kwargs["hidden_states"]

    def on_output(module, args, output):
        seen["h"] = output

    if side == "input":
        handle = module.register_forward_pre_hook(on_input, with_kwargs=True)
    else:
        handle = module.register_forward_hook(on_output)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    handle.remove()
    h = seen["h"].reshape(*ids.shape, -1)  # OPT's fc2 sees (batch · seq, d)
    part = ("query", "key", "value").index(component) if component in ("query", "key", "value") else None
    if component == "attention_head" or (part is not None and not isinstance(qkv, str)):
        return h.view(*ids.shape, -1, hd)[:, :, head]
    if arch == "gpt_neox" and part is not None:  # GPTNeoXAttention: view(..., heads, 3 * head_dim), chunk(3)
        return h.view(*ids.shape, n_heads, 3 * hd)[:, :, head, part * hd : (part + 1) * hd]
    if part is not None:  # GPT2Attention: c_attn(...).split(n_embd, dim=2), then the heads
        return h.split(HIDDEN, dim=-1)[part].view(*ids.shape, n_heads, hd)[:, :, head]
    return h


@pytest.mark.parametrize("arch", FINE_ARCHS)
@pytest.mark.parametrize("component", FINE)
def test_read_site_equals_the_real_module_split_by_hand(tiny_lm, arch, component):
    model = tiny_lm(arch)
    ids, mask, last = token_batch(model.config.vocab_size, padding_side="left")
    head = _head(component)
    for layer in range(LAYERS):
        expected = _by_hand(model, arch, layer, component, head, ids, mask)  # (batch, seq, d)
        for positions in (last, last - 1):
            got = read_site(model, layer, ids, mask, positions, component=component, head=head)
            assert got.shape == (3, site_width(model.config, component, head))
            torch.testing.assert_close(got, expected[torch.arange(3), positions], rtol=0, atol=0)


@pytest.mark.parametrize("arch", FINE_ARCHS)
@pytest.mark.parametrize("component", [*FINE, "mlp_output"])
def test_writing_back_the_read_state_changes_nothing_and_a_source_state_does(tiny_lm, arch, component):
    model = tiny_lm(arch)
    ids, mask, last = token_batch(model.config.vocab_size, lengths=(5, 6, 4))
    src_ids, src_mask, _ = token_batch(model.config.vocab_size, lengths=(5, 6, 4), seed=1)
    positions, layer, head = last - 1, 1, _head(component)
    clean = logits_at(model, ids, mask, last)
    own = read_site(model, layer, ids, mask, positions, component=component, head=head)
    written = logits_at(model, ids, mask, last, layer, positions, lambda h: own, component=component, head=head)
    torch.testing.assert_close(written, clean, rtol=0, atol=0)
    source = read_site(model, layer, src_ids, src_mask, positions, component=component, head=head)
    swapped = logits_at(model, ids, mask, last, layer, positions, lambda h: source, component=component, head=head)
    assert not torch.equal(swapped, clean)


@pytest.mark.parametrize("arch", FINE_ARCHS)
def test_block_input_is_the_previous_block_output(tiny_lm, arch):
    model = tiny_lm(arch)
    ids, mask, _ = token_batch(model.config.vocab_size)
    outputs = read_layers(model, list(range(-1, LAYERS)), ids, mask)
    for layer in range(LAYERS):
        inputs = read_layers(model, [layer], ids, mask, component="block_input")[layer]
        torch.testing.assert_close(inputs, outputs[layer - 1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2", "opt"])  # no norm after the sub-blocks
def test_block_output_is_its_input_plus_attention_and_mlp_outputs(tiny_lm, arch):
    """The residual stream adds the attention and MLP outputs (GPT-NeoX in parallel): OPT's inline
    MLP output (fc2) is what its block adds."""
    model = tiny_lm(arch)
    ids, mask, _ = token_batch(model.config.vocab_size)
    for layer in range(LAYERS):
        parts = [
            read_layers(model, [layer], ids, mask, component=c)[layer]
            for c in ("block_input", "attention_output", "mlp_output")
        ]
        output = read_layers(model, [layer], ids, mask)[layer]
        torch.testing.assert_close(sum(parts), output, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", FINE_ARCHS)
def test_the_first_position_attends_to_itself_so_each_head_outputs_its_value(tiny_lm, arch):
    """At position 0 a head's output is its value; under grouped-query attention (Llama, Gemma: 4
    query heads, 2 key/value heads) query head h reads key/value head h // 2."""
    model = tiny_lm(arch)
    ids, mask, _ = token_batch(model.config.vocab_size)
    n_heads, n_kv, _ = head_counts(model.config)
    first = torch.zeros(3, dtype=torch.long)
    for head in range(n_heads):
        output = read_site(model, 1, ids, mask, first, component="attention_head", head=head)
        value = read_site(model, 1, ids, mask, first, component="value", head=head // (n_heads // n_kv))
        torch.testing.assert_close(output, value, rtol=0, atol=0)
    both = read_site(model, 1, ids, mask, first, component="attention_head", head=[2, 0])
    apart = [read_site(model, 1, ids, mask, first, component="attention_head", head=h) for h in (2, 0)]
    torch.testing.assert_close(both, torch.cat(apart, -1), rtol=0, atol=0)  # in the order given


def test_fused_projections_are_split_in_the_layout_the_model_uses(tiny_lm):
    neox, gpt2 = tiny_lm("gpt_neox"), tiny_lm("gpt2")
    attention = neox.gpt_neox.layers[0].attention
    assert fused_layout(neox, attention.query_key_value, attention.dense) == PER_HEAD
    assert fused_layout(gpt2, gpt2.transformer.h[0].attn.c_attn, gpt2.transformer.h[0].attn.c_proj) == BLOCKS


def test_a_fused_projection_of_another_layout_is_refused(tiny_lm_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir("gpt2")).eval()  # not the shared one
    attn = model.transformer.h[0].attn
    attn.c_proj.register_forward_pre_hook(lambda m, args: (args[0].roll(1, -1),))  # values seen out of place
    with pytest.raises(ValueError, match=r"Cannot split the fused query/key/value projection of GPT2LMHeadModel"):
        fused_layout(model, attn.c_attn, attn.c_proj)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"component": "heads"},
            r"component='heads' is not one of: block_output, attention_output, mlp_output, block_input, attention_head, query, key, value, mlp_neuron",
        ),
        (
            {"component": "mlp_output", "head": 1},
            r"head=1 is given for component='mlp_output', which has no heads: head is only for attention_head, query, key, value",
        ),
        ({"component": "attention_head"}, r"component='attention_head' needs head: a head index or a list of them"),
        ({"component": "query", "head": [1, 1]}, r"head=\[1, 1\] names a head twice"),
        (
            {"component": "value", "head": -1},
            r"head=-1 must be a head index \(an int >= 0\) or a non-empty list of them",
        ),
        ({"component": "key", "head": []}, r"head=\[\] must be a head index"),
    ],
)
def test_site_names_the_bad_component_or_head(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Site(1, **kwargs)


@pytest.mark.parametrize(
    "component,head,message",
    [
        (
            "attention_head",
            4,
            r"head=4 is out of range for component='attention_head': this model has 4 query heads, so a head must be in 0..3",
        ),
        (
            "key",
            [0, 2],
            r"head=\[0, 2\] is out of range for component='key': this model has 2 key/value heads, so a head must be in 0..1",
        ),
        ("block_input", 0, r"head=0 is given for component='block_input', which has no heads"),
    ],
)
def test_the_module_refuses_a_head_the_model_lacks_before_loading_it(
    tiny_lm_dir, monkeypatch, component, head, message
):
    import lit_interventions.modules.site as site_module

    monkeypatch.setattr(site_module, "load_lm", lambda *a, **k: pytest.fail("the LM loaded"))
    with pytest.raises(ValueError, match=message):
        InterchangeModule(lm=tiny_lm_dir("llama"), layer=1, component=component, head=head)


def test_head_sites_run_the_full_forward_and_refuse_the_cached_path(tiny_lm, tiny_lm_dir):
    module = InterchangeModule(lm=tiny_lm_dir("llama"), layer=1, component="attention_head", head=[0, 3], cache=True)
    assert not module.hparams.cache and module.activations is None  # the cache serves block_output only
    assert module.intervention.basis.shape == (1, 16)  # head_dim 8 × 2 heads
    model = tiny_lm("llama")
    ids, mask, last = token_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="start_states need component='block_output', not 'block_input'"):
        logits_at(
            model,
            ids,
            mask,
            last,
            1,
            last,
            lambda h: h,
            start_states=torch.zeros(3, ids.shape[1], HIDDEN),
            component="block_input",
        )


def _fit(tmp_path, lm, *extra):
    import train

    return train.main(
        args=[
            "fit",
            "--config",
            "configs/das_mlp.yaml",
            f"--model.lm={lm}",
            "--model.layer=1",
            "--model.component=attention_head",
            "--model.head=1",
            "--data.train_pairs=16",
            "--data.eval_pairs=8",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.max_epochs=1",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "method",
    [
        [],
        [
            "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
            "--model.intervention.method=diffmean",
        ],
    ],
    ids=["das", "diffmean"],
)
def test_fit_at_one_head_trains_das_and_fits_diffmean(tmp_path, tiny_lm_dir, method):
    cli = _fit(tmp_path, tiny_lm_dir("gpt_neox"), *method)
    module = cli.model
    assert (module.component, module.head, module.hparams.cache) == ("attention_head", 1, False)
    assert module.intervention.basis.shape == (1, 8)  # one head of head_dim 8
    assert Path(cli.trainer.log_dir).parent.name == "layer1_attention_head_h1"
    assert {"val/odds", "val/iia"} <= set(cli.trainer.callback_metrics)
    loaded, card = load_pretrained(cli.trainer.log_dir), read_config(cli.trainer.log_dir)  # the card records the head
    assert (card["component"], card["head"], card["layer"]) == ("attention_head", 1, 1)
    torch.testing.assert_close(loaded.basis, module.intervention.basis.detach())
    # the odds the callback logged are those of the intervention at head 1, recomputed here
    scored = module.score(cli.datamodule.loader("dev", 16))
    assert cli.trainer.callback_metrics["val/odds"].item() == pytest.approx(scored["odds"], abs=1e-4)


@pytest.mark.parametrize("component,head", [("attention_head", 1), ("value", [1, 0]), ("mlp_neuron", None)])
def test_an_artifact_trained_at_a_fine_site_applies_there(component, head, tmp_path, tiny_lm, tiny_lm_dir, tokenizer):
    """`apply` reads the source and writes the base at the site the card records, head included:
    the same logits as the intervention placed there by hand."""
    model = tiny_lm("llama")
    width = Site(1, component, head=head).width(model.config)
    das = RotatedSpaceIntervention(width, 2)
    card = {"model": tiny_lm_dir("llama"), "layer": 1, "component": component, "head": head}
    save_pretrained(tmp_path, das, card)
    base, source = encode_text(tokenizer, "The dog is here"), encode_text(tokenizer, "The keys are there")
    with apply(model, str(tmp_path), tokenizer=tokenizer, source="The keys are there") as edited:
        got = edited(**base).logits[:, -1]
    last = lambda enc: enc["attention_mask"].sum(-1) - 1  # noqa: E731
    src = read_site(model, 1, source["input_ids"], source["attention_mask"], last(source), component, head)
    want = logits_at(
        model, base["input_ids"], base["attention_mask"], last(base), 1, last(base),
        lambda h: das(h, src), component=component, head=head,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(got, model(**base).logits[:, -1])
    wrong = {**card, "head": None} if head is not None else {**card, "component": "attention_output"}
    save_pretrained(tmp_path / "wrong", das, wrong)
    with pytest.raises(ValueError, match="needs|width|hidden size"):
        with apply(model, str(tmp_path / "wrong"), tokenizer=tokenizer, source="The keys are there"):
            pass


def test_export_refuses_a_fine_site_with_one_line(tmp_path, tiny_lm_dir, capsys):
    lm_dir = tiny_lm_dir("llama")
    card = {"model": lm_dir, "layer": 1, "component": "attention_head", "head": 1}
    save_pretrained(
        tmp_path / "das",
        RotatedSpaceIntervention(Site(1, "attention_head", head=1).width(AutoConfig.from_pretrained(lm_dir)), 2),
        card,
    )
    with pytest.raises(SystemExit) as exit_:
        export_main(["--artifact", str(tmp_path / "das"), "--to", "pyvene", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'das'} acts at attention_head (head 1); export writes sites at block_output, "
        "block_input, attention_output, mlp_output (apply it with lit_interventions.apply)\n"
    )
    assert not (tmp_path / "out").exists()
