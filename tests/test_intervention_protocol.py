"""Every intervention implements one protocol: forward(base, source=None, *, context), trains,
export / config / from_tensors; save_intervention / load_intervention round-trip through it."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.parsing import AttributeDict
from safetensors.torch import save_file

from lit_interventions.artifacts.hub import read_config
from lit_interventions.artifacts.intervention_files import (
    CARD,
    WEIGHTS,
    load_intervention,
    load_pretrained,
    save_intervention,
)
from lit_interventions.callbacks.export import ExportIntervention
from lit_interventions.interventions.additive import ConceptDictionary, ReFTR1Dictionary, SSVDictionary
from lit_interventions.interventions.attacks import GradientAttack, RandomSignIntervention, fgsm, pgd
from lit_interventions.interventions.base import InterventionProtocol
from lit_interventions.interventions.directions import DiffMeanDirection, fit_intervention
from lit_interventions.interventions.featurizers import (
    FeatureInterchange,
    FullVectorSwap,
    PCAFeaturizer,
    SAEFeaturizer,
)
from lit_interventions.interventions.loreft import LoReFTIntervention
from lit_interventions.interventions.mask import SigmoidMaskIntervention
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.probe import ProbeModule

D = 16


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _pca():
    return PCAFeaturizer.fit(torch.randn(64, D, generator=_g(1)), n_components=8)


def _sae():
    g = _g(2)
    return SAEFeaturizer(
        torch.randn(4 * D, D, generator=g),
        torch.randn(4 * D, generator=g),
        torch.randn(D, 4 * D, generator=g),
        torch.randn(D, generator=g),
    )


def _probe():
    torch.manual_seed(0)
    return ProbeModule(["a", "b", "c"], "toy", 0, D, kind="mlp", hidden=8)


def _mask():
    module = SigmoidMaskIntervention(D, temperature=0.5)
    with torch.no_grad():
        module.mask.copy_(torch.randn(D, generator=_g(3)))
    return module


def _direction():
    X, y = torch.randn(40, D, generator=_g(4)), torch.arange(40) % 2
    return DiffMeanDirection().fit(X, y).to_intervention()


TARGET = torch.tensor([0, 2, 1, 1])
# name -> (build, forward context, takes a source)
CASES = {
    "das": (lambda: RotatedSpaceIntervention(D, 3), {}, True),
    "fixed": (lambda: FixedSubspaceIntervention(torch.linalg.qr(torch.randn(D, 2, generator=_g(5)))[0].T), {}, True),
    "direction": (_direction, {}, True),
    "dbm": (_mask, {}, True),
    "pca": (lambda: FeatureInterchange(_pca(), [0, 3, 5]), {}, True),
    "pca_empty": (lambda: FeatureInterchange(_pca(), []), {}, True),
    "sae": (lambda: FeatureInterchange(_sae(), [1, 7, 30], keep_error=False), {}, True),
    "full_swap": (FullVectorSwap, {}, True),
    "dictionary": (
        lambda: ConceptDictionary(3, D, unit_norm=False, seed=1),
        {"concept_id": torch.tensor([0, 2, 1, 2]), "factor": torch.tensor([1.0, -2.0, 0.5, 3.0])},
        False,
    ),
    "dictionary_unit": (
        lambda: ConceptDictionary(3, D, seed=1),
        {"concept_id": torch.tensor([1, 1, 0, 2]), "factor": 4.0},
        False,
    ),
    "reft_r1": (  # the steering form; the training form (no factor) is tested in test_axbench_methods.py
        lambda: ReFTR1Dictionary(topk=2, l1=0.01, l1_ramp=False).allocate(3, D, seed=2),
        {"concept_id": torch.tensor([2, 0, 1, 0]), "factor": 1.5},
        False,
    ),
    "ssv": (
        lambda: SSVDictionary(init=0.25).allocate(3, D),
        {"concept_id": torch.tensor([1, 1, 0, 2]), "factor": torch.tensor([1.0, 2.0, -1.0, 0.5])},
        False,
    ),
    "loreft": (lambda: LoReFTIntervention(D, rank=2), {}, False),
    "pgd": (lambda: GradientAttack(_probe(), epsilon=0.3, steps=5), {"target": TARGET}, False),
    "fgsm": (lambda: GradientAttack.fgsm(_probe(), epsilon=0.3, targeted=False), {"target": TARGET}, False),
    "random_sign": (lambda: RandomSignIntervention(0.2, seed=7), {}, False),
}
SHOULD_TRAIN = {"das", "dbm", "dictionary", "dictionary_unit", "reft_r1", "ssv", "loreft"}


def _run(module, base, source, context, interchange):
    return module(base, source, **context) if interchange else module(base, **context)


def _inputs(seq: bool):
    shape = (4, 5, D) if seq else (4, D)
    return torch.randn(*shape, generator=_g(10)), torch.randn(*shape, generator=_g(11))


@pytest.mark.parametrize("name", CASES)
def test_satisfies_the_protocol_and_round_trips_through_files(name, tmp_path):
    build, context, interchange = CASES[name]
    module = build()
    assert isinstance(module, InterventionProtocol)
    path = save_intervention(tmp_path, module, {"method": name})
    assert path == tmp_path / WEIGHTS and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [WEIGHTS, CARD]
    )  # no temp left
    loaded, card = load_intervention(tmp_path)
    assert type(loaded) is type(module) and card["method"] == name and card["config"] == module.config()
    assert card["class_path"].endswith(type(module).__qualname__)
    rebuilt = type(module).from_tensors(module.export(), **module.config())
    for seq in (False, True):
        base, source = _inputs(seq)
        expected = _run(module, base, source, context, interchange)
        assert expected.shape == base.shape
        torch.testing.assert_close(_run(loaded, base, source, context, interchange), expected)
        torch.testing.assert_close(_run(rebuilt, base, source, context, interchange), expected)


@pytest.mark.parametrize("name", CASES)
def test_trains_says_whether_forward_reaches_trainable_parameters(name):
    build, context, interchange = CASES[name]
    module = build()
    assert module.trains == (name in SHOULD_TRAIN)
    params = [p for p in module.parameters() if p.requires_grad]
    base, source = _inputs(False)
    out = _run(module, base.requires_grad_(), source, context, interchange)
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True) if params else []
    reached = any(g is not None and g.abs().sum() > 0 for g in grads)
    assert reached == module.trains, (name, [p.shape for p in params])


@pytest.mark.parametrize("name", ["das", "dbm", "loreft", "dictionary", "pgd", "random_sign"])
def test_additive_interventions_refuse_a_source_and_interchanges_require_one(name):
    build, context, interchange = CASES[name]
    base, source = _inputs(False)
    with pytest.raises(ValueError, match="source"):
        build()(base, None if interchange else source, **context)


def test_formulas_of_the_new_forwards():
    d = ConceptDictionary(3, D, seed=0)
    base = torch.randn(2, 5, D)
    out = d(base, concept_id=torch.tensor([2, 0]), factor=torch.tensor([3.0, -1.0]))
    torch.testing.assert_close(out, base + torch.stack([3 * d.weight[2], -d.weight[0]])[:, None].detach())
    with pytest.raises(ValueError, match="concept_id 3"):
        d(base, concept_id=torch.tensor([3, 0]))
    probe, h = _probe(), torch.randn(4, D)
    torch.testing.assert_close(GradientAttack.fgsm(probe, 0.3)(h, target=TARGET), h + fgsm(probe, h, TARGET, 0.3))
    attack = GradientAttack(probe, 0.3, steps=4, step_size=0.05)
    torch.testing.assert_close(attack(h, target=TARGET), h + pgd(probe, h, TARGET, 0.3, 0.05, 4))
    mask = _mask()
    assert set(mask.export()) == {"logits", "temperature", "mask"}
    torch.testing.assert_close(mask.export()["mask"], torch.sigmoid(mask.mask / 0.5).detach())
    fixed = fit_intervention("diffmean", torch.randn(20, D), torch.arange(20) % 2)
    assert isinstance(fixed, FixedSubspaceIntervention) and fixed.basis.shape == (1, D)
    with pytest.raises(ValueError, match="not fitted"):
        DiffMeanDirection().to_intervention()


def test_a_mask_is_soft_in_training_and_hard_in_evaluation():
    # the official DBM evaluates with the dimensions where σ(m/T) > ½, swapped whole
    mask = SigmoidMaskIntervention(4, temperature=1.0)
    with torch.no_grad():
        mask.mask.copy_(torch.tensor([2.0, -1.0, 0.5, 0.0]))
    base, source = torch.zeros(1, 4), torch.ones(1, 4)
    soft = torch.sigmoid(torch.tensor([2.0, -1.0, 0.5, 0.0]))
    torch.testing.assert_close(mask(base, source), soft[None])
    torch.testing.assert_close(mask.eval()(base, source), torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(mask.eval()(2 * source, source), torch.tensor([[1.0, 2.0, 1.0, 2.0]]))


def test_non_finite_tensors_are_refused_on_save_and_on_load(tmp_path):
    bad = FixedSubspaceIntervention(torch.tensor([[1.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'out' / WEIGHTS}.*'basis'.*NaN"):
        save_intervention(tmp_path / "out", bad, {})
    assert not (tmp_path / "out" / WEIGHTS).exists()
    save_intervention(tmp_path, FixedSubspaceIntervention(torch.ones(1, 3)), {})
    save_file({"basis": torch.tensor([[1.0, float("inf"), 0.0]])}, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=rf"{tmp_path / WEIGHTS}.*'basis'.*infinite"):
        load_intervention(tmp_path)


def test_a_card_without_class_path_is_refused_by_name(tmp_path):
    save_intervention(tmp_path, FixedSubspaceIntervention(torch.ones(1, 3)), {})
    card = json.loads((tmp_path / CARD).read_text())
    del card["class_path"]
    (tmp_path / CARD).write_text(json.dumps(card))
    with pytest.raises(ValueError, match="class_path"):
        load_intervention(tmp_path)
    (tmp_path / CARD).write_text(json.dumps({**card, "class_path": "collections.OrderedDict"}))
    with pytest.raises(ValueError, match="not a registered class"):
        load_intervention(tmp_path)
    with pytest.raises(ValueError, match="not an intervention class"):
        load_intervention(tmp_path, trust_remote_code=True)


def _fake_fit(tmp_path, intervention, method):
    metrics = {"val/odds": torch.tensor(2.5), "val/nan": torch.tensor(float("nan"))}  # NaN metrics are left out
    trainer = SimpleNamespace(
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        is_global_zero=True,
        datamodule=None,
        callback_metrics=metrics,
    )
    module = SimpleNamespace(intervention=intervention, hparams=AttributeDict(method=method, lm="tiny", layer=1, k=3))
    ExportIntervention().on_fit_end(trainer, module)


@pytest.mark.parametrize("name", ["das", "pca", "sae", "dbm"])
def test_export_callback_writes_a_loadable_intervention(name, tmp_path):
    build, context, interchange = CASES[name]
    module = build()
    _fake_fit(tmp_path, module, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "intervention.safetensors"]
    loaded, card = load_pretrained(tmp_path), read_config(tmp_path)
    assert card["method"] == name and card["model"] == "tiny" and card["layer"] == 1 and card["hidden_size"] == D
    assert card["k"] == (3 if name == "das" else None) and card["metrics"] == {"val/odds": 2.5}
    base, source = _inputs(False)
    torch.testing.assert_close(loaded(base, source), module(base, source))


def test_a_run_beside_someone_elses_config_json_keeps_it_and_writes_its_card_as_intervention_json(tmp_path):
    foreign = '{"_name_or_path": "someone/model"}\n'
    (tmp_path / "config.json").write_text(foreign)
    module = CASES["das"][0]()
    with pytest.warns(UserWarning, match="the run's card is intervention.json, not config.json"):
        _fake_fit(tmp_path, module, "das")
    assert (tmp_path / "config.json").read_text() == foreign and not (tmp_path / "README.md").exists()
    loaded, card = load_intervention(tmp_path)
    assert card["method"] == "das" and card["metrics"] == {"val/odds": 2.5}
    base, source = _inputs(False)
    torch.testing.assert_close(loaded(base, source), module(base, source))


@pytest.mark.parametrize("intervention", [None, FullVectorSwap(), "not an intervention"])
def test_export_callback_skips_what_exports_nothing(intervention, tmp_path):
    _fake_fit(tmp_path, intervention, "full_swap")
    assert not list(tmp_path.iterdir())


def test_interventions_import_no_lightning():
    code = (
        "import sys, importlib; [importlib.import_module(f'lit_interventions.interventions.{m}') for m in "
        "('base', 'rotation', 'mask', 'featurizers', 'additive', 'loreft', 'attacks', 'directions')]; "
        "print(any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_damaged_intervention_files_name_their_path(tmp_path):
    from lit_interventions.artifacts.intervention_files import CARD, WEIGHTS, load_intervention, save_intervention
    from lit_interventions.interventions.rotation import RotatedSpaceIntervention

    save_intervention(tmp_path, RotatedSpaceIntervention(8, 2), {})
    weights = (tmp_path / WEIGHTS).read_bytes()
    (tmp_path / WEIGHTS).write_bytes(weights[: len(weights) // 2])  # truncated
    with pytest.raises(ValueError, match=rf"{WEIGHTS} is unreadable .*re-export it"):
        load_intervention(tmp_path)
    (tmp_path / WEIGHTS).write_bytes(weights)
    (tmp_path / CARD).write_text('{"class_path": "lit_interv')  # a cut card
    with pytest.raises(ValueError, match=rf"{CARD} is unreadable \(JSONDecodeError\)"):
        load_intervention(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_intervention(tmp_path / "elsewhere")


def test_source_free_interventions_declare_it():
    from lit_interventions.interventions.additive import ConceptDictionary
    from lit_interventions.interventions.attacks import FGSM, PGD, GradientAttack, RandomSign, RandomSignIntervention
    from lit_interventions.interventions.capabilities import is_source_free
    from lit_interventions.interventions.loreft import LoReFTIntervention
    from lit_interventions.interventions.mask import SigmoidMaskIntervention
    from lit_interventions.interventions.rotation import RotatedSpaceIntervention

    for cls in (ConceptDictionary, LoReFTIntervention, GradientAttack, RandomSignIntervention, FGSM, PGD, RandomSign):
        assert cls.edits_base_alone is True and is_source_free(cls), cls
    for cls in (RotatedSpaceIntervention, SigmoidMaskIntervention):
        assert not is_source_free(cls), cls
