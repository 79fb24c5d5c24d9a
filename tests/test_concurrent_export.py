"""`lit-interventions export` run again and run twice at once into one --out: a rerun writes the
same bytes (every format), an export finds another's temporary files in --out and writes beside
them, and two exports started together both end with status 0 and leave whole files that load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.export.cli import main
from lit_interventions.modules.steering_baselines import LoRAModule
from tests.conftest import HIDDEN
from tests.helpers import ROOT

CONCEPTS = ["dogs", "rental services"]
STEMS = ["dogs", "rental-services"]
PEAKS = [2.0, 3.5]
HALF_WRITTEN = b"GGUF\x03\x00"  # the first bytes of a control vector, as a writer at work leaves them


VECTORS = torch.randn(len(CONCEPTS), HIDDEN, generator=torch.Generator().manual_seed(0))


def _dictionary(tiny_lm_dir, directory: Path) -> Path:
    Dictionary(VECTORS, torch.tensor(PEAKS), CONCEPTS, tiny_lm_dir("llama"), 2, "reft_r1").save_pretrained(directory)
    return directory


def _lora_run(tiny_lm_dir, directory: Path) -> Path:
    torch.manual_seed(0)
    module = LoRAModule(lm=tiny_lm_dir("llama"), rank=2, concept="cats")
    for p in module.adapter.values():  # B = 0 at init: weights of its own
        torch.nn.init.normal_(p, std=0.5)
    module.save(directory)
    return directory


def _files(out: Path) -> dict[str, bytes]:
    """Every file under `out` (its path relative to `out`) and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _vectors(out: Path) -> list[torch.Tensor]:
    """The one tensor of each control vector in `out`, read with gguf's own reader."""
    tensors = []
    for stem in STEMS:
        (tensor,) = gguf.GGUFReader(out / f"{stem}.gguf").tensors
        tensors.append(torch.from_numpy(tensor.data.copy()))
    return tensors


@pytest.mark.parametrize("to", ["gguf-control-vector", "lm-eval", "pyvene", "peft"])
def test_a_rerun_writes_the_same_bytes(tiny_lm_dir, tmp_path, to):
    artifact = (_lora_run if to == "peft" else _dictionary)(tiny_lm_dir, tmp_path / "artifact")
    exported = []
    for out in ("out", "out", "elsewhere"):  # again into the same --out, then into another
        main(["--artifact", str(artifact), "--to", to, "--out", str(tmp_path / out)])
        exported.append(_files(tmp_path / out))
    assert exported[0] and exported[0] == exported[1] == exported[2]


def test_an_export_writes_beside_the_temporary_files_of_another_at_work(tiny_lm_dir, tmp_path, capsys):
    artifact = _dictionary(tiny_lm_dir, tmp_path / "dict")
    out = tmp_path / "cv"
    out.mkdir()
    theirs = out / ".dogs.gguf.k3x9_q2a.tmp"  # another export's control vector, half written
    theirs.write_bytes(HALF_WRITTEN)
    main(["--artifact", str(artifact), "--to", "gguf-control-vector", "--out", str(out)])
    assert capsys.readouterr().out.split() == [str(out / f"{stem}.gguf") for stem in STEMS]
    assert sorted(p.name for p in out.iterdir()) == [theirs.name, "dogs.gguf", "rental-services.gguf"]
    assert theirs.read_bytes() == HALF_WRITTEN  # left to the export that writes it
    expected = [PEAKS[row] * VECTORS[row] for row in range(len(CONCEPTS))]  # factor 1 × max activation × w
    assert all(torch.equal(got, want) for got, want in zip(_vectors(out), expected, strict=True))


def test_two_exports_into_one_out_at_once_both_succeed_and_leave_whole_files(tiny_lm_dir, tmp_path):
    artifact = _dictionary(tiny_lm_dir, tmp_path / "dict")
    main(["--artifact", str(artifact), "--to", "gguf-control-vector", "--out", str(tmp_path / "alone")])
    for to, out in (("gguf-control-vector", tmp_path / "cv"), ("pyvene", tmp_path / "pv")):
        command = [sys.executable, "-m", "lit_interventions", "export", "--artifact", str(artifact), "--to", to]
        runs = [
            subprocess.Popen(
                [*command, "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(3)
        ]
        for run in runs:
            stdout, stderr = run.communicate(timeout=300)
            assert run.returncode == 0 and stderr == "", stderr
            assert len(stdout.splitlines()) == len(_files(out))  # each printed every file it wrote
        assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]  # no temporary file is left
    assert _files(tmp_path / "cv") == _files(tmp_path / "alone")
    assert all(torch.equal(a, b) for a, b in zip(_vectors(tmp_path / "cv"), _vectors(tmp_path / "alone")))
    for stem in STEMS:  # pyvene's weights, whole: they load
        (weights,) = (tmp_path / "pv" / stem).glob("intkey_*.bin")
        assert torch.load(weights, weights_only=True)
