"""CALM's method seam: an attack is a source-free intervention whose forward takes the attack's
context, forward(h, probe=g_Z, target=z′, epsilon=ε) -> h′, named in the config by a registered
name or by {name, model: {class_path, init_args}}; the random control (random_sign) always runs,
from its own seeded draws."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lit_interventions.cli.commands import main
from lit_interventions.interventions.attacks import FGSM, PGD, RandomSign, fgsm, pgd, random_sign
from lit_interventions.interventions.base import Intervention
from lit_interventions.interventions.capabilities import intervene
from lit_interventions.interventions.registry import MethodSpec, method_entry, method_spec, registered_methods
from lit_interventions.studies.calm import CalmArgs, build_attack, choose_attacks, run_calm
from tests.helpers import CALM_SMALL

ROOT = Path(__file__).resolve().parents[1]
HERE = "tests.test_calm_seam"
ATTACKS = "lit_interventions.interventions.attacks"


class StandStill(Intervention):
    """Moves nothing: h′ = h."""

    edits_base_alone = True

    def forward(self, base, source=None, *, probe, target, epsilon):
        return base


class HalfFGSM(nn.Module):
    """FGSM at half the radius, h′ = h − (ε/2)·sign(∇_h L(g_Z(h), z′)): a torch module that
    declares the protocol's attributes and subclasses no project class."""

    edits_base_alone, trains = True, False

    def forward(self, base, source=None, *, probe, target, epsilon):
        return base + fgsm(probe, base, target, epsilon / 2)


class Swap(Intervention):
    """Not an attack: an interchange, f* = f(s)."""

    def forward(self, base, source=None, **context):
        return self._require_source(source)


def _blobs():
    g = torch.Generator().manual_seed(0)
    probe = torch.nn.Linear(8, 3)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(3, 8, generator=g))
    return probe, torch.randn(5, 8, generator=g), torch.tensor([0, 1, 2, 0, 1])


def test_the_classes_compute_what_the_functions_do():
    probe, h, target = _blobs()
    context = {"probe": probe, "target": target, "epsilon": 0.3}
    torch.testing.assert_close(intervene(FGSM(), h, **context), h + fgsm(probe, h, target, 0.3), rtol=0, atol=0)
    torch.testing.assert_close(
        intervene(PGD(alpha=0.05, steps=4), h, **context), h + pgd(probe, h, target, 0.3, 0.05, 4), rtol=0, atol=0
    )
    control, generator = RandomSign(seed=7), torch.Generator().manual_seed(7)
    for _ in range(3):  # one generator, seeded once: the draws follow each other
        torch.testing.assert_close(intervene(control, h, **context), h + random_sign(h, 0.3, generator), rtol=0, atol=0)
    for attack in (FGSM(), PGD(steps=2), RandomSign(seed=7)):
        assert attack.edits_base_alone and not attack.trains
        with pytest.raises(ValueError, match="edits base alone: source must be None"):
            attack(h, h, **context)
    with pytest.raises(ValueError, match="steps=0 must be an int >= 1"):
        PGD(steps=0)
    with pytest.raises(ValueError, match="alpha=-1 must be > 0"):
        PGD(alpha=-1)


def test_names_and_entries_give_specs():
    names = registered_methods()
    assert names[names.index("fgsm") : names.index("fgsm") + 3] == ["fgsm", "pgd", "random_sign"]
    assert method_spec("fgsm") == MethodSpec("fgsm", f"{ATTACKS}.FGSM")
    assert method_spec("pgd") == MethodSpec("pgd", f"{ATTACKS}.PGD")
    assert method_spec("random_sign") == MethodSpec("random_sign", f"{ATTACKS}.RandomSign")
    entry = {"name": "still", "model": {"class_path": f"{HERE}.StandStill"}}
    assert method_entry(entry) == MethodSpec("still", f"{HERE}.StandStill")
    built = build_attack(method_entry(entry))  # this file imported again by its class path: compare by name
    assert type(built).__name__ == "StandStill"
    with pytest.raises(ValueError, match=r"Unknown method 'cw'; registered: .*fgsm, pgd, random_sign"):
        method_entry("cw")


def test_the_run_settings_are_defaults_that_init_args_override():
    defaults = {"alpha": None, "steps": 3, "seed": 5}
    entry = {"name": "long", "model": {"class_path": f"{ATTACKS}.PGD", "init_args": {"steps": 7}}}
    specs = choose_attacks(["pgd", entry, "fgsm"], defaults)
    assert [(s.name, s.init_args) for s in specs] == [
        ("pgd", {"alpha": None, "steps": 3}),
        ("long", {"alpha": None, "steps": 7}),
        ("fgsm", {}),  # FGSM takes neither alpha, steps nor seed
        ("random_sign", {"seed": 5}),  # the control, always last
    ]
    assert [s.name for s in choose_attacks(None, defaults)] == ["fgsm", "pgd", "random_sign"]


@pytest.mark.parametrize(
    "methods,match",
    [
        (["random_sign"], "'random_sign' is the control, which always runs"),
        (
            ["random"],
            "RandomDirection is not an attack \\(CALM's random control is 'random_sign', which always runs\\)",
        ),
        (["pgd", {"name": "pgd", "model": {"class_path": f"{HERE}.StandStill"}}], "name a method twice"),
        ([], "names no attack"),
        ([{"name": "x", "model": {"class_path": f"{HERE}.Swap"}}], "tests.test_calm_seam.Swap is not an attack"),
        ([{"name": "x", "model": {"class_path": "tests.helpers.ROOT"}}], "is not a class"),
        (
            [{"name": "x", "model": {"class_path": f"{HERE}.HalfFGSM", "init_args": {"size": 2}}}],
            "unexpected keyword",
        ),
        ([{"name": "x", "model": {"class_path": "tests.nope.Attack"}}], "cannot be imported"),
        (
            [{"name": "x", "class_path": f"{ATTACKS}.PGD", "init_args": {"steps": 3}}],
            rf"method 'x': \{{name, class_path, init_args\}} is written \{{name: x, model: \{{class_path: {ATTACKS}.PGD, "
            r"init_args: \{steps: 3\}\}\}$",
        ),
    ],
)
def test_bad_methods_are_refused(methods, match):
    with pytest.raises(ValueError, match=match):
        choose_attacks(methods, {"alpha": None, "steps": 40, "seed": 0})


def test_an_attack_that_returns_another_shape_is_refused_by_name(tiny_lm_dir, tmp_path):
    entry = {"name": "first_row", "model": {"class_path": f"{HERE}.FirstRow"}}
    with pytest.raises(ValueError, match=r"method 'first_row': forward\(h, probe=, target=, epsilon=\) returned \(1, "):
        run_calm(lm=tiny_lm_dir("llama"), tasks=["Country"], methods=[entry], out=str(tmp_path), **CALM_SMALL)


class FirstRow(StandStill):
    """Returns h's first row alone: a bad shape."""

    def forward(self, base, source=None, *, probe, target, epsilon):
        return base[:1]


def test_run_calm_takes_a_calm_args_or_keywords():
    with pytest.raises(ValueError, match="run_calm has no setting stepz; the settings are lm, dtype"):
        run_calm(CalmArgs(), stepz=3)


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_users_attack_runs_from_a_yaml_alone_in_the_console_script(tmp_path, tiny_lm_dir):
    """`lit-interventions calm --config FILE`: a user's attack class (`tests/user_methods.py`, on
    the user's PYTHONPATH), named only in the YAML by {name, model}, runs beside the registered
    ones; s = 1 gives FGSM's rows exactly, s = 0 the do-nothing scores."""
    user = "tests.user_methods.ScaledFGSM"
    config = {
        "lm": tiny_lm_dir("llama"),
        "tasks": ["Country"],
        "out": str(tmp_path / "out"),
        "methods": [
            "fgsm",
            {"name": "same_as_fgsm", "model": {"class_path": user, "init_args": {"scale": 1.0}}},
            {"name": "still", "model": {"class_path": user, "init_args": {"scale": 0.0}}},
        ],
        **CALM_SMALL,
    }
    path = tmp_path / "calm.yaml"
    path.write_text(yaml.safe_dump(config))
    script = Path(sys.executable).parent / "lit-interventions"
    done = subprocess.run(
        [str(script), "calm", "--config", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = _rows(tmp_path / "out" / "results.csv")
    by = {(r["method"], r["property"]): r for r in results}
    assert [r["method"] for r in results[::3]] == ["fgsm", "same_as_fgsm", "still", "random_sign"]  # control last
    for prop in ("Country", "Continent", "Language"):
        fgsm_row, same = by[("fgsm", prop)], by[("same_as_fgsm", prop)]
        assert {k: v for k, v in same.items() if k != "method"} == {k: v for k, v in fgsm_row.items() if k != "method"}
        still = by[("still", prop)]  # h′ = h: the probe reads the clean state, the LM answers as before
        assert still["probe_acc_after"] == still["probe_acc_before"]
        assert still["collateral_acc_after"] == still["collateral_acc_before"]
        assert float(still["top1_changed"]) == 0.0 and float(still["mean_topk_overlap"]) == 1.0
        assert float(fgsm_row["target_success"]) > float(still["target_success"])  # FGSM moves the probe
    summary = {r["method"]: r for r in _rows(tmp_path / "out" / "summary.csv")}
    still = summary["still"]  # do-nothing: the causal property scores 0, the two others 1
    assert (still["competence_causal"], still["competence_environmental"]) == ("0.0", "1.0")
    assert float(still["competence"]) == torch.tensor(2 / 3).item()  # (m − 1)/m, m = 3, in float32
    assert {k: v for k, v in summary["same_as_fgsm"].items() if k != "method"} == {
        k: v for k, v in summary["fgsm"].items() if k != "method"
    }


def test_a_module_that_declares_the_protocol_runs_as_an_attack(tiny_lm_dir, tmp_path):
    """`HalfFGSM` subclasses no project class; it runs, and its h′ moves half as far as FGSM's."""
    probe, h, target = _blobs()
    half = build_attack(method_entry({"name": "half", "model": {"class_path": f"{HERE}.HalfFGSM"}}))
    moved = intervene(half, h, probe=probe, target=target, epsilon=0.3)
    torch.testing.assert_close(moved, h + fgsm(probe, h, target, 0.15), rtol=0, atol=0)
    entry = {"name": "half", "model": {"class_path": f"{HERE}.HalfFGSM"}}
    summary = run_calm(lm=tiny_lm_dir("llama"), tasks=["Country"], methods=[entry], out=str(tmp_path), **CALM_SMALL)
    assert [row["method"] for row in summary] == ["half", "random_sign"]


@pytest.mark.parametrize(
    "entry,line",
    [
        (
            "{name: x, model: {class_path: tests.nope.Attack}}",
            "error: class_path='tests.nope.Attack' cannot be imported",
        ),
        (  # the form {name, class_path, init_args}: refused, with the form it is written in
            "{name: x, class_path: tests.nope.Attack}",
            "error: method 'x': {name, class_path, init_args} is written {name: x, model: {class_path: tests.nope.Attack}}",
        ),
    ],
)
def test_a_bad_method_entry_is_one_error_line_with_exit_2(capsys, entry, line):
    with pytest.raises(SystemExit) as exit_info:
        main(["calm", "--methods", f"[fgsm, {entry}]"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
