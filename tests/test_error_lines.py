"""Bad files and settings given to a command are one `error:` line on stderr, exit status 2, no
traceback, before the frozen LM's weights load: a template file that is not UTF-8, bad JSON in
AxBench and RAVEL files, damaged and crafted checkpoints, truncated weights, a checkpoint without
its run's config, a hub id without network, an output directory that cannot be written.

The subprocess tests run the commands as a user does (`python -m lit_interventions ...`,
`python train.py ...`); the others call the same entry point (`commands.main`) in-process, with
the LM's weight loading made to fail the test if it is reached. The crafted pickles write a
marker file if they ever run; the tests require it to be absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR as AXBENCH_DIR
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL
from lit_interventions.datamodules.templates import BUILTIN_TEMPLATES
from safetensors.torch import save_file

from lit_interventions.artifacts.checkpoint_io import read_checkpoint
from lit_interventions.artifacts.intervention_files import save_pretrained
from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.cli.commands import main
from lit_interventions.cli.lightning import _checkpoint_config
from lit_interventions.core import lm
from lit_interventions.interventions.rotation import FixedSubspaceIntervention
from lit_interventions.modules.probe import load_probe
from lit_interventions.modules.steering_registry import load_steering_checkpoint
from tests.helpers import free_port, run_command

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model.layer=1", "--data.train_pairs=4", "--data.eval_pairs=2"]


# ----------------------------------------------------------------------------- helpers


def _one_line(done: subprocess.CompletedProcess) -> str:
    """The one stderr line of a command that failed on bad input (exit 2), without `error: `."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


def _main_line(argv: list[str], capsys) -> str:
    """The same, for `lit-interventions ARGV` called in-process."""
    capsys.readouterr()  # what came before (a fixture's model being written)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


@pytest.fixture
def no_weights(monkeypatch):
    """Reaching the frozen LM's weights fails the test (bad input must be found before)."""
    monkeypatch.setattr(lm, "_load_lm", lambda *a, **k: pytest.fail("the LM's weights were loaded"))


class _Payload:
    """Unpickled, it runs `exec` of code that writes the marker."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _crafted_ckpt(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {}, "hyper_parameters": {"lm": "x"}, "planted": _Payload(marker)}, path)
    return path


def _damaged_ckpt(path: Path) -> Path:
    """A Lightning-like checkpoint whose pickle record has bytes overwritten: still a zip file."""
    torch.save({"state_dict": {"w": torch.ones(3)}, "hyper_parameters": {"lm": "x"}}, path)
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    local = info.header_offset  # the local header: its name and extra field lengths at bytes 26 and 28
    start = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little")
    start += int.from_bytes(data[local + 28 : local + 30], "little")  # the record's first byte
    data[start + 2 : start + 12] = b"\xfe" * 10
    path.write_bytes(bytes(data))
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ----------------------------------------------------------------------------- 1. templates not UTF-8


def _latin1_templates(tmp_path: Path) -> Path:
    tasks = json.loads(BUILTIN_TEMPLATES.read_text())
    text = json.dumps({"agr_sv_num_pp": tasks["agr_sv_num_pp"]}, ensure_ascii=False).replace("The", "Thé", 1)
    path = tmp_path / "latin1.json"
    path.write_bytes(text.encode("latin-1"))
    return path


def test_a_latin1_template_file_is_one_line_through_train_py(tmp_path, tiny_lm_dir):
    path = _latin1_templates(tmp_path)
    byte = path.read_bytes().index(b"\xe9")
    done = run_command(
        "train.py",
        "fit",
        "--config",
        "das.yaml",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        f"--data.templates={path}",
        f"--trainer.default_root_dir={tmp_path / 'runs'}",
    )
    assert _one_line(done) == f"Malformed template file {path}: not UTF-8 text (byte {byte}); save it as UTF-8"
    assert not (tmp_path / "runs").exists()


def test_bad_json_in_a_template_file_names_the_line(tmp_path, tiny_lm_dir, capsys, no_weights):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "agr_sv_num_pp": {\n    "templates": [x]\n  }\n}\n')
    argv = ["fit", "--config", "das.yaml", f"--model.lm={tiny_lm_dir('gpt2')}", f"--data.templates={path}"]
    assert _main_line(argv, capsys) == (
        f"Malformed template file {path}: not valid JSON at line 3, column 19 (Expecting value)"
    )


# ----------------------------------------------------------------------------- 2. AxBench and RAVEL JSON


def _concepts(tmp_path: Path, damaged: str, line: int) -> Path:
    """A copy of the built-in concept directory with line `line` of `damaged` cut short."""
    out = tmp_path / "concepts"
    out.mkdir()
    for name in ("metadata.jsonl", "train_data.jsonl", "latent_eval_data.jsonl"):
        lines = (AXBENCH_DIR / name).read_text().split("\n")
        if name == damaged:
            lines[line - 1] = lines[line - 1][:-5]
        (out / name).write_text("\n".join(lines))
    return out


@pytest.mark.parametrize("damaged", ["metadata.jsonl", "train_data.jsonl", "latent_eval_data.jsonl"])
def test_bad_json_in_an_axbench_file_names_the_file_and_line(tmp_path, tiny_lm_dir, capsys, no_weights, damaged):
    directory = _concepts(tmp_path, damaged, line=2)
    cut = (directory / damaged).read_text().split("\n")[1]
    column = cut.rindex('"') + 1  # the string left open by the cut
    argv = ["fit", "--config", "diffmean.yaml", f"--model.lm={tiny_lm_dir('llama')}", "--model.layer=1"]
    line = _main_line([*argv, f"--data.concept_dir={directory}"], capsys)
    assert line == (
        f"{directory / damaged}, line 2: not valid JSON at column {column} (Unterminated string starting at); "
        "fix the line or download the data again"
    )


def test_a_damaged_axbench_parquet_is_named(tmp_path):
    from lit_interventions.datamodules.axbench_files import load_concepts

    directory = _concepts(tmp_path, "none", 1)
    (directory / "train_data.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(ValueError, match=rf"^{directory / 'train_data.parquet'} is not a readable parquet file \("):
        load_concepts(directory)


def _ravel(tmp_path: Path) -> Path:
    out = tmp_path / "ravel"
    out.mkdir()
    for path in BUILTIN_RAVEL.glob("*.json"):
        (out / path.name).write_text(path.read_text())
    return out


def test_bad_json_in_a_ravel_file_names_the_file_and_line(tmp_path, tiny_lm_dir, capsys, no_weights):
    directory = _ravel(tmp_path)
    path = directory / "ravel_city_entity_attributes.json"
    text = path.read_text()
    path.write_text(text.replace('"Lyon"', 'x"Lyon"', 1))
    row = text[: text.index('"Lyon"')].count("\n") + 1
    column = text.index('"Lyon"') - text.rindex("\n", 0, text.index('"Lyon"'))
    argv = ["fit", "--config", "ravel/das.yaml", f"--model.lm={tiny_lm_dir('llama')}", "--model.layer=1", "--model.k=4"]
    assert _main_line([*argv, f"--data.ravel_dir={directory}"], capsys) == (
        f"{path}: not valid JSON at line {row}, column {column} (Expecting property name enclosed in double quotes); "
        "restore the file or download RAVEL again"
    )
    path.write_bytes(text.replace("Paris", "Pâris", 1).encode("latin-1"))
    line = _main_line([*argv, f"--data.ravel_dir={directory}"], capsys)
    assert line == f"{path}: not UTF-8 text (byte {text.index('Paris') + 1}); save it as UTF-8"


# ----------------------------------------------------------------------------- 3. damaged and crafted checkpoints


@pytest.mark.parametrize("stage", ["fit", "validate", "test"])
def test_a_damaged_checkpoint_is_one_line_before_anything_loads(tmp_path, capsys, no_weights, stage):
    damaged = _damaged_ckpt(tmp_path / "damaged.ckpt")
    garbage = tmp_path / "random.ckpt"
    garbage.write_bytes(bytes(range(256)) * 8)
    for path, words in ((damaged, "(damaged: UnpicklingError: "), (garbage, "(truncated, or another kind of file)")):
        line = _main_line([stage, "--config", "das.yaml", "--ckpt_path", str(path)], capsys)
        assert line.startswith(f"--ckpt_path {path} is not a readable Lightning checkpoint {words}"), line
        assert line.endswith("; use a .ckpt file a run wrote (RUN/checkpoints/), from a source you trust")


def test_a_crafted_checkpoint_is_refused_unrun_by_the_console_script(tmp_path):
    marker = tmp_path / "ran"
    path = _crafted_ckpt(tmp_path / "planted.ckpt", marker)
    done = run_command("test", "--config", "das.yaml", "--ckpt_path", str(path))
    assert _one_line(done) == (
        f"--ckpt_path {path} holds more than tensors and plain data (it names exec); it is read with "
        "weights_only=True and never unpickled further, so nothing in it ran; use a .ckpt file a run wrote "
        "(RUN/checkpoints/), from a source you trust"
    )
    assert not marker.exists()


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_crafted_checkpoint_is_refused_unrun_by_fit_and_validate(tmp_path, capsys, no_weights, stage):
    marker = tmp_path / "ran"
    path = _crafted_ckpt(tmp_path / "planted.ckpt", marker)
    line = _main_line([stage, "--config", "das.yaml", "--ckpt_path", str(path)], capsys)
    assert line.startswith(f"--ckpt_path {path} holds more than tensors and plain data (it names exec)")
    assert not marker.exists()


def test_read_checkpoint_reads_a_checkpoint_and_refuses_what_is_not_one(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}, good)
    for mmap in (False, True):
        loaded = read_checkpoint(good, mmap=mmap)
        assert loaded["epoch"] == 2 and loaded["state_dict"]["w"].tolist() == [0.0, 1.0, 2.0]
    plain = tmp_path / "plain.ckpt"
    torch.save({"w": torch.ones(1)}, plain)
    with pytest.raises(ValueError, match=rf"^{plain} is not a Lightning checkpoint \(it holds no state_dict\)"):
        read_checkpoint(plain)
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'none.ckpt'}: no such checkpoint file$"):
        read_checkpoint(tmp_path / "none.ckpt")


def test_a_crafted_checkpoint_given_to_steer_is_one_line_and_unrun(tmp_path, capsys):
    marker = tmp_path / "ran"
    path = _crafted_ckpt(tmp_path / "planted.ckpt", marker)
    line = _main_line(
        ["steer", "--config", "steer_eval.yaml", "--checkpoint", str(path), "--out", str(tmp_path)], capsys
    )
    assert line.startswith(f"{path} holds more than tensors and plain data (it names exec)")
    assert not marker.exists()


def test_crafted_calm_probes_are_one_line_and_unrun(tmp_path, tiny_lm_dir, capsys):
    marker = tmp_path / "ran"
    probes = tmp_path / "probes"
    probes.mkdir()
    for prop in ("Country", "Continent", "Language"):
        _crafted_ckpt(probes / f"{prop}.ckpt", marker)
    argv = ["calm", "--config", "calm_ravel.yaml", f"--lm={tiny_lm_dir('llama')}", "--layer=1"]
    line = _main_line([*argv, f"--probes={probes}", f"--out={tmp_path / 'out'}"], capsys)
    assert line.startswith(f"{probes}/") and " holds more than tensors and plain data (it names exec)" in line
    assert not marker.exists()
    with pytest.raises(ValueError, match="holds more than tensors and plain data"):
        load_probe(probes / "Country.ckpt")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["crafted", "truncated"])
def test_a_bad_sae_file_is_one_line_before_the_lm_loads(tmp_path, tiny_lm_dir, capsys, no_weights, kind):
    marker = tmp_path / "ran"
    if kind == "crafted":
        path = _crafted_ckpt(tmp_path / "sae.ckpt", marker)
        words = "is unreadable (SafetensorError: Error while deserializing header: header too large)"
    else:
        path = tmp_path / "sae.safetensors"
        save_file({"W1": torch.ones(8, 32), "b1": torch.zeros(8), "W2": torch.ones(32, 8), "b2": torch.zeros(32)}, path)
        _truncate(path)
        words = "is unreadable (SafetensorError: Error while deserializing header: incomplete metadata"
    argv = ["fit", "--config", "ravel/sae.yaml", f"--model.lm={tiny_lm_dir('llama')}", "--model.layer=1"]
    line = _main_line([*argv, f"--model.intervention.init_args.sae={path}"], capsys)
    assert line.startswith(f"{path} {words}") and line.endswith("; restore the file or save it again")
    assert not marker.exists()


# ----------------------------------------------------------------------------- 4. truncated weights


def test_a_truncated_intervention_is_named_by_from_pretrained(tmp_path):
    directory = tmp_path / "das"
    save_pretrained(directory, FixedSubspaceIntervention(torch.eye(4)[:1]), {"model": "tiny"})
    assert isinstance(from_pretrained(directory), FixedSubspaceIntervention)
    _truncate(directory / "intervention.safetensors")
    with pytest.raises(ValueError) as error:
        from_pretrained(directory)
    assert str(error.value).startswith(f"{directory / 'intervention.safetensors'} is unreadable (SafetensorError")
    assert "\n" not in str(error.value)


def test_a_truncated_sae_artifact_is_named_by_from_pretrained(tmp_path):
    directory = tmp_path / "sae"
    directory.mkdir()
    save_file(
        {"W1": torch.ones(8, 4), "b1": torch.zeros(8), "W2": torch.ones(4, 8), "b2": torch.zeros(4)},
        directory / "sae.safetensors",
    )
    assert from_pretrained(directory).n_features == 8
    _truncate(directory / "sae.safetensors")
    with pytest.raises(ValueError, match=rf"^{directory / 'sae.safetensors'} is unreadable \(SafetensorError: "):
        from_pretrained(directory)


def _steering_directory(directory: Path) -> Path:
    """A LoReFT steering module's directory (config.json + weights) whose weights are truncated."""
    directory.mkdir()
    save_file(
        {"R": torch.ones(2, 32), "W": torch.ones(2, 32), "b": torch.zeros(2)}, directory / "intervention.safetensors"
    )
    _truncate(directory / "intervention.safetensors")
    config = {
        "library_name": "lit-interventions",
        "kind": "steering",
        "class_path": "lit_interventions.modules.steering_loreft.LoReFTModule",
        "weights": "intervention.safetensors",
        "method": "loreft",
        "model": "tiny",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_truncated_steering_directory_is_one_line_in_steer(tmp_path, capsys):
    directory = _steering_directory(tmp_path / "loreft")
    with pytest.raises(ValueError, match=rf"^{directory / 'intervention.safetensors'} is unreadable"):
        load_steering_checkpoint(directory)
    argv = ["steer", "--config", "steer_eval.yaml", "--checkpoint", str(directory), "--out", str(tmp_path / "out")]
    line = _main_line(argv, capsys)
    assert line.startswith(f"{directory / 'intervention.safetensors'} is unreadable (SafetensorError: ")
    assert line.endswith("; restore the file or save it again")


# ----------------------------------------------------------------------------- 5. a checkpoint without its config


def _lone_ckpt(path: Path) -> Path:
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": {}, "hyper_parameters": {"lm": "x"}}, path)
    return path


@pytest.mark.slow
def test_a_lone_checkpoint_says_to_pass_its_runs_config(tmp_path):
    path = _lone_ckpt(tmp_path / "copied" / "here" / "lone.ckpt")
    done = run_command("test", "--ckpt_path", str(path))
    assert _one_line(done) == (
        f"--ckpt_path {path}: a checkpoint needs its run's config, and {tmp_path / 'copied' / 'config.yaml'} "
        "(where a run keeps it: RUN/config.yaml beside RUN/checkpoints/) does not exist; pass "
        "--config RUN/config.yaml of the run that wrote the checkpoint"
    )


def test_a_checkpoint_in_its_run_directory_takes_the_runs_config(tmp_path, capsys):
    run = tmp_path / "run"
    path = _lone_ckpt(run / "checkpoints" / "epoch=0.ckpt")
    (run / "config.yaml").write_text("model: {}\n")
    for stage in ("fit", "validate", "test"):
        assert _checkpoint_config([stage, "--ckpt_path", str(path)]) == [
            stage,
            "--config",
            str(run / "config.yaml"),
            "--ckpt_path",
            str(path),
        ]
    given = ["test", "--config", "das.yaml", "--ckpt_path", str(path)]
    assert _checkpoint_config(given) == given  # a config given is kept
    (run / "config.yaml").unlink()
    line = _main_line(["validate", f"--ckpt_path={path}"], capsys)
    assert line.startswith(f"--ckpt_path {path}: a checkpoint needs its run's config, and {run / 'config.yaml'} (")


def test_a_runs_config_naming_foreign_code_is_not_used_unasked(tmp_path, capsys):
    """A config.yaml found beside a checkpoint (not given by the user) that names a class outside
    lit_interventions and Lightning is refused, unimported; given with --config, it is the user's."""
    run = tmp_path / "run"
    path = _lone_ckpt(run / "checkpoints" / "epoch=0.ckpt")
    (run / "config.yaml").write_text(
        "model:\n  class_path: lit_interventions.modules.interchange.InterchangeModule\n"
        "  init_args:\n    intervention: {class_path: planted_code.Evil}\n"
        "trainer:\n  callbacks: [{class_path: lightning.pytorch.callbacks.ModelCheckpoint}]\n"
    )
    line = _main_line(["test", f"--ckpt_path={path}"], capsys)
    assert line == (
        f"--ckpt_path {path}: its run's {run / 'config.yaml'} names class_path 'planted_code.Evil', outside "
        f"lit_interventions and Lightning, so it was not used (importing it runs its code); if you trust it, "
        f"pass --config {run / 'config.yaml'}"
    )
    assert "planted_code" not in sys.modules
    given = ["test", "--config", str(run / "config.yaml"), "--ckpt_path", str(path)]
    assert _checkpoint_config(given) == given  # given by the user: used as it is


# ----------------------------------------------------------------------------- 6. a hub id without network


@pytest.mark.parametrize("offline", [pytest.param("HF_HUB_OFFLINE=1", marks=pytest.mark.slow), "unreachable endpoint"])
def test_an_unknown_hub_id_without_network_fails_at_once(tmp_path, offline):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: no real network is touched
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    if offline == "HF_HUB_OFFLINE=1":
        env["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    done = run_command(
        "fit",
        "--config",
        "das.yaml",
        "--model.lm=nobody/no-such-model",
        f"--trainer.default_root_dir={tmp_path}",
        env=env,
    )
    reason = "HF_HUB_OFFLINE is set" if env["HF_HUB_OFFLINE"] else f"{endpoint} cannot be reached (ConnectError)"
    assert _one_line(done) == (
        "Cannot load lm='nobody/no-such-model': it is not an embedded name (gemma-3-270m, smollm2-135m-instruct), "
        "a .gguf file or a local model directory, and as a hub id it is not in the Hugging Face cache while "
        f"{reason}; download it where the hub can be reached (`hf download nobody/no-such-model`) or pass a local "
        "model directory."
    )
    assert time.monotonic() - started < 120  # no download retries (about a minute of them)
    assert not list(tmp_path.glob("*/version_*"))


def test_a_cached_hub_id_loads_from_the_cache_offline(tmp_path, tiny_lm_dir, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in Path(tiny_lm_dir("llama")).iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert lm.resolve("someone/tiny") == str(snapshot)
    assert lm.load_config("someone/tiny").hidden_size == 32
    with pytest.raises(ValueError, match=r"^Cannot load lm='someone/other': .* not in the Hugging Face cache while "):
        lm.load_config("someone/other")
    with pytest.raises(ValueError, match=r"^Cannot load lm='/no/such/model/dir': no such directory\. "):
        lm.load_config("/no/such/model/dir")


# ----------------------------------------------------------------------------- 7. an output directory not writable


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits (chmod has no effect)")
def test_a_read_only_run_directory_is_one_line(tmp_path, tiny_lm_dir, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        argv = ["fit", "--config", "das.yaml", f"--model.lm={tiny_lm_dir('gpt2')}", *SMALL]
        for root, words in ((locked, "is not writable"), (locked / "runs", "cannot be created")):
            line = _main_line([*argv, f"--trainer.default_root_dir={root}"], capsys)
            assert line.startswith(f"--trainer.default_root_dir {root} {words} (Permission denied)"), line
    finally:
        locked.chmod(0o755)


# ----------------------------------------------------------------------------- every case, as a user runs it


def _case(name: str, tmp_path: Path, lm_dir: str, marker: Path) -> tuple[list[str], str]:
    """(command line, the start of its error line) for one bad input."""
    if name == "axbench":
        directory = _concepts(tmp_path, "metadata.jsonl", line=2)
        args = ["fit", "--config", "diffmean.yaml", f"--model.lm={lm_dir}", "--model.layer=1"]
        return [*args, f"--data.concept_dir={directory}"], f"{directory / 'metadata.jsonl'}, line 2: not valid JSON"
    if name == "ravel":
        directory = _ravel(tmp_path)
        path = directory / "ravel_city_prompt_to_split.json"
        path.write_text(path.read_text()[:-3])
        args = ["fit", "--config", "ravel/das.yaml", f"--model.lm={lm_dir}", "--model.layer=1", "--model.k=4"]
        return [*args, f"--data.ravel_dir={directory}"], f"{path}: not valid JSON at line "
    if name in ("damaged fit", "crafted fit", "crafted validate"):
        stage = name.split()[1]
        path = _damaged_ckpt(tmp_path / "x.ckpt") if "damaged" in name else _crafted_ckpt(tmp_path / "x.ckpt", marker)
        words = "is not a readable Lightning checkpoint" if "damaged" in name else "holds more than tensors"
        return [stage, "--config", "das.yaml", f"--ckpt_path={path}"], f"--ckpt_path {path} {words}"
    if name in ("steer", "calm", "sae"):
        path = _crafted_ckpt(tmp_path / "Country.ckpt", marker)
        for prop in ("Continent", "Language"):
            _crafted_ckpt(tmp_path / f"{prop}.ckpt", marker)
        args = {
            "steer": ["steer", "--config", "steer_eval.yaml", "--checkpoint", str(path), "--out", str(tmp_path / "o")],
            "calm": ["calm", "--config", "calm_ravel.yaml", f"--lm={lm_dir}", "--layer=1", f"--probes={tmp_path}"],
            "sae": ["fit", "--config", "ravel/sae.yaml", f"--model.lm={lm_dir}", "--model.layer=1"],
        }[name]
        if name == "sae":
            return [*args, f"--model.intervention.init_args.sae={path}"], f"{path} is unreadable (SafetensorError"
        return args, f"{path} holds more than tensors and plain data (it names exec)"
    directory = _steering_directory(tmp_path / "loreft")  # a truncated steering module
    out = ["--out", str(tmp_path / "o")]
    return ["steer", "--config", "steer_eval.yaml", "--checkpoint", str(directory), *out], (
        f"{directory / 'intervention.safetensors'} is unreadable (SafetensorError"
    )


CASES = ["axbench", "ravel", "damaged fit", "crafted fit", "crafted validate", "steer", "calm", "sae", "truncated"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_every_case_is_one_line_from_the_console_script(tmp_path, tiny_lm_dir, name):
    marker = tmp_path / "ran"
    args, start = _case(name, tmp_path, tiny_lm_dir("llama"), marker)
    if args[0] in ("fit", "validate"):
        args.append(f"--trainer.default_root_dir={tmp_path / 'runs'}")
    line = _one_line(run_command(*args))
    assert line.startswith(start), line
    assert not marker.exists()
