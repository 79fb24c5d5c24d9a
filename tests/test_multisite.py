"""DAS at many sites (layer, region) trained together in one stacked loop equals training each
site alone: regions of one layer, and sites at different layers (rows entering the stack at
their own layer)."""

import lightning as L
import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule

from lit_interventions.core.batch import PairBatch
from lit_interventions.modules.interchange import InterchangeModule
from lit_interventions.modules.multisite import MultiSiteInterchangeModule

REGIONS = ["subject", "the", "object"]


def _trainer():
    return L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )


def _datas(lm_dir, padding_side="right", pairs=10):
    datas = {}
    for region in REGIONS:
        datas[region] = CausalGymDataModule(
            task="agr_sv_num_pp", lm=lm_dir, region=region, train_pairs=pairs, eval_pairs=2, padding_side=padding_side
        )
        datas[region].setup("fit")
    return datas


def _train_together(lm_dir, regions, datas, layer=1):
    module = MultiSiteInterchangeModule(
        lm=lm_dir, layer=layer, regions=regions, lr=0.05, seed=3, padding_side=datas[regions[0]].hparams.padding_side
    )
    _trainer().fit(module.attach(datas))
    return {region: intervention.basis.detach().clone() for (_, region), intervention in module.trained().items()}


def _train_sites(lm_dir, sites, datas, cache=True):
    module = MultiSiteInterchangeModule(
        lm=lm_dir, grid=sites, lr=0.05, seed=3, cache=cache, padding_side=datas[sites[0][1]].hparams.padding_side
    )
    _trainer().fit(module.attach(datas))
    return {site: intervention.basis.detach().clone() for site, intervention in module.trained().items()}, module


@pytest.mark.parametrize("arch,padding_side", [("llama", "right"), ("gemma3", "left")])
def test_regions_trained_together_equal_each_region_alone(tiny_lm_dir, arch, padding_side):
    lm_dir = tiny_lm_dir(arch)
    datas = _datas(lm_dir, padding_side)
    together = _train_together(lm_dir, REGIONS, datas)
    for region in REGIONS:
        alone = _train_together(lm_dir, [region], datas)[region]
        torch.testing.assert_close(together[region], alone, rtol=1e-4, atol=1e-5)
        # and alone equals the single-site module (train.py's) with the same seed and batch order
        L.seed_everything(3)
        single = InterchangeModule(lm=lm_dir, layer=1, region=region, lr=0.05)
        _trainer().fit(single, train_dataloaders=datas[region].loader("train", 4, shuffle=True, seed=3))
        torch.testing.assert_close(single.intervention.basis.detach(), alone, rtol=1e-4, atol=1e-5)
    initial = MultiSiteInterchangeModule(lm=lm_dir, layer=1, regions=REGIONS, seed=3).trained()
    assert not torch.allclose(initial[(1, "subject")].basis, together["subject"])  # training moved it
    assert not torch.allclose(together["subject"], together["object"])  # each region its own subspace


def test_stacked_batch_keeps_each_row(tiny_lm_dir):
    datas = _datas(tiny_lm_dir("llama"), padding_side="left", pairs=4)
    parts = [next(iter(datas[region].loader("train", 3))) for region in ("subject", "object")]
    # the first batch's bases and the second's sources get one more padding column: the others are narrower
    for part, side in ((parts[0], "base"), (parts[1], "source")):
        states = part.side(side)
        setattr(part, side, states.padded(states.input_ids.shape[1] + 1, "left"))
    stacked = PairBatch.cat(parts, "left")
    for side, narrow, wide in (("base", 1, 0), ("source", 0, 1)):
        joined, narrower, wider = stacked.side(side), parts[narrow].side(side), parts[wide].side(side)
        assert joined.input_ids.shape == (6, wider.input_ids.shape[1])
        # the narrower batch is padded on the left: its positions shift by one and still point at the same tokens
        rows = torch.arange(3) + 3 * narrow
        torch.testing.assert_close(
            joined.input_ids[rows, joined.pos[rows]], narrower.input_ids[torch.arange(3), narrower.pos]
        )
        for region in joined.regions:
            torch.testing.assert_close(
                joined.input_ids[rows, joined.regions[region][rows]],
                narrower.input_ids[torch.arange(3), narrower.regions[region]],
            )
        assert joined.keys[0][3 * narrow : 3 * narrow + 3] == narrower.keys[0]
        assert joined.keys[1][3 * narrow] == narrower.keys[1][0] + 1
        assert joined.sites == joined.pos.tolist()
    assert torch.equal(stacked.target, torch.cat([part.target for part in parts]))


def test_no_regions_is_an_error(tiny_lm_dir):
    with pytest.raises(ValueError, match="regions is empty"):
        MultiSiteInterchangeModule(lm=tiny_lm_dir("llama"), layer=1, regions=[])
    module = MultiSiteInterchangeModule(lm=tiny_lm_dir("llama"), layer=1, regions=["subject", "verb"])
    with pytest.raises(ValueError, match=r"no data for regions \['verb'\]"):
        module.attach(_datas(tiny_lm_dir("llama"), pairs=2))


def test_ddp_is_refused_with_what_to_do_instead(tiny_lm_dir):
    from types import SimpleNamespace

    module = MultiSiteInterchangeModule(lm=tiny_lm_dir("llama"), layer=1, regions=["subject"])
    module._trainer = SimpleNamespace(world_size=1)
    module.setup("fit")
    module._trainer = SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match="not in 2 DDP processes: for several GPUs, start the sweep under torchrun"):
        module.setup("fit")


def _gemma3_mixed(tmp_path, tokenizer):
    """A tiny Gemma 3 whose blocks alternate sliding-window (of 3 tokens, shorter than the
    sentences) and global attention, each kind with its own rotary embeddings."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    config = tiny_config("gemma3", len(tokenizer))
    config.num_hidden_layers, config.sliding_window = 4, 3
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma3")
    tokenizer.save_pretrained(tmp_path / "gemma3")
    return str(tmp_path / "gemma3")


SITES = [(2, "subject"), (0, "object"), (-1, "the"), (2, "object"), (0, "subject")]  # 3 layers, 3 regions


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "gpt_neox"])
def test_sites_at_different_layers_trained_together_equal_each_site_alone(tiny_lm_dir, tmp_path, tokenizer, arch):
    lm_dir = _gemma3_mixed(tmp_path, tokenizer) if arch == "gemma3" else tiny_lm_dir(arch)
    datas = _datas(lm_dir, "left" if arch == "gemma3" else "right", pairs=6)
    together, module = _train_sites(lm_dir, SITES, datas)
    assert module._stacked is True  # one stacked forward per step, no fallback
    assert list(together) == sorted(SITES, key=lambda site: site[0])  # stacked in order of layer
    for layer, region in SITES:
        L.seed_everything(3)
        single = InterchangeModule(lm=lm_dir, layer=layer, region=region, lr=0.05)
        _trainer().fit(single, train_dataloaders=datas[region].loader("train", 4, shuffle=True, seed=3))
        torch.testing.assert_close(together[(layer, region)], single.intervention.basis.detach(), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(together[(2, "object")], together[(0, "object")])  # each site its own subspace


def test_per_layer_fallback_gives_the_same_subspaces(tiny_lm_dir, monkeypatch):
    """Without a cache, or on a model whose blocks refuse a subset of the rows (a warning), each
    layer's sites run in their own forward: the same subspaces."""
    from lit_interventions.modules import multisite

    lm_dir = tiny_lm_dir("llama")
    datas = _datas(lm_dir, pairs=4)
    stacked, _ = _train_sites(lm_dir, SITES[:3], datas)
    uncached, _ = _train_sites(lm_dir, SITES[:3], datas, cache=False)

    def refuses(*args, **kwargs):
        raise TypeError("forward() got an unexpected keyword argument")

    monkeypatch.setattr(multisite, "stacked_hidden", refuses)
    with pytest.warns(UserWarning, match=r"the stacked forward failed on LlamaForCausalLM \(TypeError: forward"):
        per_layer, module = _train_sites(lm_dir, SITES[:3], datas)
    assert module._stacked is False
    for site in SITES[:3]:
        torch.testing.assert_close(per_layer[site], stacked[site], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(uncached[site], stacked[site], rtol=1e-4, atol=1e-5)


def test_sites_are_checked_before_any_work(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match=r"layer=3 is out of range: this model has 3 layers"):
        MultiSiteInterchangeModule(lm=lm_dir, grid=[(0, "subject"), (3, "subject")])
    with pytest.raises(ValueError, match=r"names a site twice"):
        MultiSiteInterchangeModule(lm=lm_dir, grid=[(0, "subject"), (0, "subject")])
    with pytest.raises(ValueError, match=r"or layer= and regions=, not both"):
        MultiSiteInterchangeModule(lm=lm_dir, grid=[(0, "subject")], regions=["object"])


def test_a_region_named_by_a_dotted_template_variable_trains_as_any_other(tiny_lm_dir):
    lm_dir = tiny_lm_dir("llama")  # published templates name regions `clause.verb`, `vp.verb`
    datas = _datas(lm_dir)
    dotted = _train_together(lm_dir, ["clause.verb"], {"clause.verb": datas["subject"]})["clause.verb"]
    torch.testing.assert_close(dotted, _train_together(lm_dir, ["subject"], datas)["subject"], rtol=0, atol=0)
