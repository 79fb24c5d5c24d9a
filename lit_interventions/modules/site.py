"""What every interchange objective shares: a frozen LM, one site (layer, token position per
example) and an intervention module mapping (f(b), f(s)) to f*, or f(b) alone to f* for a
source-free one (`capabilities.intervene`: no source forward runs for it).

A batch is a `PairBatch` (`core.batch`): a base and a source side, each with its token ids,
attention mask, site positions (`pos`) and last positions (`last`).
"""

from __future__ import annotations

import torch
from lightning import LightningModule

from lit_interventions.core.batch import PairBatch
from lit_interventions.core.blocks import BLOCK_OUTPUT, EMBEDDINGS, site_layer
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.forward import greedy_at, logits_at, read_site
from lit_interventions.core.lm import check_dtype, load_config, load_lm
from lit_interventions.core.sharding import LoadOptions, is_dispatched
from lit_interventions.interventions.capabilities import intervene, needs_source
from lit_interventions.modules.generation import answer_length, greedy_answers

LM_OPTIONS = ("device_map", "quantization", "max_memory", "offload_folder")  # hparams: `sharding.LoadOptions`


class FrozenLMModule(LightningModule):
    """A LightningModule around a frozen LM that is not a submodule: it is loaded on first use
    (from the `lm` and `dtype` hyperparameters, and the `LM_OPTIONS` a module takes), moved to
    the module's device, and never saved in a checkpoint or wrapped by DDP. Only the module's own
    parameters train.

    With a `device_map` (or `quantization`) the LM is spread over the devices by accelerate and
    is never moved: the intervention trains on the module's device, in its own dtype."""

    def __init__(self):
        super().__init__()
        self._frozen: dict[str, object] = {}  # the LM (and caches), kept out of state_dict and DDP

    @staticmethod
    def check_lm_options(device_map=None, quantization=None, max_memory=None, offload_folder=None) -> LoadOptions:
        """Validate the placement options in __init__, before any weights load (a one-line error
        naming the bad value and what is allowed)."""
        return LoadOptions(device_map, quantization, max_memory, offload_folder)

    @property
    def lm(self) -> torch.nn.Module:
        model = self._frozen.get("lm")
        if model is None:
            options = [self.hparams.get(name) for name in LM_OPTIONS]
            model = self._frozen["lm"] = load_lm(self.hparams.lm, self.hparams.dtype, *options)
        if not is_dispatched(model) and model.device != self.device:
            model.to(self.device)
        return model


class SiteModule(FrozenLMModule):
    """Base of the interchange modules. Subclasses set `self.intervention` and save `lm`, `layer`,
    `dtype` and `cache` as hyperparameters (call `self._check_site(lm, layer)` first)."""

    intervention: torch.nn.Module

    def _check_site(self, lm: str, layer: int | None, dtype: str = "float32") -> int:
        """The layer, defaulting to the middle one, checked against the config, and the dtype (no
        weights loaded)."""
        check_dtype(dtype)
        config = load_config(lm)
        layer = site_layer(config, layer)
        return layer

    @property
    def activations(self) -> ActivationCache | None:
        if not self.hparams.cache:
            return None
        if "cache" not in self._frozen:
            self._frozen["cache"] = ActivationCache(self.lm, [self.hparams.layer])
        return self._frozen["cache"]

    generates = False  # whether evaluation generates answers after the intervened prompt

    def prefill(self, loaders, chunk: int = 64, below: bool = False) -> None:
        """Fill the cache with every sentence of `loaders` (a loader, or a list or dict of them)
        in a few full batches before the loop starts. It reads each loader's dataset in order
        through its collate function, never its sampler, so the order the loop then draws (and
        every random generator) is the same as without a cache. `below`: also keep the bases'
        keys and values up to the layer, which generated answers read (`intervened_answers`)."""
        cache = self.activations
        if cache is None or loaders is None:
            return
        loaders = list(loaders.values()) if isinstance(loaders, dict) else loaders
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            data = loader.dataset
            cache.fill(
                (
                    loader.collate_fn([data[i] for i in range(start, min(start + chunk, len(data)))])
                    for start in range(0, len(data), chunk)
                ),
                below=below,
            )

    def on_train_start(self) -> None:
        self.prefill(self.trainer.train_dataloader)

    def on_validation_start(self) -> None:
        self.prefill(self.trainer.val_dataloaders, below=self.generates)

    def on_test_start(self) -> None:
        self.prefill(self.trainer.test_dataloaders, below=self.generates)

    def share_cache(self, cache: ActivationCache) -> None:
        """Use activations already computed (a sweep computes every layer once per dataset)."""
        if self.hparams.layer not in cache.layers:
            raise ValueError(f"the cache holds layers {cache.layers}, not layer {self.hparams.layer}")
        self._frozen["cache"] = cache

    @property
    def component(self) -> str:
        """Where in the block the site is (`blocks.COMPONENTS`); the residual stream by default."""
        return self.hparams.get("component") or BLOCK_OUTPUT

    @property
    def head(self) -> int | list[int] | None:
        """The head or heads of a head component (`blocks.HEAD_COMPONENTS`); None for the others."""
        return self.hparams.get("head")

    def _states(self, batch: PairBatch) -> torch.Tensor | None:
        """The cached residual stream at the layer of the batch's bases (None: no cache)."""
        cache = self.activations
        return None if cache is None else cache.states(self.hparams.layer, batch.base)

    def _prefix(self, batch: PairBatch) -> tuple[int, torch.Tensor] | None:
        """The cached keys and values above the layer of the base's columns before every site."""
        cache = self.activations
        return None if cache is None else cache.prefix(self.hparams.layer, batch.base)

    def site_representation(self, batch: PairBatch, side: str = "source") -> torch.Tensor:
        """f(x) at the site of one side ("base" or "source") of the batch, (batch, d)."""
        cache, states = self.activations, batch.side(side)
        if cache is None:
            return read_site(
                self.lm,
                self.hparams.layer,
                states.input_ids,
                states.attention_mask,
                states.pos,
                component=self.component,
                head=self.head,
            )
        return cache.at_site(self.hparams.layer, states)

    def source_at_site(self, batch: PairBatch) -> torch.Tensor | None:
        """f(s) at the site, (batch, d), where the intervention reads it; None for a source-free
        one (`needs_source`), which runs no source forward."""
        return self.site_representation(batch, "source") if needs_source(self.intervention) else None

    def intervened_logits(self, batch: PairBatch, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of p_{f←f*}(· | b, s) at the base's last token, (batch, vocab); only of the
        token ids `vocab` (batch, n) if given."""
        source = self.source_at_site(batch)
        base = batch.base
        return logits_at(
            self.lm,
            base.input_ids,
            base.attention_mask,
            base.last,
            layer=self.hparams.layer,
            site_positions=base.pos,
            intervention=lambda states: intervene(self.intervention, states, source),
            start_states=self._states(batch),
            vocab=vocab,
            prefix=self._prefix(batch),
            component=self.component,
            head=self.head,
        )

    def _answers_from_cache(self) -> bool:
        """Whether `intervened_answers` runs from the activation cache: one block-output site above
        the embeddings, the cache on."""
        return self.activations is not None and self.component == BLOCK_OUTPUT and self.hparams.layer != EMBEDDINGS

    def intervened_answers(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(`intervened_logits`, the greedy answer after it, (batch, n): `generation.greedy_answers`).
        With the activation cache at a block-output site above the embeddings, the answer's later
        tokens run one column each, the prompt's keys and values kept (`greedy_at`)."""
        n, cache = answer_length(batch), self.activations
        if n == 1 or not self._answers_from_cache():
            first = self.intervened_logits(batch)
            return first, greedy_answers(self, batch, first, n)
        source, base = self.source_at_site(batch), batch.base
        return greedy_at(
            self.lm,
            base.input_ids,
            base.attention_mask,
            base.last,
            n,
            self.hparams.layer,
            base.pos,
            lambda states: intervene(self.intervention, states, source),
            self._states(batch),
            self._prefix(batch),
            cache.keys_values_below(self.hparams.layer, base),
        )

    def clean_logits(self, batch: PairBatch, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the unintervened model p(· | b) at the base's last token, (batch, vocab); only
        of the token ids `vocab` (batch, n) if given."""
        return logits_at(
            self.lm,
            batch.base.input_ids,
            batch.base.attention_mask,
            batch.base.last,
            layer=self.hparams.layer,
            start_states=self._states(batch),
            vocab=vocab,
            prefix=self._prefix(batch),
        )
