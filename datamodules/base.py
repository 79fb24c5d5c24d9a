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
  (None: the intervention keeps its default);
- `usage_example()`: one example of the data as `lit-interventions generate` takes it (prompt,
  source, and the spans whose last tokens are the site), written to the model card (None: none).

The train loader is resumable (`core.loaders.ResumableLoader`, exact): a fit resumed with
`--ckpt_path` from a checkpoint saved mid-epoch skips the batches already used, in the order the
interrupted pass drew, and equals an uninterrupted fit.

A new benchmark is one subclass, its metric callback, and a config naming it.
"""

from __future__ import annotations

from typing import ClassVar

from lightning import Callback, LightningDataModule
from torch.utils.data import DataLoader
from torchmetrics import Metric

from lit_interventions.core.loaders import ResumableLoader


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

    def usage_example(self) -> dict[str, str] | None:
        return None

    def train_dataloader(self) -> ResumableLoader | DataLoader:
        """The shuffled train split; a DataLoader is made resumable mid-epoch (its state: the
        batches this epoch's training steps used, the order they were drawn in, torch's global
        random state)."""
        loader = self.loader(self.SPLITS["train"], self.hparams.batch_size, shuffle=True)
        if not isinstance(loader, DataLoader):
            return loader
        self._train_loader = ResumableLoader(loader, self._batches_used, exact=True)
        resumed = self.__dict__.pop("_resume_state", None)
        if resumed:
            self._train_loader.load_state_dict(resumed)
        return self._train_loader

    def _batches_used(self) -> int:
        """The batches of this epoch whose training step has run (Lightning's count); an epoch
        whose batches are all used (`limit_train_batches` included) counts as the whole pass."""
        used = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return used if used < self.trainer.num_training_batches else len(self._train_loader)

    def state_dict(self) -> dict:
        """The train loader's state, saved with the fit's checkpoint. Lightning restores the data
        module before anything builds the train loader, while it gives a loader its own state only
        when the loader is built after the restore (not when the optimizer's schedule has asked
        for the number of steps first), so the state travels this way too."""
        loader = self.__dict__.get("_train_loader")
        if loader is None or self.trainer is None or self.trainer.state.fn != "fit":
            return {}
        return {"train_loader": loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._resume_state = state.get("train_loader")

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.SPLITS["val"], self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.loader(self.SPLITS["test"], self.hparams.eval_batch_size)
