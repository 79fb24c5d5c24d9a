"""CALM's method seam: an attack is a class with delta(probe, h, target, epsilon), named in the
config by a registered short name or by {name, class_path, init_args}; the random control always
runs, from its own seeded draws."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_interventions.cli.commands import main
from lit_interventions.interventions.attacks import (
    FGSM,
    PGD,
    Attack,
    RandomSign,
    attack_spec,
    build_attack,
    fgsm,
    pgd,
    random_sign,
    registered_attacks,
)
from lit_interventions.interventions.registry import MethodSpec
from lit_interventions.studies.calm import CalmArgs, choose_attacks, run_calm
from tests.helpers import CALM_SMALL

ROOT = Path(__file__).resolve().parents[1]
HERE = "tests.test_calm_seam"


class StandStill(Attack):
    """Moves nothing: δ = 0."""

    def delta(self, probe, h, target, epsilon):
        return torch.zeros_like(h)


class ScaledFGSM:
    """FGSM's δ times `scale` (1: FGSM exactly), a duck-typed attack that subclasses nothing."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def delta(self, probe, h, target, epsilon):
        return self.scale * fgsm(probe, h, target, epsilon)


class NoDelta:
    """Not an attack: it has no delta."""


def _blobs():
    g = torch.Generator().manual_seed(0)
    probe = torch.nn.Linear(8, 3)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(3, 8, generator=g))
    return probe, torch.randn(5, 8, generator=g), torch.tensor([0, 1, 2, 0, 1])


def test_the_classes_compute_what_the_functions_do():
    probe, h, target = _blobs()
    torch.testing.assert_close(FGSM().delta(probe, h, target, 0.3), fgsm(probe, h, target, 0.3), rtol=0, atol=0)
    torch.testing.assert_close(
        PGD(alpha=0.05, steps=4).delta(probe, h, target, 0.3), pgd(probe, h, target, 0.3, 0.05, 4), rtol=0, atol=0
    )
    control, generator = RandomSign(seed=7), torch.Generator().manual_seed(7)
    for _ in range(3):  # one generator, seeded once: the draws follow each other
        torch.testing.assert_close(control.delta(probe, h, target, 0.3), random_sign(h, 0.3, generator), rtol=0, atol=0)
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        PGD(steps=0)
    with pytest.raises(ValueError, match="alpha=-1 must be > 0"):
        PGD(alpha=-1)


def test_short_names_and_configs_give_specs():
    assert registered_attacks()[:3] == ["fgsm", "pgd", "random"]
    assert attack_spec("pgd") == MethodSpec("pgd", "lit_interventions.interventions.attacks.PGD")
    entry = {"name": "still", "class_path": f"{HERE}.StandStill"}
    assert attack_spec(entry) == MethodSpec("still", f"{HERE}.StandStill")
    built = build_attack(attack_spec(entry))  # this file imported again by its class path: compare by name
    assert type(built).__name__ == "StandStill" and isinstance(built, Attack)
    with pytest.raises(ValueError, match=r"Unknown attack 'cw'; registered: fgsm, pgd, random"):
        attack_spec("cw")
    with pytest.raises(ValueError, match=r"\{name, class_path, init_args\}; got \['class_path', 'lr', 'name'\]"):
        attack_spec({"name": "x", "class_path": "a.B", "lr": 0.1})


def test_the_run_settings_are_defaults_that_init_args_override():
    defaults = {"alpha": None, "steps": 3, "seed": 5}
    entry = {"name": "long", "class_path": "lit_interventions.interventions.attacks.PGD", "init_args": {"steps": 7}}
    specs = choose_attacks(["pgd", entry, "fgsm"], defaults)
    assert [(s.name, s.init_args) for s in specs] == [
        ("pgd", {"alpha": None, "steps": 3}),
        ("long", {"alpha": None, "steps": 7}),
        ("fgsm", {}),  # FGSM takes neither alpha, steps nor seed
        ("random", {"seed": 5}),  # the control, always last
    ]
    assert [s.name for s in choose_attacks(None, defaults)] == ["fgsm", "pgd", "random"]


@pytest.mark.parametrize(
    "methods,match",
    [
        (["random"], "'random' is the control, which always runs"),
        (["pgd", {"name": "pgd", "class_path": f"{HERE}.StandStill"}], "name a method twice"),
        ([], "names no attack"),
        ([{"name": "x", "class_path": f"{HERE}.NoDelta"}], "has no delta"),
        ([{"name": "x", "class_path": f"{HERE}.ScaledFGSM", "init_args": {"size": 2}}], "unexpected keyword"),
        ([{"name": "x", "class_path": "tests.nope.Attack"}], "cannot be imported"),
    ],
)
def test_bad_methods_are_refused(methods, match):
    with pytest.raises(ValueError, match=match):
        choose_attacks(methods, {"alpha": None, "steps": 40, "seed": 0})


def test_run_calm_takes_a_calm_args_or_keywords():
    with pytest.raises(ValueError, match="run_calm has no setting stepz; the settings are lm, dtype"):
        run_calm(CalmArgs(), stepz=3)


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_an_attack_of_this_file_runs_from_a_yaml_alone(tmp_path, tiny_lm_dir):
    """`python -m lit_interventions calm --config FILE`: a class of this test module, named only in
    the YAML, is run beside the registered attacks."""
    config = {
        "lm": tiny_lm_dir("llama"),
        "tasks": ["Country"],
        "out": str(tmp_path / "out"),
        "methods": [
            "fgsm",
            {"name": "same_as_fgsm", "class_path": f"{HERE}.ScaledFGSM", "init_args": {"scale": 1.0}},
            {"name": "still", "class_path": f"{HERE}.StandStill"},
        ],
        **CALM_SMALL,
    }
    path = tmp_path / "calm.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "lit_interventions", "calm", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = _rows(tmp_path / "out" / "results.csv")
    by = {(r["method"], r["property"]): r for r in results}
    assert sorted({r["method"] for r in results}) == ["fgsm", "random", "same_as_fgsm", "still"]
    for prop in ("Country", "Continent", "Language"):
        fgsm_row, same = by[("fgsm", prop)], by[("same_as_fgsm", prop)]
        assert {k: v for k, v in same.items() if k != "method"} == {k: v for k, v in fgsm_row.items() if k != "method"}
        still = by[("still", prop)]  # δ = 0: the probe reads the clean state, the LM answers as before
        assert still["probe_acc_after"] == still["probe_acc_before"]
        assert still["collateral_acc_after"] == still["collateral_acc_before"]
        assert float(still["top1_changed"]) == 0.0 and float(still["mean_topk_overlap"]) == 1.0
    summary = {r["method"]: r for r in _rows(tmp_path / "out" / "summary.csv")}
    still = summary["still"]  # do-nothing: the causal property scores 0, the two others 1
    assert (still["competence_causal"], still["competence_environmental"]) == ("0.0", "1.0")
    assert float(still["competence"]) == torch.tensor(2 / 3).item()  # (m − 1)/m, m = 3, in float32
    assert {k: v for k, v in summary["same_as_fgsm"].items() if k != "method"} == {
        k: v for k, v in summary["fgsm"].items() if k != "method"
    }


def test_a_bad_method_entry_is_one_error_line_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calm", "--methods", "[fgsm, {name: x, class_path: tests.nope.Attack}]"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: class_path='tests.nope.Attack' cannot be imported"), err
