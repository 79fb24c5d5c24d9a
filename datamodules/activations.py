"""Activations of a frozen LM at one site, as a dataset of vectors (to train an SAE on).

`ActivationsDataModule` serves a given (N, d) tensor; `RavelActivationsDataModule` reads it once
from RAVEL prompts: the residual stream after block `layer` at the last token of the entity
(`positions="entity"`, the RAVEL intervention site) or at every token of the prompt
(`positions="all"`, BOS excluded). The site is found as `RavelDataModule` finds it (BOS
prefix, the token that holds the entity's last character). Prompts are attribute templates and Wikipedia sentences filled with the
entities of one split (`split="train"` by default, so the SAE never sees held-out entities).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from lightning import LightningDataModule
from lit_interventions.datamodules.ravel_files import encode_prompt, load_ravel
from torch.utils.data import DataLoader, TensorDataset

from lit_interventions.core.blocks import check_layer
from lit_interventions.core.forward import read_layers
from lit_interventions.core.lm import DEFAULT_LM, hidden_size, load_config, load_lm, load_tokenizer, num_layers
from lit_interventions.core.loaders import split_loader
from lit_interventions.core.surprisal import bos_prefix

POSITIONS = ("entity", "all")


class ActivationsDataModule(LightningDataModule):
    """Batches of site activations (B, d). After setup: `mean` (d,) of the train part and `scale`,
    the factor that makes the mean squared norm of the centred train activations equal to d."""

    def __init__(
        self, activations: torch.Tensor | None = None, val_fraction: float = 0.1, batch_size: int = 256, seed: int = 0
    ):
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
        self.val_fraction, self.batch_size, self.seed = val_fraction, batch_size, seed
        self._given = activations
        self.train_set = self.val_set = None

    @property
    def hidden_size(self) -> int:
        return self._given.shape[1]

    def read_activations(self) -> torch.Tensor:
        return self._given

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        acts = torch.as_tensor(self.read_activations(), dtype=torch.float32)  # (N, d)
        if acts.ndim != 2 or len(acts) < 2:
            raise ValueError(f"activations must be (N ≥ 2, d); got shape {tuple(acts.shape)}")
        order = torch.randperm(len(acts), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(round(self.val_fraction * len(acts)))
        train, val = acts[order[n_val:]], acts[order[:n_val]]
        self.mean = train.mean(0)
        spread = (train - self.mean).pow(2).sum(-1).mean().sqrt()
        self.scale = float(math.sqrt(train.shape[1]) / spread.clamp_min(1e-12))
        self.train_set, self.val_set = TensorDataset(train), TensorDataset(val)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return split_loader(self.val_set, self.batch_size, None, self.trainer) if len(self.val_set) else []


def entity_prompts(data, split: str, wikipedia: bool) -> list[tuple[str, str]]:
    """(template with %s, entity) for every template × entity of `split` (+ Wikipedia sentences)."""
    entities = sorted(e for e, s in data.entity_split.items() if s == split and e in data.entities)
    templates = sorted({t for ts in data.prompts.values() for t in ts})
    pairs = [(t, e) for t in templates for e in entities]
    if wikipedia:
        chosen = set(entities)
        pairs += [(prompt, entity) for prompt, entity, _ in data.wikipedia if entity in chosen]
    return pairs


class RavelActivationsDataModule(ActivationsDataModule):
    """Site activations of `lm` at `layer` on RAVEL prompts (see the module docstring).

    max_prompts: how many (template, entity) prompts to sample (None: all of them).
    read_batch_size: prompts per LM forward; max_length: prompts are cut to this many tokens
    (a prompt whose entity lies beyond is dropped).
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int = 9,
        ravel_dir: str | None = None,
        entity_type: str = "city",
        split: str = "train",
        positions: str = "entity",
        wikipedia: bool = True,
        max_prompts: int | None = 4000,
        val_fraction: float = 0.1,
        batch_size: int = 256,
        read_batch_size: int = 32,
        max_length: int = 64,
        dtype: str = "float32",
        seed: int = 0,
    ):
        super().__init__(None, val_fraction, batch_size, seed)
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}; choose one of {POSITIONS}")
        if split not in ("train", "val", "test"):
            raise ValueError(f"split={split!r}; choose train, val or test")
        if max_prompts is not None and (not isinstance(max_prompts, int) or max_prompts < 2):
            raise ValueError(f"max_prompts={max_prompts!r} must be an integer ≥ 2 or None")
        config = load_config(lm)
        check_layer(layer, num_layers(config))
        self.data = load_ravel(ravel_dir, entity_type)  # bad directory / type fails here, before the LM loads
        self._hidden_size = hidden_size(config)
        self.save_hyperparameters()

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    def prompts(self) -> list[tuple[str, str]]:
        pairs = entity_prompts(self.data, self.hparams.split, self.hparams.wikipedia)
        if not pairs:
            raise ValueError(f"no {self.hparams.entity_type} entities in split {self.hparams.split!r}")
        limit = self.hparams.max_prompts
        if limit is not None and len(pairs) > limit:
            rows = np.random.default_rng(self.hparams.seed).choice(len(pairs), size=limit, replace=False)
            pairs = [pairs[i] for i in sorted(rows)]
        return pairs

    @torch.no_grad()
    def read_activations(self) -> torch.Tensor:
        hp = self.hparams
        tokenizer, model = load_tokenizer(hp.lm), load_lm(hp.lm, hp.dtype)
        device, prefix = model.device, bos_prefix(tokenizer)
        examples = []
        for template, entity in self.prompts():
            ids, pos = encode_prompt(tokenizer, prefix, template, entity)
            if pos < hp.max_length:
                examples.append((ids[: hp.max_length], pos))
        found = []
        for start in range(0, len(examples), hp.read_batch_size):
            chunk = examples[start : start + hp.read_batch_size]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, (ids, _) in enumerate(chunk):
                input_ids[row, : len(ids)], mask[row, : len(ids)] = torch.tensor(ids), 1
            hidden = read_layers(model, [hp.layer], input_ids.to(device), mask.to(device))[hp.layer].float().cpu()
            if hp.positions == "entity":
                found.append(hidden[torch.arange(len(chunk)), torch.tensor([p for _, p in chunk])])
            else:  # every token but BOS (its state is an outlier, and no entity is there)
                found.append(hidden[mask.bool() & (input_ids != tokenizer.bos_token_id)])
        return torch.cat(found)  # (N, d)
