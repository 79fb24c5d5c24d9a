"""The one benchmark seam: every benchmark's data module is a `BenchmarkDataModule`, whose
Lightning loaders serve the splits it declares, and whose metric callbacks a run on it gets."""

from types import SimpleNamespace

import pytest
from lightning import Callback
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from lit_interventions.datamodules.ravel import RavelDataModule

from lit_interventions.modules.interchange import InterchangeModule


class ToyScore(Callback):
    pass


class ToyBenchmark(BenchmarkDataModule):
    """A benchmark defined here only: three splits of numbers."""

    SPLITS = {"train": "fit", "val": "choose", "test": "report"}

    def __init__(self):
        super().__init__()
        self.save_hyperparameters({"batch_size": 2, "eval_batch_size": 3})
        self.calls = []

    def loader(self, split, batch_size, shuffle=False):
        self.calls.append((split, batch_size, shuffle))
        return [split]

    def metric_callbacks(self):
        return [ToyScore()]


def test_the_benchmarks_declare_the_seam_and_their_splits():
    assert CausalGymDataModule.SPLITS == {"train": "train", "val": "dev", "test": "eval"}
    assert RavelDataModule.SPLITS == {"train": "train", "val": "val", "test": "test"}
    assert AxBenchDataModule.SPLITS == {"train": "train", "val": "eval", "test": "eval"}
    for cls in (CausalGymDataModule, RavelDataModule, AxBenchDataModule):
        assert issubclass(cls, BenchmarkDataModule)


def test_a_new_benchmark_is_one_subclass():
    data = ToyBenchmark()
    assert (data.train_dataloader(), data.val_dataloader(), data.test_dataloader()) == (["fit"], ["choose"], ["report"])
    assert data.calls == [("fit", 2, True), ("choose", 3, False), ("report", 3, False)]
    assert data.dev_metric() is None
    with pytest.raises(ValueError, match="ToyBenchmark gives no labels to fit a closed-form intervention on"):
        data.site_labels({}, "base")


def test_a_run_on_a_benchmark_gets_its_metric_callbacks_once(tiny_lm_dir):
    module = InterchangeModule(lm=tiny_lm_dir("gpt2"), layer=1)
    for present, expected in (([], [ToyScore]), ([ToyScore()], [])):
        module.trainer = SimpleNamespace(datamodule=ToyBenchmark(), callbacks=present)
        assert [type(c) for c in module.configure_callbacks()] == expected
    module.trainer = SimpleNamespace(datamodule=SimpleNamespace(metric_callbacks=lambda: [ToyScore()]), callbacks=[])
    assert module.configure_callbacks() == []  # not a declared benchmark: nothing is guessed
