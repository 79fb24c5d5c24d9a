"""Cached training: starting from stored frozen states gives the same numbers as recomputing."""

import lightning as L
import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule

from lit_interventions.core.batch import PairBatch, Side, input_keys
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.forward import final_logits, logits_at, read_layers
from lit_interventions.core.stacked import stacked_hidden
from lit_interventions.interventions.rotation import FixedSubspaceIntervention
from lit_interventions.modules.interchange import InterchangeModule
from tests.conftest import ARCHS, HIDDEN, LAYERS
from tests.helpers import token_batch as _batch


def _pair(base: Side, source: Side | None = None) -> PairBatch:
    """A pair batch of these sides (the base as its own source when none is given), labels 0."""
    zeros = torch.zeros(len(base), dtype=torch.long)
    return PairBatch(base, base if source is None else source, zeros, zeros, zeros)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_starting_from_cached_states_matches_the_full_forward(tiny_lm, arch, padding_side):
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, padding_side=padding_side)
    src_ids, src_mask, _ = _batch(model.config.vocab_size, padding_side=padding_side, seed=1)
    positions = last - 1
    direction = FixedSubspaceIntervention(torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1))
    cache = ActivationCache(model, list(range(-1, LAYERS)))
    for layer in range(-1, LAYERS):
        start = cache.states(layer, Side.of(ids, mask))
        source = cache.at_site(layer, Side.of(src_ids, src_mask, positions))
        edit = lambda h: direction(h, source)  # noqa: E731
        full = logits_at(model, ids, mask, last, layer, positions, edit)
        torch.testing.assert_close(
            logits_at(model, ids, mask, last, layer, positions, edit, start_states=start), full, rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            logits_at(model, ids, mask, last, layer, start_states=start),
            logits_at(model, ids, mask, last),
            rtol=1e-4,
            atol=1e-5,
        )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_prefix_of_keys_and_values_matches_the_full_forward(tiny_lm, arch, padding_side):
    """Columns before the sites are not recomputed above the layer (their cached keys and values
    are read instead), and the logits are those of the full forward. Lengths up to 22 pass gemma3's
    sliding window of 16; the sites differ per row, so c is the earliest."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(22, 9, 14), padding_side=padding_side)
    src_ids, src_mask, _ = _batch(model.config.vocab_size, lengths=(10, 12, 22), padding_side=padding_side, seed=1)
    starts = (mask.shape[1] - mask.sum(1)).tolist() if padding_side == "left" else [0, 0, 0]
    sites = torch.tensor(starts) + torch.tensor([19, 4, 6])  # real positions 19, 4, 6
    direction = FixedSubspaceIntervention(torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1))
    batch = _pair(Side.of(ids, mask, sites), Side.of(src_ids, src_mask, sites))
    every_layer = ActivationCache(model, list(range(-1, LAYERS)))  # keys and values from the one forward
    every_layer.fill([batch], batch_size=2)
    for layer in range(-1, LAYERS - 1):
        one_layer = ActivationCache(model, [layer])  # the blocks above run on the first tokens only
        one_layer.fill([batch], batch_size=2)
        for cache in (every_layer, one_layer):
            c, above = cache.prefix(layer, batch.base)
            assert c == min(sites).item() and above.shape[:3] == (LAYERS - 1 - layer, 2, 3)
            start = cache.states(layer, batch.base)
            source = cache.at_site(layer, batch.source)
            edit = lambda h: direction(h, source)  # noqa: E731
            full = logits_at(model, ids, mask, last, layer, sites, edit)
            assert not torch.allclose(full, logits_at(model, ids, mask, last))  # the edit matters
            torch.testing.assert_close(
                logits_at(model, ids, mask, last, layer, sites, edit, start_states=start, prefix=(c, above)),
                full,
                rtol=1e-4,
                atol=1e-5,
            )
    assert every_layer.prefix(LAYERS - 1, batch.base) is None  # nothing above the last block


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_each_row_runs_from_its_own_site_in_a_stacked_forward(tiny_lm, arch, padding_side):
    """`row_prefix`: each row reads its own cached columns and runs only the columns from its
    site to its logits, whatever the other rows' sites; rows at different layers in one stacked
    forward give each row's full-forward logits. The third row has keys and values of its first
    3 tokens only: it runs from column 3, before its site (6). Lengths up to 22 pass the sliding
    window of 16."""
    model = tiny_lm(arch)
    ids, mask, last = _batch(model.config.vocab_size, lengths=(22, 9, 14), padding_side=padding_side)
    src_ids, src_mask, _ = _batch(model.config.vocab_size, lengths=(10, 12, 22), padding_side=padding_side, seed=1)
    starts = (mask.shape[1] - mask.sum(1)).tolist() if padding_side == "left" else [0, 0, 0]
    sites = torch.tensor(starts) + torch.tensor([19, 4, 6])
    cache = ActivationCache(model, list(range(-1, LAYERS)))
    cache.fill([_pair(Side.of(ids, mask, sites - torch.tensor([0, 0, 3])))], sides=("base",))
    base, layers = Side.of(ids, mask, sites), [1, -1, 0]
    prefix = cache.row_prefix(min(layers), base)
    assert prefix.ends == (torch.tensor(starts) + torch.tensor([19, 4, 3])).tolist()
    assert prefix.mask.sum(1).tolist() == [19, 4, 3] and prefix.mask[:, -1].tolist() == [1, 1, 1]  # right-aligned
    torch.manual_seed(0)
    direction = FixedSubspaceIntervention(torch.nn.functional.normalize(torch.randn(1, HIDDEN), dim=-1))
    source = cache.at_site(layers, Side.of(src_ids, src_mask, sites))
    edit = lambda h: direction(h, source)  # noqa: E731
    hidden = stacked_hidden(model, ids, mask, last, layers, sites, edit, cache.states(layers, base), prefix)
    for i, layer in enumerate(layers):
        full = logits_at(model, ids, mask, last, layer, sites, edit)[i]
        assert not torch.allclose(full, logits_at(model, ids, mask, last)[i])  # the edit matters
        torch.testing.assert_close(final_logits(model, hidden[i : i + 1])[0], full, rtol=1e-4, atol=1e-5)
    assert cache.row_prefix(LAYERS - 1, base) is None  # nothing above the last block
    assert cache.row_prefix(0, Side.of(ids, mask, torch.tensor(starts))) is None  # every site at its row's first token


def test_prefix_stops_at_the_earliest_site_and_at_what_is_cached(tiny_lm):
    model = tiny_lm("llama")
    ids, mask, _ = _batch(model.config.vocab_size, lengths=(8, 8))
    cache = ActivationCache(model, [0])
    batches = [_pair(Side.of(ids, mask, torch.tensor([5, 3])))]
    cache.fill(batches, sides=("base",))

    def at(*sites, flip=False):
        return Side.of(ids.flip(1) if flip else ids, mask, torch.tensor(sites))

    assert cache.prefix(0, at(5, 3))[0] == 3  # the earlier site
    assert cache.prefix(0, at(2, 7))[0] == 2  # a batch with an earlier site
    assert cache.prefix(0, at(7, 7))[0] == 3  # row 1 has keys and values before its site (3) only
    assert cache.prefix(0, at(0, 7)) is None  # a site at column 0: nothing before it
    assert cache.prefix(0, at(5, 5, flip=True)) is None  # never filled with a prefix
    last = ActivationCache(model, [LAYERS - 1])  # no block above: no prefix to keep, and a refill computes nothing
    assert last.fill(batches, sides=("base",)) == 2 and last.fill(batches, sides=("base",)) == 0
    assert cache.fill(batches, sides=("base",)) == 0
    assert cache.fill(batches, sides=("base",), prefix="all") == 2  # now every token of both, for a site anywhere
    assert cache.prefix(0, at(7, 7))[0] == 7 and cache.fill(batches, sides=("base",), prefix="site") == 0
    with pytest.raises(ValueError, match="prefix='some'"):
        cache.fill(batches, prefix="some")


def test_cache_computes_each_sentence_once(tiny_lm):
    model = tiny_lm("llama")
    ids, mask, _ = _batch(model.config.vocab_size, lengths=(5, 3, 5))
    cache = ActivationCache(model, [0, 2])
    first = cache.states(2, Side.of(ids, mask))
    assert len(cache) == 3
    reordered = cache.states(2, Side.of(ids.flip(0), mask.flip(0)))
    assert len(cache) == 3
    torch.testing.assert_close(reordered, first.flip(0))
    torch.testing.assert_close(first * mask[..., None], read_layers(model, [2], ids, mask)[2] * mask[..., None])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fill_computes_the_same_states_in_full_batches(tiny_lm, arch):
    """Prefilling in length-sorted, right-padded batches stores what a step would have computed."""
    model = tiny_lm(arch)
    ids, mask, _ = _batch(model.config.vocab_size, lengths=(6, 3, 5), padding_side="left")
    src_ids, src_mask, _ = _batch(model.config.vocab_size, lengths=(4, 6, 2), seed=1)
    batches = [_pair(Side.of(ids, mask), Side.of(src_ids, src_mask))]
    lazy, filled = ActivationCache(model, [0, 2]), ActivationCache(model, [0, 2])
    assert filled.fill(batches * 2, batch_size=4, prefix="none") == 6  # duplicates computed once, in chunks of 4
    assert filled.fill(batches, prefix="none") == 0 and len(filled) == 6
    for layer in (0, 2):
        for side in (batches[0].base, batches[0].source):
            torch.testing.assert_close(filled.states(layer, side), lazy.states(layer, side), rtol=1e-5, atol=1e-5)
    assert len(filled) == 6  # states() found everything already there


class _RecordLoss(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _train(lm_dir, cache: bool, layer: int):
    L.seed_everything(0)
    module = InterchangeModule(lm=lm_dir, layer=layer, cache=cache, lr=0.05)
    data = CausalGymDataModule(task="agr_sv_num_pp", lm=lm_dir, train_pairs=12, eval_pairs=4)
    record = _RecordLoss()
    trainer = L.Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, data)
    return record.losses, trainer.callback_metrics, module


@pytest.mark.parametrize("arch,layer", [("gpt_neox", 1), ("gemma3", 0), ("gpt2", 2)])
def test_cached_and_uncached_training_give_the_same_loss_curve(tiny_lm_dir, arch, layer):
    cached, cached_metrics, module = _train(tiny_lm_dir(arch), cache=True, layer=layer)
    uncached, uncached_metrics, _ = _train(tiny_lm_dir(arch), cache=False, layer=layer)
    assert len(cached) == 12 and len(module.activations) > 0  # 24 examples / batch 4, two epochs
    batch = next(iter(module.trainer.datamodule.train_dataloader()))
    if layer < LAYERS - 1:  # steps ran the upper blocks from the sites on only
        assert module._prefix(batch)[0] > 0
    else:  # the last block: only the LM head is left above the site
        assert module._prefix(batch) is None
    assert cached == pytest.approx(uncached, rel=1e-4, abs=1e-5)
    assert cached[0] != pytest.approx(cached[-1])  # training moved something
    for name in ("val/odds", "val/iia"):
        assert cached_metrics[name].item() == pytest.approx(uncached_metrics[name].item(), rel=1e-4, abs=1e-5)


def test_the_cache_keys_of_a_side_are_its_unpadded_sentences(tiny_lm_dir):
    """The keys the cache finds inputs by are derived from the batch: each row's tokens without
    padding (left padding here) and where they start; they follow the rows through `rows`, `cat`
    and the move to a device."""
    data = CausalGymDataModule(
        task="agr_sv_num_pp", lm=tiny_lm_dir("llama"), train_pairs=6, eval_pairs=2, padding_side="left"
    )
    data.setup("fit")
    examples = data.splits["train"][:4]
    batch = next(iter(data.loader("train", 4)))
    for name in ("base", "source"):
        side = batch.side(name)
        sentences = [tuple(getattr(e, f"{name}_ids")) for e in examples]
        width = max(map(len, sentences))
        assert side.keys == (sentences, [width - len(s) for s in sentences])
        moved = batch.to("cpu").side(name)
        assert moved.keys == side.keys and moved.sites == side.pos.tolist()
        picked = batch.rows([2, 0]).side(name)
        assert picked.keys == input_keys(picked.input_ids, picked.attention_mask)
        joined = PairBatch.cat([batch.rows([2]), batch.rows([0, 1])], "left").side(name)
        assert joined.keys == input_keys(joined.input_ids, joined.attention_mask)
        assert joined.sites == joined.pos.tolist()


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_cached_training_step_reads_nothing_back_from_the_device(tiny_lm_dir, arch, monkeypatch):
    """On a GPU, reading a tensor's value on the host waits for the device. The step's host-side
    facts (sentence keys, site columns) are read from the batch on the host when Lightning moves it
    to the device (`PairBatch.to`), so neither our code nor the transformers forward reads a tensor
    back during the step, forward or backward. (This sees the Python-level reads; it is the CPU
    stand-in for CUDA's sync debug mode.)"""
    lm = tiny_lm_dir(arch)
    data = CausalGymDataModule(task="agr_sv_num_pp", lm=lm, train_pairs=8, eval_pairs=4)
    data.setup("fit")
    module = InterchangeModule(lm=lm, layer=1)
    module.prefill(data.train_dataloader())
    batch = module.transfer_batch_to_device(next(iter(data.train_dataloader())), module.device, 0)
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)  # Lightning's logging, outside the step
    reads = []

    def recorded(name, method):
        def read(self, *args, **kwargs):
            reads.append(name)
            return method(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recorded(name, getattr(torch.Tensor, name)))
    module.training_step(batch, 0).backward()
    monkeypatch.undo()
    assert reads == []
    assert module._prefix(batch) is not None  # the step took the fastest path (cached states and prefix)
    assert module.intervention.rotate.parametrizations.weight.original.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_keys_values_below_asked_after_the_states_run_the_blocks_below_only(tiny_lm, arch, monkeypatch):
    """A refill that asks for the bases' keys and values in blocks 0..lowest, their states cached
    already, runs a forward that stops at the lowest layer and keeps the states and prefix it has;
    what it stores equals a first fill that asked for them."""
    model = tiny_lm(arch)
    ids, mask, _ = _batch(model.config.vocab_size, lengths=(6, 3, 5), padding_side="left")
    starts = (mask.shape[1] - mask.sum(1)).tolist()
    batches = [_pair(Side.of(ids, mask, torch.tensor(starts) + torch.tensor([4, 2, 3])))]
    later, at_once = ActivationCache(model, [1, 2]), ActivationCache(model, [1, 2])
    assert later.fill(batches, sides=("base",)) == 3 and later.keys_values_below(1, batches[0].base) is None
    states, prefixes = dict(later._states), dict(later._prefix)
    calls = []
    monkeypatch.setattr(later, "_compute", lambda *args, **kwargs: calls.append(args))
    assert later.fill(batches, sides=("base",), below=True) == 3 and calls == []  # no full forward
    assert later.fill(batches, sides=("base",), below=True) == 0  # kept: nothing to run
    assert all(later._states[key] is states[key] and later._prefix[key] is prefixes[key] for key in states)
    assert at_once.fill(batches, sides=("base",), below=True) == 3
    kept = later.keys_values_below(1, batches[0].base)
    assert kept.shape[:3] == (2, 2, 3)  # blocks 0 and 1, keys and values, 3 rows
    torch.testing.assert_close(kept, at_once.keys_values_below(1, batches[0].base), rtol=1e-5, atol=1e-6)
    assert kept.abs().sum() > 0 and later.keys_values_below(2, batches[0].base) is None  # only the lowest layer's
