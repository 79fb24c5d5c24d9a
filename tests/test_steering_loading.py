"""Loading LoReFT / LoRA steering modules: the class is the registered one a saved file names,
never a class path imported from the file; Lightning checkpoints are read with weights_only.

The crafted payloads write a marker file if they ever run; the tests require it to be absent
and the planted module not to be imported."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lit_interventions.artifacts.intervention_files import save_intervention, write_tensors
from lit_interventions.artifacts.pretrained import artifact_kind, from_pretrained
from lit_interventions.interventions.base import import_class, trusting_remote_code
from lit_interventions.interventions.registry import register_method
from lit_interventions.modules.steering_baselines import LoRAModule
from lit_interventions.modules.steering_loreft import LoReFTModule
from lit_interventions.modules.steering_registry import (
    CHECKPOINT_KEY,
    load_steering_checkpoint,
    registered_steering_modules,
)
from tests.helpers import run_command
from tests.test_loreft import _batches, _fit, _loss

PLANTED = "planted_steering_module"

ROOT = Path(__file__).resolve().parents[1]
REGISTERED = (
    "registered: loreft (lit_interventions.modules.steering_loreft.LoReFTModule), "
    "lora (lit_interventions.modules.steering_baselines.LoRAModule)"
)


def _plant(path: str) -> None:
    """What the planted pickle runs when unpickled."""
    Path(path).write_text("ran")


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (_plant, (str(self.marker),))


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module on sys.path that writes a marker when imported: (module name, marker)."""
    marker, code = tmp_path / "ran", tmp_path / "code"
    code.mkdir()
    (code / f"{PLANTED}.py").write_text(
        textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("imported")

        class Evil:
            @classmethod
            def from_export(cls, tensors, card, lm=None):
                pathlib.Path({str(marker)!r}).write_text("built")
        """)
    )
    monkeypatch.syspath_prepend(str(code))
    sys.modules.pop(PLANTED, None)
    yield PLANTED, marker
    sys.modules.pop(PLANTED, None)


def _crafted(directory: Path, config: dict | None, card: dict | None = None) -> Path:
    directory.mkdir()
    save_file({"weight": torch.ones(2, 2)}, directory / "intervention.safetensors")
    if config is not None:
        (directory / "config.json").write_text(json.dumps({"library_name": "lit-interventions", **config}))
    if card is not None:
        (directory / "intervention.json").write_text(json.dumps(card))
    return directory


def test_a_config_naming_an_unregistered_class_is_refused_and_nothing_is_imported(tmp_path, planted):
    name, marker = planted
    steering = {"kind": "steering", "weights": "intervention.safetensors", "method": "lora", "model": "tiny"}
    for class_path in (f"{name}.Evil", "os.system"):
        directory = _crafted(tmp_path / class_path, {**steering, "class_path": class_path})
        with pytest.raises(ValueError) as error:
            load_steering_checkpoint(directory)
        assert str(error.value) == (
            f"{directory / 'config.json'}: {class_path!r} is not a registered steering module, "
            f"so nothing was imported; {REGISTERED}; register yours (register_method(name, class_path)) or pass "
            "--trust_remote_code if you trust where it came from"
        )
        with pytest.raises(ValueError) as error:
            from_pretrained(directory)
        assert str(error.value) == (
            f"{directory / 'config.json'}: {class_path!r} is not a steering artifact this version loads "
            "(loreft, lora), so nothing was imported; a module of your own loads with "
            "lit_interventions.modules.steering_registry.load_steering_checkpoint"
        )
    old = _crafted(tmp_path / "old", None, {"method": f"{name}.Evil", "model": "tiny"})  # an old card's method
    with pytest.raises(ValueError, match=f"'{name}.Evil' is not a registered steering module"):
        load_steering_checkpoint(old)
    assert name not in sys.modules and not marker.exists()


def test_a_checkpoint_with_a_planted_pickle_is_refused_unrun(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "planted.ckpt"
    hparams = {"lm": "tiny", "layer": 0, "rank": 1}
    torch.save({"hyper_parameters": hparams, "state_dict": {}, CHECKPOINT_KEY: "loreft", "x": _Payload(marker)}, path)
    with pytest.raises(ValueError) as error:
        load_steering_checkpoint(path)
    assert str(error.value).startswith(f"{path} holds more than tensors and plain data (")
    assert f"{__name__}._plant" in str(error.value) and "weights_only=True" in str(error.value)
    assert not marker.exists()
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="is not a readable Lightning checkpoint"):
        load_steering_checkpoint(path)


def _same_weights(a, b) -> None:
    """The same method with the same exported weights (LoReFT: R, W, b; LoRA: the adapter)."""
    (mine, _), (theirs, _) = a.export(), b.export()
    assert a.method == b.method and mine.keys() == theirs.keys()
    for key, value in mine.items():
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=1e-6, msg=key)


def test_an_old_layout_directory_loads_to_the_same_weights(tiny_lm_dir, tmp_path):
    lm = tiny_lm_dir("llama")
    torch.manual_seed(0)
    loreft = LoReFTModule(lm=lm, layer=1, rank=2, concept="dogs")
    lora = LoRAModule(lm=lm, rank=2, concept="cats")
    for p in lora.adapter.values():  # B = 0 at init: give the adapter weights of its own
        torch.nn.init.normal_(p)
    for module in (loreft, lora):
        new, old = (tmp_path / f"{module.method}-{kind}" for kind in ("new", "old"))
        module.save(new)  # one card: config.json and the weights
        assert sorted(p.name for p in new.iterdir()) == ["README.md", "config.json", "intervention.safetensors"]
        tensors, card = module.export()  # the layout without config.json: intervention.json
        if module.method == "loreft":
            save_intervention(old, module.intervention, card)
        else:
            write_tensors(old, tensors, card)
        for directory in (new, old):
            loaded = load_steering_checkpoint(directory)
            _same_weights(loaded, module)
            assert (loaded.hparams.concept, loaded.method) == (module.hparams.concept, module.method)
    assert (
        artifact_kind(tmp_path / "lora-old") == "steering" and artifact_kind(tmp_path / "loreft-old") == "intervention"
    )
    _same_weights(from_pretrained(tmp_path / "lora-old"), lora)
    card = json.loads((tmp_path / "loreft-old" / "intervention.json").read_text())
    del card["class_path"], card["config"]  # a LoReFT card that names no intervention class
    (tmp_path / "loreft-old" / "intervention.json").write_text(json.dumps(card))
    assert artifact_kind(tmp_path / "loreft-old") == "steering"
    _same_weights(from_pretrained(tmp_path / "loreft-old"), loreft)


def test_lightning_checkpoints_load_by_recorded_name_or_by_hyper_parameters(tiny_lm_dir, tokenizer, tmp_path):
    lm, loader = tiny_lm_dir("llama"), _batches(tokenizer)
    for module in (LoReFTModule(lm=lm, layer=2, rank=2, lr=1e-1), LoRAModule(lm=lm, rank=2, lr=5e-2)):
        trainer = _fit(module, loader, tmp_path / module.method, steps=3)
        path = tmp_path / f"{module.method}.ckpt"
        trainer.save_checkpoint(path)
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint[CHECKPOINT_KEY] == module.method
        del checkpoint[CHECKPOINT_KEY]  # a checkpoint that records no name: its class by its hyper-parameters
        torch.save(checkpoint, tmp_path / f"{module.method}-unnamed.ckpt")
        for ckpt in (path, tmp_path / f"{module.method}-unnamed.ckpt"):
            loaded = load_steering_checkpoint(ckpt)
            _same_weights(loaded, module)
            assert _loss(loaded, loader) == pytest.approx(_loss(module, loader), abs=1e-6)


def test_the_registry_refuses_a_name_twice_and_a_bad_path():
    assert registered_steering_modules() == {
        "loreft": "lit_interventions.modules.steering_loreft.LoReFTModule",
        "lora": "lit_interventions.modules.steering_baselines.LoRAModule",
    }
    with pytest.raises(ValueError, match="method 'lora' is already registered"):
        register_method("lora", "lit_interventions.modules.steering_baselines.LoRAModule")
    with pytest.raises(ValueError, match="class_path='Evil' must be 'package.module.Class'"):
        register_method("evil", "Evil")


def test_trusting_remote_code_imports_the_class_a_checkpoint_names(tmp_path, planted):
    name, marker = planted
    steering = {"kind": "steering", "weights": "intervention.safetensors", "method": "x", "model": "tiny"}
    directory = _crafted(tmp_path / "trusted", {**steering, "class_path": f"{name}.Evil"})
    with trusting_remote_code():
        assert load_steering_checkpoint(directory) is None  # Evil.from_export ran
    assert marker.read_text() == "built"


@pytest.mark.parametrize("trust", [False, True])
def test_steer_takes_trust_remote_code_on_the_command_line(tmp_path, planted, trust):
    """`lit-interventions steer --checkpoint DIR`: a class path outside the registry is one error
    line with nothing imported; with --trust_remote_code true it is imported (the marker)."""
    name, marker = planted
    steering = {"kind": "steering", "weights": "intervention.safetensors", "method": "x", "model": "tiny"}
    directory = _crafted(tmp_path / "artifact", {**steering, "class_path": f"{name}.Evil"})
    done = run_command(
        "steer",
        f"--checkpoint={directory}",
        f"--out={tmp_path / 'out'}",
        *(["--trust_remote_code=true"] if trust else []),
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(marker.parent / "code")])},
    )
    assert done.returncode != 0  # the planted class builds nothing usable
    if trust:
        assert marker.read_text() == "built"
    else:
        assert done.returncode == 2 and not marker.exists()
        assert done.stderr.strip().splitlines() == [
            f"error: {directory / 'config.json'}: '{name}.Evil' is not a registered steering module, so nothing "
            f"was imported; {REGISTERED}; register yours (register_method(name, class_path)) or pass --trust_remote_code "
            "if you trust where it came from"
        ]


def test_the_class_path_older_loreft_run_configs_name_still_resolves():
    """Run configs written with configs/loreft.yaml name modules.steering_baselines.LoReFTModule;
    `validate --ckpt_path` of such a run reads that class path."""
    assert import_class("lit_interventions.modules.steering_baselines.LoReFTModule") is LoReFTModule
