"""The method × benchmark matrix (docs/methods.md): each claimed cell runs from its YAML alone on a
tiny model, and the closed-form RAVEL directions find a planted signal."""

from pathlib import Path

import pytest
import torch

from lit_interventions.interventions.fitted import DirectionInterchange
from lit_interventions.interventions.rotation import FixedSubspaceIntervention
from lit_interventions.modules.interchange import InterchangeModule

COMMON = ["--trainer.enable_progress_bar=false", "--trainer.max_epochs=1"]


def _fit(config, tmp_path, lm, *extra):
    import train

    return train.main(
        args=[
            "fit",
            "--config",
            config,
            f"--model.lm={lm}",
            "--model.layer=1",
            f"--trainer.default_root_dir={tmp_path}",
            *COMMON,
            *extra,
        ]
    )


def test_dbm_on_causalgym_trains_a_mask_scored_by_odds(tmp_path, tiny_lm_dir):
    cli = _fit("configs/dbm.yaml", tmp_path, tiny_lm_dir("llama"), "--data.train_pairs=40", "--data.eval_pairs=10")
    mask = cli.model.intervention
    assert mask.temperature.item() < 1e-2  # annealed from its start during training
    assert mask.mask.abs().max().item() > 0  # trained away from m = 0
    metrics = cli.trainer.callback_metrics
    assert {"val/odds", "val/iia", "val/loss", "train/mask_size"} <= set(metrics)
    # the odds the callback logged are those of the trained mask, recomputed here
    scored = cli.model.score(cli.datamodule.loader("dev", 16))
    assert metrics["val/odds"].item() == pytest.approx(scored["odds"], abs=1e-4)


@pytest.mark.parametrize("method", ["diffmean", "probe"])
def test_directions_on_ravel_from_yaml(method, tmp_path, tiny_lm_dir, monkeypatch):
    from lit_interventions.datamodules.ravel import RavelDataModule

    from tests.test_ravel_data import oracle

    lm = tiny_lm_dir("llama")
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(RavelDataModule, "predict_next", oracle(set(RavelDataModule(lm=lm).data.entities)))
    cli = _fit(
        f"configs/ravel/{method}.yaml",
        tmp_path,
        lm,
        "--data.train_size=32",
        "--data.eval_size=16",
        "--data.max_candidates=40",
    )
    basis = cli.model.intervention.basis
    assert basis.shape[1] == 32 and 1 <= basis.shape[0] <= 8
    torch.testing.assert_close(basis @ basis.T, torch.eye(basis.shape[0]), atol=1e-5, rtol=0)
    metrics = cli.trainer.callback_metrics
    assert metrics["val/disentangle"].item() == pytest.approx((metrics["val/cause"] + metrics["val/iso"]).item() / 2)


@pytest.mark.parametrize("method", ["diffmean", "probe", "lda"])
def test_direction_interchange_finds_planted_class_directions(method):
    # three classes, each shifted along its own planted axis; the rest is isotropic noise
    g = torch.Generator().manual_seed(0)
    d, n = 16, 300
    axes = torch.linalg.qr(torch.randn(d, 3, generator=g)).Q.T  # (3, d) orthonormal
    labels = [["paris", "rome", "oslo"][i % 3] for i in range(n)]
    states = torch.randn(n, d, generator=g) * 0.3 + 4.0 * axes[torch.arange(n) % 3]
    fitted = DirectionInterchange(d, method=method, k=2).fit(states, labels)
    # the fitted span lies in the span of the planted axes (projection norm ~1 per basis row)
    inside = (fitted.basis @ axes.T).norm(dim=1)
    assert inside.min().item() > 0.95, inside
    # and an interchange on it moves a base state to the source's class along those axes
    base, source = states[:1], states[1:2]
    moved = fitted(base, source)
    assert ((moved - source) @ fitted.basis.T).abs().max().item() < 1e-4


def test_a_fitted_intervention_refuses_to_run_unfitted():
    with pytest.raises(ValueError, match="fitted from the training data"):
        DirectionInterchange(4)(torch.zeros(1, 4), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="method='nope' is not one of"):
        DirectionInterchange(4, method="nope")


def test_mdas_on_causalgym_trains_on_cause_and_iso_pairs(tmp_path, tiny_lm_dir):
    cli = _fit("configs/mdas.yaml", tmp_path, tiny_lm_dir("gpt2"), "--data.train_pairs=20", "--data.eval_pairs=6")
    data = cli.datamodule
    train = data.splits["train"]
    iso = [e for e in train if e.kind == 1]
    assert len(iso) == len(train) // 2 == 40  # 20 Cause pairs and 20 Iso pairs, each doubled by the swap
    assert all(e.base_type == e.source_type for e in iso)
    assert sum(e.base_text != e.source_text for e in iso) > len(iso) // 2  # the nuisance variables differ
    assert all(e.kind == 0 for e in data.splits["dev"])  # scored on Cause pairs only
    batch = next(iter(data.loader("train", 80)))
    expected = torch.where(batch.kind == 1, batch.base.label, batch.source.label)
    assert torch.equal(batch.target, expected)  # Iso: the base's own answer must stay
    assert "val/odds" in cli.trainer.callback_metrics


def test_data_without_iso_pairs_is_refused_for_a_multitask_objective(tmp_path, tiny_lm_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _fit("configs/mdas.yaml", tmp_path, tiny_lm_dir("gpt2"), "--data.multitask=false", "--data.train_pairs=4")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "set --data.multitask true" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "overrides,kind",
    [
        (
            [
                "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
                "--model.intervention.method=probe",
            ],
            "direction",
        ),
        (["--model.intervention=lit_interventions.interventions.fitted.FeatureInterchangeFit"], "featurizer"),
        (
            [
                "--model.objective=lit_interventions.objectives.CauseIsoLoss",
                "--model.objective.multitask=true",
                "--data.multitask=true",
            ],
            "mdbm",
        ),
    ],
)
def test_other_cells_from_the_command_line_alone(overrides, kind, tmp_path, tiny_lm_dir):
    """Any intervention and objective on CausalGym by naming classes: a probe direction, the PCA
    featurizer, and MDBM (the DBM config with the multi-task objective)."""
    config = "configs/dbm.yaml" if kind == "mdbm" else "configs/das.yaml"
    cli = _fit(config, tmp_path, tiny_lm_dir("llama"), "--data.train_pairs=24", "--data.eval_pairs=8", *overrides)
    intervention = cli.model.intervention
    if kind == "direction":
        assert intervention.basis.shape == (1, 32) and intervention.basis.norm().item() == pytest.approx(1.0)
    elif kind == "featurizer":
        assert intervention.fitted.featurizer.n_features == 32
    else:
        assert cli.model.objective.multitask and any(e.kind == 1 for e in cli.datamodule.splits["train"])
    scored = cli.model.score(cli.datamodule.loader("dev", 16))
    assert cli.trainer.callback_metrics["val/odds"].item() == pytest.approx(scored["odds"], abs=1e-4)


def test_fitted_interventions_export_and_reload(tmp_path):
    from lit_interventions.artifacts.intervention_files import load_intervention, save_intervention
    from lit_interventions.interventions.fitted import FeatureInterchangeFit

    g = torch.Generator().manual_seed(1)
    states = torch.randn(80, 8, generator=g)
    labels = ["a" if x > 0 else "b" for x in states[:, 0]]
    base, source = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    for fitted in (
        DirectionInterchange(8, method="probe").fit(states, labels),
        FeatureInterchangeFit(8).fit(states, labels),
    ):
        save_intervention(tmp_path / type(fitted).__name__, fitted, {})
        loaded, card = load_intervention(tmp_path / type(fitted).__name__)
        torch.testing.assert_close(loaded(base, source), fitted(base, source))
    assert DirectionInterchange(8).export() == {}  # nothing fitted, nothing exported


def test_das_at_a_sub_block_component(tmp_path, tiny_lm_dir):
    """configs/das_mlp.yaml: DAS at the MLP output, trained, scored, and its odds equal to an
    interchange written by hand at the real MLP module with the trained basis."""
    from lit_interventions.core.forward import logits_at, read_site

    cli = _fit(
        "configs/das_mlp.yaml", tmp_path, tiny_lm_dir("gpt_neox"), "--data.train_pairs=24", "--data.eval_pairs=8"
    )
    module = cli.model
    assert module.component == "mlp_output" and not module.hparams.cache
    assert Path(cli.trainer.log_dir).parent.name == "layer1_mlp_output"
    batch = next(iter(cli.datamodule.loader("dev", 16)))
    W = module.intervention.basis.detach()  # (1, d)
    mlp = module.lm.gpt_neox.layers[1].mlp
    source = read_site(
        module.lm,
        1,
        batch.source.input_ids,
        batch.source.attention_mask,
        batch.source.pos,
        component="mlp_output",
    )
    captured = {}
    handle = mlp.register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
    module.lm(input_ids=batch.source.input_ids, attention_mask=batch.source.attention_mask)
    handle.remove()
    rows = torch.arange(len(source))
    torch.testing.assert_close(source, captured["h"][rows, batch.source.pos])  # the real MLP's output
    edited = logits_at(
        module.lm,
        batch.base.input_ids,
        batch.base.attention_mask,
        batch.base.last,
        1,
        batch.base.pos,
        lambda b: b + (source - b) @ W.T @ W,
        component="mlp_output",
    )
    torch.testing.assert_close(module.intervened_logits(batch), edited)
    assert (edited - module.clean_logits(batch)).abs().max() > 1e-4  # the edit changes the output


def test_two_sites_composed(tmp_path, tiny_lm_dir):
    """configs/das_two_sites.yaml: DAS on the subject (layer 0 here) and on the object (layer 1) in
    one forward; each part trains; the composition equals both edits applied by hand."""
    from lit_interventions.artifacts.intervention_files import load_pretrained

    cli = _fit(
        "configs/das_two_sites.yaml",
        tmp_path,
        tiny_lm_dir("llama"),
        "--data.train_pairs=24",
        "--data.eval_pairs=8",
        '--model.sites=[{"layer": 0, "region": "subject"}, {"layer": 1, "region": "object"}]',
    )
    module = cli.model
    first, second = module.intervention.parts
    assert not torch.allclose(first.basis, second.basis)  # two subspaces, trained apart
    batch = next(iter(cli.datamodule.loader("dev", 16)))
    both = module.intervened_logits(batch)
    # the subject's part alone, as a one-site module with the same basis
    alone = InterchangeModule(lm=module.hparams.lm, layer=0, region="subject", cache=False)
    alone.intervention.rotate.weight = first.basis.detach().clone()
    subject_only = alone.intervened_logits(batch)
    module.intervention.parts[1] = FixedSubspaceIntervention(torch.zeros(1, 32))  # the object's part: a no-op
    torch.testing.assert_close(module.intervened_logits(batch), subject_only)  # then the composition is the one site
    assert (both - subject_only).abs().max() > 1e-4  # and the object's trained part adds its own edit
    module.intervention.parts[1] = second
    loaded = load_pretrained(cli.trainer.log_dir)  # exported through the protocol, one card: config.json
    assert [p.basis.shape for p in loaded.parts] == [(1, 32), (1, 32)]
    torch.testing.assert_close(loaded.parts[1].basis, second.basis.detach())
    assert Path(cli.trainer.log_dir).parent.name == "layers0+1"
