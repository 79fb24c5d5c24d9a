"""One scoring path and one closed-form fit for CausalGym: a site's odds and IIA in the sweep are
`train.py`'s validation odds bit for bit, and `train.py` fits a closed-form direction on what the
sweep fits it on (the base train states, labelled by their sentence type, as CausalGym's code)."""

from functools import partial

import pytest
import torch
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from lit_interventions.datamodules.ravel import RavelDataModule

import train
from lit_interventions.core.cache import ActivationCache
from lit_interventions.core.lm import load_lm
from lit_interventions.interventions.fitted import DirectionInterchange
from lit_interventions.interventions.registry import method_spec
from lit_interventions.metrics.odds import InterchangeOdds, label_ids
from lit_interventions.modules.interchange import InterchangeModule, fit_states
from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies.causalgym_scoring import fit_site
from lit_interventions.studies.causalgym_tasks import _region_data
from tests.helpers import ONE_QUIET_EPOCH, csv_rows

TASK, LAYER, REGION = "agr_sv_num_pp", 1, "subject"
SIZES = {"train_pairs": 10, "eval_pairs": 8, "seed": 0}


def test_the_collate_carries_the_types_and_causalgym_fits_on_the_bases(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    data = _region_data(TASK, None, lm, REGION, None, SIZES)
    train_split = data.splits["train"]
    batch = next(iter(data.loader("train", 64)))
    assert batch.base.types == [e.base_type for e in train_split]
    assert batch.source.types == [e.source_type for e in train_split]
    assert data.site_labels(batch, "base") == batch.base.types and set(batch.base.types) == {"sg", "pl"}
    # the label tokens are more classes than the types (' is', ' was', ' has' | ' are', ' were', ' have')
    assert len(set(batch.base.label.tolist())) > 2
    assert CausalGymDataModule.FIT_SIDES == ("base",)
    assert RavelDataModule.FIT_SIDES == ("base", "source")  # RAVEL fits on both sides, as before
    module = InterchangeModule(lm=lm, layer=LAYER, region=REGION)
    states, labels = fit_states(module, data)
    assert states.shape == (len(train_split), 32) and states.dtype == torch.float32
    assert labels == [e.base_type for e in train_split]
    bases = torch.cat([module.site_representation(b, "base") for b in data.loader("train", 3)])
    assert torch.equal(states, bases)  # the base states alone, in the loader's order


@pytest.mark.parametrize("method", ["diffmean", "probe"])
def test_train_py_fits_the_direction_the_sweep_fits(tiny_lm_dir, method):
    lm = tiny_lm_dir("llama")
    data = _region_data(TASK, None, lm, REGION, None, SIZES)
    cache = ActivationCache(load_lm(lm), [LAYER])
    _, found = fit_site(LAYER, REGION, [method_spec(method)], lm, data, cache, seed=0)
    module = InterchangeModule(
        lm=lm, layer=LAYER, region=REGION, intervention=partial(DirectionInterchange, method=method)
    )
    printed = []
    module.print = printed.append  # (no Trainer here to print through)
    module.fit_intervention(data)
    assert printed == [f"{method}: a 1-dimensional subspace"]  # two classes, sg and pl: one direction
    ours, sweeps = module.intervention.basis, found[method].basis
    assert ours.shape == sweeps.shape == (1, 32)
    assert torch.equal(ours, sweeps) or torch.equal(ours, -sweeps)  # an interchange is the same for ±a


def test_score_feeds_the_metric_the_label_logits(tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    data = _region_data(TASK, None, lm, REGION, None, SIZES)
    module = InterchangeModule(lm=lm, layer=LAYER, region=REGION)
    batches = list(data.loader("eval", 5))
    metric = InterchangeOdds()
    for batch in batches:
        clean, intervened = module.label_logits(batch)
        full = module.intervened_logits(batch)
        # the two labels' rows of the head: the full logits' y_b and y_s columns, to float rounding
        torch.testing.assert_close(intervened, full.gather(1, label_ids(batch)), rtol=1e-5, atol=1e-5)
        metric.update_labels(clean, intervened)
    assert module.score(batches) == {k: v.item() for k, v in metric.compute().items()}


@pytest.fixture(scope="module")
def sweep_rows(tmp_path_factory, tiny_lm_dir):
    """The sweep's rows at (LAYER, REGION): {method: (odds, iia)}, scored site by site."""
    out = tmp_path_factory.mktemp("sweep")
    sweep.run_sweep(
        tasks=TASK,
        methods=["vanilla", "diffmean"],
        layers=[LAYER],
        lm=tiny_lm_dir("llama"),
        out=str(out),
        stacked_scoring=False,
        batch_size=16,
        **SIZES,
    )
    return {
        r["method"]: (float(r["odds"]), float(r["iia"])) for r in csv_rows(out / "results.csv") if r["region"] == REGION
    }


@pytest.mark.parametrize(
    "command,intervention",
    [
        ("validate", ["--model.intervention=lit_interventions.interventions.rotation.FullSubspaceSwap"]),
        (  # a fitted method runs `fit`, whose validation scores it (`validate` alone refuses it)
            "fit",
            [
                "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
                "--model.intervention.method=diffmean",
            ],
        ),
    ],
    ids=["vanilla", "diffmean"],
)
def test_the_sweeps_odds_at_a_site_equal_train_py_validation_exactly(
    command, intervention, sweep_rows, tmp_path, tiny_lm_dir
):
    cli = train.main(
        args=[
            command,
            "--config",
            "configs/das.yaml",
            f"--model.lm={tiny_lm_dir('llama')}",
            f"--model.layer={LAYER}",
            f"--model.region={REGION}",
            *intervention,
            "--data.train_pairs=10",
            "--data.eval_pairs=8",
            "--data.dev_seed=0",  # dev drawn as eval is: validation scores the sweep's eval pairs
            "--data.eval_batch_size=16",
            *ONE_QUIET_EPOCH,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    splits = cli.datamodule.splits
    assert [e.base_text for e in splits["dev"]] == [e.base_text for e in splits["eval"]]
    metrics = cli.trainer.callback_metrics
    method = "vanilla" if command == "validate" else "diffmean"
    odds, iia = sweep_rows[method]
    assert (metrics["val/odds"].item(), metrics["val/iia"].item()) == (odds, iia)
    assert odds != 0.0
