"""Inputs a hostile or careless user gives, each refused in one line or read as meant (issue 55):
a weights file that is a link out of its artifact's directory, `generate --positions` outside the
prompt, text files with a byte-order mark, `export` to an --out it cannot write or a disk that
fills, and crafted pickles that name code. Beside them, reruns that must give the same files and
text: `export` into its own earlier output, `generate` with one seed twice.

Commands run as a user runs them (`python -m lit_interventions ...`, exit status and the one
`error:` line asserted); a full disk is simulated in-process (a writer raising ENOSPC).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR as AXBENCH_DIR
from lit_interventions.datamodules.axbench_files import load_concepts, load_instructions
from lit_interventions.datamodules.concepts_recipe import read_concepts
from lit_interventions.datamodules.contrast_files import read_contrast
from lit_interventions.datamodules.pairs_files import read_pairs
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL, load_ravel
from lit_interventions.datamodules.templates import BUILTIN_TEMPLATES, load_templates
from safetensors.torch import save_file

from lit_interventions.artifacts.checkpoint_io import read_checkpoint
from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import save_intervention, save_pretrained
from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.core.files import read_utf8
from lit_interventions.core.positions import encode_text
from lit_interventions.export import control_vector, formats
from lit_interventions.export.cli import main as export_main
from lit_interventions.inference.generate import prompt_positions
from lit_interventions.interventions.rotation import FixedSubspaceIntervention
from tests.conftest import HIDDEN
from tests.helpers import run_command, write_csv

BOM = b"\xef\xbb\xbf"
FIX = "; use a .ckpt file a run wrote (RUN/checkpoints/), from a source you trust"


def _one_line(done, status: int = 2) -> str:
    """The one stderr line of a refused command, without `error: `; its exit status `status`."""
    assert done.returncode == status, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


def _dictionary(lm_dir: str) -> Dictionary:
    vectors = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(0))
    return Dictionary(vectors, torch.tensor([2.0, 3.5]), ["dogs", "cats"], lm_dir, 1, "diffmean")


# ----------------------------------------------------------------------------- 1. weights behind a link


def _outside(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A readable safetensors file outside every artifact directory."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    path = tmp_path / "elsewhere" / "secret.safetensors"
    save_file(tensors, path)
    return path


def _linked(directory: Path, name: str, target: Path) -> Path:
    """`directory/name` replaced by a symbolic link to `target`."""
    (directory / name).unlink()
    (directory / name).symlink_to(target)
    return directory / name


def _artifact(kind: str, tmp_path: Path, lm_dir: str) -> tuple[Path, str]:
    """(an artifact directory of `kind`, the name of its weights file)."""
    directory = tmp_path / kind
    if kind == "intervention":
        save_pretrained(directory, FixedSubspaceIntervention(torch.eye(4)[:1]), {"model": "tiny"})
        return directory, "intervention.safetensors"
    if kind == "older intervention":  # intervention.json, no config.json (read_tensors)
        save_intervention(directory, FixedSubspaceIntervention(torch.eye(4)[:1]), {"model": "tiny"})
        return directory, "intervention.safetensors"
    if kind == "dictionary":
        _dictionary(lm_dir).save_pretrained(directory)
        return directory, "dictionary.safetensors"
    directory.mkdir()  # an SAE: sae.safetensors
    tensors = {"W1": torch.ones(8, 4), "b1": torch.zeros(8), "W2": torch.ones(4, 8), "b2": torch.zeros(4)}
    save_file(tensors, directory / "sae.safetensors")
    return directory, "sae.safetensors"


@pytest.mark.parametrize("kind", ["intervention", "older intervention", "dictionary", "sae"])
def test_weights_linked_from_outside_the_directory_are_refused(tmp_path, tiny_lm_dir, kind):
    directory, name = _artifact(kind, tmp_path, tiny_lm_dir("llama"))
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.copy(directory / name, outside)  # the same tensors: only where they lie differs
    from_pretrained(directory)
    _linked(directory, name, outside)
    with pytest.raises(ValueError) as refused:
        from_pretrained(directory)
    assert str(refused.value) == (
        f"{directory / name} is a link to {outside}, outside {directory}; an artifact's weights are read only "
        "from inside its directory (copy the file in)"
    )


def test_links_inside_the_directory_and_a_hub_snapshots_blobs_load(tmp_path):
    """A link to a file of the same directory loads; so does a hub cache snapshot, whose files
    are links to ../../blobs/HASH of its own repository, and not a link into another repository's."""
    intervention = FixedSubspaceIntervention(torch.eye(4)[1:3])
    inside = tmp_path / "inside"
    save_pretrained(inside, intervention, {"model": "tiny"})
    (inside / "intervention.safetensors").rename(inside / "kept.safetensors")
    (inside / "intervention.safetensors").symlink_to("kept.safetensors")
    assert torch.equal(from_pretrained(inside).export()["basis"], intervention.export()["basis"])

    saved = tmp_path / "saved"
    save_pretrained(saved, intervention, {"model": "tiny"})
    repos = {}
    for repo in ("models--someone--das", "models--someone--other"):
        snapshot = tmp_path / "hub" / repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (tmp_path / "hub" / repo / "blobs").mkdir()
        for file in saved.iterdir():  # huggingface_hub's layout: the blob by its hash, the snapshot links to it
            blob = tmp_path / "hub" / repo / "blobs" / f"{file.name}-hash"
            blob.write_bytes(file.read_bytes())
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
        repos[repo] = snapshot
    loaded = from_pretrained(repos["models--someone--das"])
    assert torch.equal(loaded.export()["basis"], intervention.export()["basis"])
    theirs = tmp_path / "hub" / "models--someone--other" / "blobs" / "intervention.safetensors-hash"
    weights = _linked(repos["models--someone--das"], "intervention.safetensors", theirs)
    with pytest.raises(ValueError, match=rf"^{weights} is a link to {theirs}, outside "):
        from_pretrained(repos["models--someone--das"])


def test_a_linked_weights_file_is_one_line_through_the_console_script(tmp_path, tiny_lm_dir):
    directory, name = _artifact("dictionary", tmp_path, tiny_lm_dir("llama"))
    planted = _outside(tmp_path, {"vectors": torch.ones(2, HIDDEN), "max_activations": torch.ones(2)})
    _linked(directory, name, planted)
    out = tmp_path / "vectors"
    done = run_command("export", "--artifact", str(directory), "--to", "gguf-control-vector", "--out", str(out))
    assert _one_line(done) == (
        f"{directory / name} is a link to {planted}, outside {directory}; an artifact's weights are read only "
        "from inside its directory (copy the file in)"
    )
    assert not out.exists()


# ----------------------------------------------------------------------------- 2. positions outside the prompt


def test_prompt_positions_outside_the_prompt_name_its_length(tokenizer):
    n = encode_text(tokenizer, "The dog")["input_ids"].shape[1]
    enc, positions, templated = prompt_positions(tokenizer, "The dog", f"0,{-n}", None, chat=False)
    assert positions.indices == (0, -n) and enc["input_ids"].shape[1] == n and not templated
    with pytest.raises(ValueError) as refused:
        prompt_positions(tokenizer, "The dog", f"0,{n},-{n + 1}", None, chat=False)
    assert str(refused.value) == (
        f"positions=0,{n},-{n + 1}: {n}, -{n + 1} are outside the prompt, which is {n} tokens "
        f"(positions 0..{n - 1}, or -{n}..-1 from its end)"
    )


def test_generate_refuses_a_position_outside_the_prompt_before_the_lm_loads(tmp_path, tiny_lm_dir, tokenizer):
    lm_dir = tiny_lm_dir("llama")
    _dictionary(lm_dir).save_pretrained(tmp_path / "dict")
    n = encode_text(tokenizer, "The dog")["input_ids"].shape[1]
    args = ["generate", "--artifact", str(tmp_path / "dict"), "--prompt", "The dog", "--concept", "dogs"]
    done = run_command(*args, "--factor", "30", "--max_new_tokens", "3", "--positions", "0,999")
    assert _one_line(done) == (
        f"--positions=0,999: 999 is outside the prompt, which is {n} tokens (positions 0..{n - 1}, or -{n}..-1 "
        "from its end)"
    )
    assert "Loading weights" not in done.stderr and done.stdout == ""


# ----------------------------------------------------------------------------- 3. a byte-order mark first


def _with_bom(path: Path, out: Path) -> Path:
    out.write_bytes(BOM + path.read_bytes())
    return out


PAIR = {
    "base": "The keys to the cabinet",
    "source": "The key to the cabinet",
    "base_label": "are",
    "source_label": "is",
}


def test_a_csv_with_a_byte_order_mark_reads_as_without(tmp_path):
    fields = ["base", "source", "base_label", "source_label", "split"]
    rows = [PAIR | {"split": "train"}, PAIR | {"base": "The keys to the box", "split": "val"}]
    plain = write_csv(tmp_path / "plain.csv", rows, fields)
    marked = _with_bom(plain, tmp_path / "marked.csv")
    assert [(r.base, r.split) for r in read_pairs(str(marked))] == [(r.base, r.split) for r in read_pairs(str(plain))]
    contrast = tmp_path / "contrast.csv"
    contrast.write_bytes(BOM + b"positive,negative\nA dog barked.,The sky is blue.\n")
    assert [(r.positive, r.negative) for r in read_contrast(str(contrast))] == [("A dog barked.", "The sky is blue.")]


def test_a_csv_with_a_byte_order_mark_is_read_by_the_console_script(tmp_path, tiny_lm_dir):
    """The file's second row is bad on purpose: the line names it (its header was read), where a
    mark kept in the first field name would be refused at row 1 as an unknown field."""
    fields = ["base", "source", "base_label", "source_label", "split"]
    path = write_csv(tmp_path / "pairs.csv", [PAIR | {"split": "train"}, PAIR | {"split": "dev"}], fields)
    _with_bom(path, path)
    done = run_command(
        "fit", "--config", "das_pairs.yaml", f"--data.path={path}", f"--model.lm={tiny_lm_dir('gpt2')}",
        "--model.layer=1", f"--trainer.default_root_dir={tmp_path / 'runs'}",
    )  # fmt: skip
    assert _one_line(done) == "pairs.csv row 2: 'split' is 'dev'; choose one of train, val, test"


def test_json_and_text_files_with_a_byte_order_mark_read_as_without(tmp_path):
    templates = _with_bom(BUILTIN_TEMPLATES, tmp_path / "templates.json")
    assert load_templates(templates) == load_templates(BUILTIN_TEMPLATES)
    axbench = tmp_path / "axbench"
    shutil.copytree(AXBENCH_DIR, axbench)
    for name in ("metadata.jsonl", "train_data.jsonl", "latent_eval_data.jsonl"):
        _with_bom(AXBENCH_DIR / name, axbench / name)
    ours, theirs = load_concepts(axbench), load_concepts(AXBENCH_DIR)
    assert ours.concepts == theirs.concepts and ours.train.equals(theirs.train)
    instructions = _with_bom(AXBENCH_DIR / "instructions.json", tmp_path / "instructions.json")
    assert load_instructions(instructions) == load_instructions(AXBENCH_DIR / "instructions.json")
    ravel = tmp_path / "ravel"
    ravel.mkdir()
    for path in BUILTIN_RAVEL.glob("*.json"):
        _with_bom(path, ravel / path.name)
    assert load_ravel(ravel, "city") == load_ravel(BUILTIN_RAVEL, "city")
    concepts = tmp_path / "concepts.txt"
    concepts.write_bytes(BOM + b"cooking with garlic\ttext\nrental services\n")
    assert [c.name for c in read_concepts(concepts)] == ["cooking with garlic", "rental services"]


def test_a_bad_byte_after_a_byte_order_mark_is_counted_from_the_files_start(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(BOM + "base,source\nThé".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{path}: not UTF-8 text \(byte {len(BOM) + 14}\); save it as UTF-8$"):
        read_utf8(path)


# ----------------------------------------------------------------------------- 4. export: --out and a full disk


def _export_args(tmp_path: Path, lm_dir: str, out: Path) -> list[str]:
    if not (tmp_path / "dict").exists():
        _dictionary(lm_dir).save_pretrained(tmp_path / "dict")
    return ["--artifact", str(tmp_path / "dict"), "--to", "gguf-control-vector", "--out", str(out)]


def test_an_out_that_cannot_be_created_is_one_line_before_any_work(tmp_path, tiny_lm_dir):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "vectors"
    done = run_command("export", *_export_args(tmp_path, tiny_lm_dir("llama"), out))
    assert _one_line(done) == f"--out {out} cannot be created: {tmp_path / 'a-file'} is a file; give a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits (chmod has no effect)")
def test_a_read_only_out_is_one_line_before_any_work(tmp_path, tiny_lm_dir):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for out, where in ((locked, ""), (locked / "vectors", f" (it would be created in {locked})")):
            done = run_command("export", *_export_args(tmp_path, tiny_lm_dir("llama"), out))
            assert _one_line(done) == (
                f"--out {out} is not writable{where}: Permission denied; give a directory you can write"
            )
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("failure", ["ENOSPC", "short write"])
def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, tiny_lm_dir, monkeypatch, capsys, failure):
    """The second vector's file meets a full disk half-way: one line naming the full disk, exit 1;
    the first file of the earlier export is replaced whole, the second keeps the earlier bytes,
    and no temporary file is left."""
    out = tmp_path / "vectors"
    args = _export_args(tmp_path, tiny_lm_dir("llama"), out)
    export_main(args)
    earlier = _files(out)
    written = []

    def filling(path, model_hint, directions):
        if written:  # the second file: half of it, then the disk is full
            Path(path).write_bytes(earlier["cats.gguf"][:100])
            if failure == "ENOSPC":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise RuntimeError("[enforce fail at inline_container.cc:859] . unexpected pos 960 vs 854")
        written.append(path)
        real_write(path, model_hint, directions)

    real_write = control_vector.write_gguf
    monkeypatch.setattr(control_vector, "write_gguf", filling)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 0))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        export_main([*args, "--factor", "2"])
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        f"error: --out {out} could not be written: the disk is full (No space left on device); no file is left "
        "half-written (each is written beside itself and renamed), free some space and export again\n"
    )
    now = _files(out)
    assert sorted(now) == ["cats.gguf", "dogs.gguf"] and now["cats.gguf"] == earlier["cats.gguf"]
    assert now["dogs.gguf"] != earlier["dogs.gguf"]  # written whole at --factor 2 before the disk filled


def test_another_write_failure_is_one_line_naming_it(tmp_path, tiny_lm_dir, monkeypatch):
    out = tmp_path / "vectors"
    artifact = _export_args(tmp_path, tiny_lm_dir("llama"), out)[1]

    def refused(path, model_hint, directions):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(control_vector, "write_gguf", refused)
    with pytest.raises(formats.ExportNotWritten) as failed:
        formats.export_artifact(artifact, "gguf-control-vector", out)
    assert str(failed.value) == (
        f"--out {out} could not be written: Permission denied; no file is left half-written (each is written "
        "beside itself and renamed), fix that and export again"
    )
    assert list(out.iterdir()) == []


# ----------------------------------------------------------------------------- 5. crafted pickles


class _Call:
    """Unpickled, it calls `function(*args)` (os.system, exec): what a crafted checkpoint plants."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return (self.function, self.args)


@pytest.mark.parametrize(
    "function,protocol,named", [(os.system, 2, "posix.system"), (exec, 0, "exec"), (os.system, 0, "posix.system")]
)
def test_a_crafted_pickle_names_what_it_would_run(tmp_path, function, protocol, named):
    marker = tmp_path / "ran"
    code = f"touch {marker}" if function is os.system else f"open({str(marker)!r}, 'w').write('ran')"
    path = tmp_path / "planted.ckpt"
    torch.save({"state_dict": {}, "planted": _Call(function, code)}, path, pickle_protocol=protocol)
    done = run_command("test", "--config", "das.yaml", "--ckpt_path", str(path))
    assert _one_line(done) == (
        f"--ckpt_path {path} holds more than tensors and plain data (it names {named}); it is read with "
        f"weights_only=True and never unpickled further, so nothing in it ran{FIX}"
    )
    assert not marker.exists()


def test_a_plain_checkpoint_in_an_old_protocol_is_damaged_not_crafted(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, path, pickle_protocol=0)
    with pytest.raises(ValueError, match=rf"^{path} is not a readable Lightning checkpoint \(damaged: Unpickling"):
        read_checkpoint(path)


# ----------------------------------------------------------------------------- 6. reruns give the same output


@pytest.mark.parametrize("to", ["gguf-control-vector", "lm-eval"])
def test_an_export_rerun_into_its_own_out_writes_the_same_bytes(tmp_path, tiny_lm_dir, to):
    args = _export_args(tmp_path, tiny_lm_dir("llama"), tmp_path / "out")
    args[3] = to
    export_main(args)
    first = _files(tmp_path / "out")
    export_main(args)
    assert _files(tmp_path / "out") == first and len(first) == 2


def test_generate_with_one_seed_twice_prints_the_same(tmp_path, tiny_lm_dir):
    _dictionary(tiny_lm_dir("llama")).save_pretrained(tmp_path / "dict")
    args = ["generate", "--artifact", str(tmp_path / "dict"), "--prompt", "The dog", "--concept", "dogs", "--json"]
    args += ["--sample", "--seed", "7", "--max_new_tokens", "6", "--factor", "5"]
    first, second = run_command(*args), run_command(*args)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:]
    printed = json.loads(first.stdout.strip().splitlines()[-1])
    assert first.stdout == second.stdout and printed["steered"] != printed["unsteered"]


def test_steering_instructions_and_a_syntaxgym_suite_with_a_byte_order_mark_read_as_without(tmp_path):
    from lit_interventions.studies.steer import load_instructions as steering_instructions
    from lit_interventions.studies.syntaxgym.suites import load_suite
    from tests.test_syntaxgym import TINY_SUITE

    lines = tmp_path / "instructions.txt"
    lines.write_bytes(BOM + b"Write about your day.\nName a colour.\n")
    assert steering_instructions(str(lines)) == ["Write about your day.", "Name a colour."]
    listed = tmp_path / "instructions.json"
    listed.write_bytes(BOM + json.dumps(["Write about your day."]).encode())
    assert steering_instructions(str(listed)) == ["Write about your day."]
    plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
    plain.write_text(json.dumps(TINY_SUITE))
    marked.write_bytes(BOM + plain.read_bytes())
    assert load_suite(marked) == load_suite(plain)
