"""CausalGym's DAS recipe, in the configs and in the optimizer and schedule actually built.

The official code (aryamanarora/causalgym): `das.py`'s defaults are `--lr 5e-3`, `--batch-size
4` (half pairs, half their swaps: 4 rows a step) and `--steps 100`; `train.py`'s `train_das`
trains 1 epoch (`epochs=1`) with Adam (`torch.optim.Adam(..., lr=lr)`) and
`get_linear_schedule_with_warmup(num_warmup_steps=0.1 * total_steps, num_training_steps=
total_steps)`: the learning rate rises linearly from 0 over the first 10 % of the steps, then falls
linearly to 0 at the last. Ours: `configs/das.yaml` (train.py), the registered `das`
(`method_spec("das")`, what `configs/sweep_causalgym.yaml`'s `das` trains) and the sweep's loop
(`causalgym_training`: one epoch, `MultiSiteInterchangeModule.attach` at 4 rows a batch); 200
train pairs doubled to 400 rows give the official 100 steps."""

from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import get_linear_schedule_with_warmup

from lit_interventions.interventions.registry import method_spec
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.modules.multisite import site_name
from lit_interventions.studies import causalgym_training as training
from lit_interventions.studies.causalgym_tasks import _region_data
from lit_interventions.studies.configs import build_module, model_section
from tests.helpers import ROOT

LR, WARMUP, BATCH, EPOCHS, STEPS = 5e-3, 0.1, 4, 1, 100
SITE = site_name(1, "subject")


def official_lrs(total: int) -> list[float]:
    """The official schedule's learning rate at steps 0..total: Adam at LR, linear warmup over
    0.1·total steps (a float, as train.py passes it), linear decay to 0 at `total`."""
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=WARMUP * total, num_training_steps=total)
    return _walk(optimizer, schedule, total)


def _walk(optimizer, schedule, total: int) -> list[float]:
    """The learning rate at steps 0..total, the optimizer (no gradients: nothing moves) and then
    the schedule stepped once a step, as the loops step them."""
    lrs = []
    for _ in range(total + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


def _check_recipe(optimizer, schedule, total: int) -> None:
    assert type(optimizer) is torch.optim.Adam  # Adam, not AdamW, as the official code
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-8, 0)  # torch's defaults
    assert group["initial_lr"] == LR
    lrs = _walk(optimizer, schedule, total)
    # by hand at 100 steps: 0 at step 0, LR/2 at step 5, LR at step 10 (end of warmup), then
    # LR·(100 − t)/90: LR/2 at step 55, 0 at step 100
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(LR / 2, rel=1e-12)
    assert lrs[10] == pytest.approx(LR, rel=1e-12) and max(lrs) == lrs[10]
    assert lrs[55] == pytest.approx(LR / 2, rel=1e-12) and lrs[100] == 0.0
    assert lrs == pytest.approx(official_lrs(total), rel=1e-12, abs=1e-15)


def test_configs_and_the_registered_das_are_the_papers_recipe():
    config = yaml.safe_load((ROOT / "configs/das.yaml").read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert (model["lr"], model["warmup_ratio"], model["k"]) == (LR, WARMUP, 1)
    assert (data["batch_size"], data["train_pairs"], config["trainer"]["max_epochs"]) == (BATCH, 200, EPOCHS)
    spec = method_spec("das")
    assert (spec.lr, spec.warmup_ratio, spec.objective, spec.init_args) == (LR, WARMUP, None, {"k": 1})
    built = spec.build(32, 0)
    assert isinstance(built, RotatedSpaceIntervention) and built.k == 1
    sweep = yaml.safe_load((ROOT / "configs/sweep_causalgym.yaml").read_text())
    assert "das" in sweep["methods"] and sweep["train_pairs"] == 200  # the registered das, unchanged
    assert training.one_epoch_trainer().max_epochs == EPOCHS


def test_the_sweeps_das_loop_builds_the_official_optimizer_and_schedule(tiny_lm_dir):
    # The sweep's DAS at one site: the registered spec's module, its data attached as the sweep
    # attaches it (4 rows a batch); 200 pairs doubled to 400 rows make the official 100 steps.
    lm = tiny_lm_dir("llama")
    data = _region_data("agr_sv_num_pp", None, lm, "subject", None, {"train_pairs": 200, "eval_pairs": 4, "seed": 0})
    assert len(data.splits["train"]) == 400
    module = training._module(method_spec("das"), lm, [(1, "subject")], "float32", 0).attach({"subject": data})
    assert len(module._frozen["loaders"][SITE]) == STEPS
    optimizers, schedules = module.configure_optimizers()
    assert len(optimizers) == len(schedules) == 1
    assert list(optimizers[0].param_groups[0]["params"]) == list(module.interventions[SITE].parameters())
    _check_recipe(optimizers[0], schedules[0], STEPS)


def test_train_py_das_builds_the_official_optimizer_and_schedule(tiny_lm_dir):
    # configs/das.yaml's model section (on the tiny model): configure_optimizers over 100 steps,
    # the schedule stepping every batch.
    module = build_module(model_section(ROOT / "configs/das.yaml"), lm=tiny_lm_dir("llama"), layer=1)
    module.trainer = SimpleNamespace(estimated_stepping_batches=STEPS)
    built = module.configure_optimizers()
    assert built["lr_scheduler"]["interval"] == "step"
    assert list(built["optimizer"].param_groups[0]["params"]) == list(module.intervention.parameters())
    _check_recipe(built["optimizer"], built["lr_scheduler"]["scheduler"], STEPS)
