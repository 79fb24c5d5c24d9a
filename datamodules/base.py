"""The one benchmark seam: what every benchmark's data module declares.

- `SPLITS`: which of its splits Lightning's train / val / test loaders serve;
- `loader(split, batch_size, shuffle)`: batches of one split, collated for the LM;
- `metric_callbacks()`: the callbacks that score what its data supports (CausalGym: odds and
  IIA; RAVEL: Cause, Iso, Disentangle), added to any run on this data (`InterchangeModule`);
- `FIT_SIDES` and `site_labels(batch, side)`: which sides' site states of the train split a
  closed-form intervention is fitted on, and the class of each (CausalGym: the bases, by their
  sentence's type; RAVEL: bases and sources, by their entity's target value), read by
  `modules.interchange.fit_states` for `train.py` and the CausalGym sweep alike;
- `dev_metric()`: the metric a fitted intervention's candidates are chosen by on the dev split
  (None: the intervention keeps its default).

A new benchmark is one subclass, its metric callback, and a config naming it.
"""

from __future__ import annotations

from typing import ClassVar

from lightning import Callback, LightningDataModule
from torch.utils.data import DataLoader
from torchmetrics import Metric


class BenchmarkDataModule(LightningDataModule):
    """Defaults for the seam (see the module doc); a subclass gives `SPLITS` and `loader`, and
    `hparams.batch_size` / `hparams.eval_batch_size`."""

    SPLITS: ClassVar[dict[str, str]] = {"train": "train", "val": "val", "test": "test"}
    FIT_SIDES: ClassVar[tuple[str, ...]] = ("base", "source")

    def loader(self, split: str, batch_size: int, shuffle: bool = False) -> DataLoader:
        raise NotImplementedError(f"{type(self).__name__} does not define loader(split, batch_size, shuffle)")

    def metric_callbacks(self) -> list[Callback]:
        return []

    def site_labels(self, batch: dict, side: str) -> list:
        raise ValueError(f"{type(self).__name__} gives no labels to fit a closed-form intervention on (site_labels)")

    def dev_metric(self) -> Metric | None:
        return None

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.SPLITS["train"], self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.SPLITS["val"], self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.loader(self.SPLITS["test"], self.hparams.eval_batch_size)
