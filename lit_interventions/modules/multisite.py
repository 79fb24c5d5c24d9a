"""DAS at several sites of one layer, trained together (the sweep's layer × region grid).

Each region keeps its own subspace, Adam optimiser and linear schedule, and sees exactly its own
batches. One step stacks the regions' batches into one: the frozen blocks above the layer run
once on the stack (bigger matrices, which a CPU or GPU runs at a higher rate) and the LM head's
weights, which dominate a step on a 262k-token vocabulary, are read once for all regions. The
loss is the sum of the regions' losses, so each subspace gets exactly the gradient it would get
alone: the result equals training the sites one by one with the same seed and batch order.
"""

from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import CombinedLoader
from torch import nn

from lit_interventions.interventions import RotatedSpaceIntervention
from lit_interventions.lm import DEFAULT_LM, hidden_size, load_config
from lit_interventions.modules.site import SiteModule
from lit_interventions.optim import OptimizerArgs
from lit_interventions.sites import logits_at


def stack_batches(batches: list[dict], padding_side: str = "right") -> dict:
    """One batch from several collated CausalGym batches: ids and masks padded to the widest
    (on `padding_side`, shifting positions and cache keys when on the left), rows in order."""
    stacked = {}
    for side in ("base", "source"):
        width = max(batch[f"{side}_input_ids"].shape[1] for batch in batches)
        ids, masks, positions, lasts, labels, keys, starts, sites = [], [], [], [], [], [], [], []
        for batch in batches:
            pad = width - batch[f"{side}_input_ids"].shape[1]
            spec, shift = ((pad, 0), pad) if padding_side == "left" else ((0, pad), 0)
            ids.append(F.pad(batch[f"{side}_input_ids"], spec))
            masks.append(F.pad(batch[f"{side}_attention_mask"], spec))
            positions.append(batch[f"{side}_pos"] + shift)
            lasts.append(batch[f"{side}_last"] + shift)
            labels.append(batch[f"{side}_label"])
            keys += batch[f"{side}_keys"][0]
            starts += [start + shift for start in batch[f"{side}_keys"][1]]
            sites += [site + shift for site in batch.get(f"{side}_pos_list") or batch[f"{side}_pos"].tolist()]
        stacked |= {f"{side}_input_ids": torch.cat(ids), f"{side}_attention_mask": torch.cat(masks),
                    f"{side}_pos": torch.cat(positions), f"{side}_last": torch.cat(lasts),
                    f"{side}_label": torch.cat(labels), f"{side}_keys": (keys, starts), f"{side}_pos_list": sites}  # fmt: skip
    return stacked


class MultiSiteInterchangeModule(SiteModule):
    """An intervention at each of `regions` of one layer, each trained as if alone, in one loop
    (see the module doc): the sweep's grid. `InterchangeModule` is the one-run case.

    Give it the regions' data with `attach(datas)`, then `Trainer.fit(module)`.
    `interventions[region]` holds the trained interventions: `intervention(d)` (default: DAS of
    rank `k`), each initialised from `seed`, as `InterchangeModule` is after `seed_everything(seed)`.
    """

    def __init__(self, lm: str = DEFAULT_LM, layer: int | None = None, regions: list[str] = (), k: int = 1,
                 lr: float = 5e-3, warmup_ratio: float = 0.1, dtype: str = "float32", cache: bool = True,
                 seed: int = 0, padding_side: str = "right",
                 intervention: Callable[[int], nn.Module] | None = None):  # fmt: skip
        super().__init__()
        layer = self._check_site(lm, layer, dtype)
        if not regions:
            raise ValueError("regions is empty: name at least one region to train")
        self.optimizer_args = OptimizerArgs(lr=lr, warmup_ratio=warmup_ratio)  # validated before any load
        self.save_hyperparameters()
        self.hparams.layer = layer
        self.automatic_optimization = False  # one optimiser and schedule per region
        d = hidden_size(load_config(lm))
        build = partial(RotatedSpaceIntervention, k=k) if intervention is None else intervention
        self.interventions = nn.ModuleDict()
        for region in regions:
            torch.manual_seed(seed)
            self.interventions[region] = build(d)

    def attach(self, datas: dict, batch_size: int = 4) -> "MultiSiteInterchangeModule":
        """The regions' data ({region: CausalGymDataModule}, set up). Training draws each region's
        batches shuffled in the order `seed` gives it."""
        missing = [region for region in self.hparams.regions if region not in datas]
        if missing:
            raise ValueError(f"no data for regions {missing}; given: {sorted(datas)}")
        self._frozen["loaders"] = {region: datas[region].loader("train", batch_size, shuffle=True, seed=self.hparams.seed)
                                   for region in self.hparams.regions}  # fmt: skip
        return self

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:  # each region's batch order comes from its own seeded loader
            raise ValueError(
                f"MultiSiteInterchangeModule runs in one process (the sweep's DAS), not in {self.trainer.world_size} "
                "DDP processes: for several GPUs, run one sweep per GPU on its own tasks or layers and --out"
            )

    def train_dataloader(self) -> CombinedLoader:
        return CombinedLoader(self._frozen["loaders"], mode="max_size")  # a region with fewer pairs stops early

    def training_step(self, batch: dict, batch_idx):
        """`batch` is {region: collated batch, or None once that region's loader is exhausted}."""
        present = [region for region in self.hparams.regions if batch.get(region) is not None]
        parts = [batch[region] for region in present]
        stacked = stack_batches(parts, self.hparams.padding_side)
        stacked = self.transfer_batch_to_device(stacked, self.device, 0)
        bounds = [0, *accumulate(len(part["base_label"]) for part in parts)]  # region i: rows bounds[i]:bounds[i+1]
        source = self.site_representation(stacked, "source")

        def edit(base):  # each region's rows through its own subspace
            return torch.cat([self.interventions[region](base[a:b], source[a:b])
                              for region, a, b in zip(present, bounds, bounds[1:])])  # fmt: skip

        logits = logits_at(self.lm, stacked["base_input_ids"], stacked["base_attention_mask"], stacked["base_last"],
                           layer=self.hparams.layer, site_positions=stacked["base_pos"], intervention=edit,
                           start_states=self._states(stacked, "base"), prefix=self._prefix(stacked)).float()  # fmt: skip
        losses = [F.cross_entropy(logits[a:b], stacked["source_label"][a:b]) for a, b in zip(bounds, bounds[1:])]
        optimizers, schedules = self.optimizers(), self.lr_schedulers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedules = schedules if isinstance(schedules, list) else [schedules]
        index = {region: i for i, region in enumerate(self.hparams.regions)}
        self.manual_backward(torch.stack(losses).sum())
        for region in present:
            optimizers[index[region]].step()
            optimizers[index[region]].zero_grad()
            schedules[index[region]].step()
        self.log("train/loss", torch.stack(losses).mean(), prog_bar=True, batch_size=len(logits))

    def configure_optimizers(self):
        """Per region: Adam, linear warmup over `warmup_ratio` of its own steps, then decay to 0."""
        built = [self.optimizer_args.build(self.interventions[region].parameters(), len(self._frozen["loaders"][region]))
                 for region in self.hparams.regions]  # fmt: skip
        return [optimizer for optimizer, _ in built], [schedule for _, schedule in built]
