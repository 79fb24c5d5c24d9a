"""Every model card's "Use" section runs as written (once REPO_OR_DIRECTORY names the artifact):
its `lit-interventions generate` command and its Python `apply` call, for a concept dictionary
and for an interchange intervention."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.modules.steering_baselines import LoRAModule
from tests.conftest import HIDDEN
from tests.helpers import ROOT, run_command


def _saved(kind: str, directory, lm_dir: str):
    if kind == "dictionary":
        Dictionary(
            vectors=torch.eye(HIDDEN)[:2],
            max_activations=torch.tensor([1.0, 2.0]),
            concepts=["dogs", "keys"],
            model=lm_dir,
            layer=1,
            method="diffmean",
        ).save_pretrained(directory)
    elif kind == "lora":
        LoRAModule(lm=lm_dir, rank=2).save(directory)
    else:
        card = {"model": lm_dir, "layer": 1}
        if kind == "causalgym":  # a CausalGym run records a pair of its data and the site's spans
            card["example"] = {
                "prompt": "The dog is here",
                "source": "The keys are here",
                "span": "dog",
                "source_span": "keys",
            }
        save_pretrained(directory, RotatedSpaceIntervention(HIDDEN, 1), card)
    return (directory / "README.md").read_text()


def _blocks(card: str, language: str, directory) -> list[str]:
    found = re.findall(rf"```{language}\n(.*?)```", card, flags=re.S)
    return [block.replace("REPO_OR_DIRECTORY", str(directory)) for block in found]


@pytest.mark.parametrize("kind", ["dictionary", "intervention", "causalgym", "lora"])
def test_card_generate_command_runs_as_written(tmp_path, tiny_lm_dir, kind):
    card = _saved(kind, tmp_path / "artifact", tiny_lm_dir("llama"))
    commands = [line for block in _blocks(card, "bash", tmp_path / "artifact") for line in block.splitlines()]
    generate = next(line for line in commands if line.startswith("lit-interventions generate"))
    serves = any(line.startswith("lit-interventions serve --artifact") for line in commands)
    assert serves == (kind in ("dictionary", "lora"))  # serve takes steering artifacts
    if kind == "dictionary":
        assert "--concept dogs --factor 1.0" in generate
    elif kind == "intervention":
        assert "--source 'The authors near the keys'" in generate
    elif kind == "lora":
        assert generate.endswith("--prompt 'Write one sentence about your day.'")
    else:
        assert "--source 'The keys are here' --span dog --source_span keys" in generate
    done = run_command(*shlex.split(generate)[1:], "--max_new_tokens", "3", "--json")
    assert done.returncode == 0, done.stderr
    steering = "Write one sentence about your day."
    prompt = {"dictionary": steering, "lora": steering, "causalgym": "The dog is here"}.get(
        kind, "The author near the keys"
    )
    assert done.stdout.strip().startswith(f'{{"prompt": "{prompt}", "unsteered": ')


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dictionary", "causalgym"])
def test_card_python_call_runs_as_written(tmp_path, tiny_lm_dir, kind):
    card = _saved(kind, tmp_path / "artifact", tiny_lm_dir("llama"))
    (code,) = [block for block in _blocks(card, "python", tmp_path / "artifact") if "apply(" in block]
    code = code.replace("max_new_tokens=20", "max_new_tokens=3")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # the decoded generation
