"""A class path read from a saved artifact is data: loading never imports or runs what a crafted
file names unless the caller trusts it, and weights are read only from inside the artifact.

Each crafted payload writes a marker file when it runs; the tests require the marker to be absent
(and the planted module not to be imported), so they fail if a payload ever runs.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from lit_interventions.artifacts.intervention_files import (
    CARD,
    load_intervention,
    load_pretrained,
    pretrained_intervention,
    save_intervention,
    save_pretrained,
)
from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.interventions import base
from lit_interventions.interventions.attacks import GradientAttack
from lit_interventions.interventions.base import loadable_class, register_intervention, registered_interventions
from lit_interventions.interventions.compose import Composition
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention
from lit_interventions.modules.probe import ProbeModule

PAYLOAD = "planted_payload_module"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module on sys.path that writes a marker when imported and whose class writes it when
    built: (module name, marker path)."""
    marker = tmp_path / "ran"
    source = tmp_path / "code"
    source.mkdir()
    (source / f"{PAYLOAD}.py").write_text(
        textwrap.dedent(f"""
        import pathlib
        import torch
        pathlib.Path({str(marker)!r}).write_text("imported")

        class Evil(torch.nn.Module):
            trains = False

            @classmethod
            def from_tensors(cls, tensors, **config):
                pathlib.Path({str(marker)!r}).write_text("built")
                return cls()
        """)
    )
    monkeypatch.syspath_prepend(str(source))
    monkeypatch.setattr(base, "_REGISTERED", dict(base._REGISTERED))  # a registration here stays here
    sys.modules.pop(PAYLOAD, None)
    yield PAYLOAD, marker
    sys.modules.pop(PAYLOAD, None)


def _saved(tmp_path):
    directory = tmp_path / "artifact"
    save_pretrained(directory, FixedSubspaceIntervention(torch.eye(4)[:1]), {"model": "tiny"})
    return directory


def _rewrite(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_foreign_class_path_in_config_json_is_refused_before_it_is_imported(tmp_path, planted):
    module, marker = planted
    directory = _saved(tmp_path)
    _rewrite(directory / "config.json", class_path=f"{module}.Evil")
    with pytest.raises(ValueError, match=rf"class_path '{module}.Evil' is not a registered class") as error:
        load_pretrained(directory)
    assert "trust_remote_code=True" in str(error.value)
    assert not marker.exists() and module not in sys.modules


def test_subprocess_popen_as_the_class_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    directory = _saved(tmp_path)
    _rewrite(directory / "config.json", class_path="subprocess.Popen", config={"args": ["touch", str(marker)]})
    with pytest.raises(ValueError, match="'subprocess.Popen' is not a registered class"):
        load_pretrained(directory)
    assert not marker.exists()


def test_the_old_card_and_from_pretrained_refuse_it_too(tmp_path, planted):
    module, marker = planted
    save_intervention(tmp_path, RotatedSpaceIntervention(4, 1), {})
    _rewrite(tmp_path / CARD, class_path=f"{module}.Evil")
    with pytest.raises(ValueError, match="not a registered class"):
        load_intervention(tmp_path)
    with pytest.raises(ValueError, match="not a registered class"):
        pretrained_intervention(RotatedSpaceIntervention, tmp_path)
    assert not marker.exists() and module not in sys.modules


def test_a_nested_part_of_a_composition_is_checked_the_same_way(tmp_path, planted):
    module, marker = planted
    composed = Composition([FixedSubspaceIntervention(torch.eye(4)[:1]), FixedSubspaceIntervention(torch.eye(4)[1:2])])
    directory = tmp_path / "composed"
    save_pretrained(directory, composed, {})
    config = json.loads((directory / "config.json").read_text())
    config["config"]["parts"][1]["class_path"] = f"{module}.Evil"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"Composition part 1: class_path '{module}.Evil' is not a registered"):
        load_pretrained(directory)
    assert not marker.exists() and module not in sys.modules
    assert isinstance(load_pretrained(_saved(tmp_path)), FixedSubspaceIntervention)  # ours still load


def test_trust_remote_code_imports_it_and_a_registered_class_needs_no_flag(tmp_path, planted):
    module, marker = planted
    directory = _saved(tmp_path)
    _rewrite(directory / "config.json", class_path=f"{module}.Evil", config={})
    loaded = load_pretrained(directory, trust_remote_code=True)
    assert type(loaded).__name__ == "Evil" and marker.read_text() == "built"

    marker.unlink()
    register_intervention(loaded.__class__)
    assert f"{module}.Evil" in registered_interventions()
    assert type(load_pretrained(directory)).__name__ == "Evil" and marker.read_text() == "built"


def test_the_projects_own_classes_resolve_without_a_flag_and_other_project_paths_do_not():
    assert loadable_class("lit_interventions.interventions.mask.SigmoidMaskIntervention", "x").__name__ == (
        "SigmoidMaskIntervention"
    )
    with pytest.raises(ValueError, match="'lit_interventions.core.files.Path' is not a registered class"):
        loadable_class("lit_interventions.core.files.Path", "x")  # importable, but not an artifact class
    with pytest.raises(ValueError, match="must be a dotted class path string"):
        loadable_class(["a"], "x")


@pytest.mark.parametrize("weights", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/w.safetensors", ".."])
def test_weights_outside_the_artifact_directory_are_refused(tmp_path, weights):
    outside = tmp_path / "outside.safetensors"
    save_file({"basis": torch.ones(1, 4)}, outside)
    directory = _saved(tmp_path)
    _rewrite(directory / "config.json", weights=weights)
    with pytest.raises(ValueError, match=rf"weights='{weights}' must be a file name inside"):
        load_pretrained(directory)


def test_a_saved_attacks_probe_class_is_checked_the_same_way(tmp_path, planted):
    module, marker = planted
    probe = ProbeModule(["a", "b"], "toy", 0, 4)
    directory = tmp_path / "attack"
    save_pretrained(directory, GradientAttack.fgsm(probe, 0.1), {})
    assert isinstance(load_pretrained(directory).probe, ProbeModule)  # ours loads without a flag
    config = json.loads((directory / "config.json").read_text())
    config["config"]["probe"] = f"{module}.Evil"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"GradientAttack probe: class_path '{module}.Evil' is not a registered"):
        load_pretrained(directory)
    assert not marker.exists() and module not in sys.modules


def test_from_pretrained_refuses_it_and_takes_the_trust_flag(tmp_path, planted):
    module, marker = planted
    directory = _saved(tmp_path)
    _rewrite(directory / "config.json", class_path=f"{module}.Evil", config={})
    with pytest.raises(ValueError, match="not a registered class"):
        from_pretrained(directory)
    assert not marker.exists() and module not in sys.modules
    assert type(from_pretrained(directory, trust_remote_code=True)).__name__ == "Evil"
