"""Hub-ready artifacts: save_pretrained / from_pretrained / push_to_hub, offline.

Every test works on local directories; the hub is never contacted: `snapshot_download` and
`HfApi.create_repo` / `HfApi.upload_folder` are replaced by stand-ins that record their calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard

from lit_interventions.artifacts import hub
from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.artifacts.intervention_files import (
    load_pretrained,
    pretrained_intervention,
    push_intervention,
    save_intervention,
    save_pretrained,
)
from lit_interventions.artifacts.pretrained import from_pretrained
from lit_interventions.interventions.rotation import FixedSubspaceIntervention, RotatedSpaceIntervention

CARD = {
    "model": "smollm2-135m-instruct",
    "layer": 3,
    "region": "subject",
    "task": "agr_sv_num_pp",
    "data": {"task": "agr_sv_num_pp", "train_pairs": 12},
    "metrics": {"val/odds": 2.5, "val/iia": 0.75},
    "command": "lit-interventions fit --config configs/das.yaml --model.layer 3",
}


def _das(d=16, k=2) -> RotatedSpaceIntervention:
    torch.manual_seed(0)
    return RotatedSpaceIntervention(d, k)


def _dictionary(model: str, d: int = 32) -> Dictionary:
    names = ["dogs", "giving", "rent"]
    vectors = torch.nn.functional.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(0)), dim=-1)
    return Dictionary(
        vectors=vectors,
        max_activations=torch.tensor([2.0, 3.0, 1.5]),
        concepts=names,
        model=model,
        layer=1,
        method="diffmean",
        training_data="builtin",
        auroc={"mean": 0.8, "per_concept": {n: 0.8 for n in names}},
        card={"model_type": "llama", "command": "lit-interventions fit --config configs/diffmean.yaml"},
    )


def _same_outputs(a, b, d=16):
    base, source = torch.randn(4, 5, d), torch.randn(4, 5, d)
    with torch.no_grad():
        torch.testing.assert_close(a(base, source), b(base, source))


# --- interventions ----------------------------------------------------------------------------------


def test_intervention_round_trip_and_files(tmp_path):
    das = _das()
    out = save_pretrained(tmp_path / "das", das, CARD)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "intervention.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["class_path"] == "lit_interventions.interventions.rotation.RotatedSpaceIntervention"
    assert config["config"] == das.config() and config["library_name"] == "lit-interventions"
    assert config["site"] == {"layer": 3, "region": "subject"} and config["metrics"] == CARD["metrics"]
    assert config["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["command"] == CARD["command"]
    for loaded in (pretrained_intervention(RotatedSpaceIntervention, out), from_pretrained(out), load_pretrained(out)):
        assert type(loaded) is RotatedSpaceIntervention
        _same_outputs(das, loaded)
    with pytest.raises(TypeError, match="not a lit_interventions.interventions.rotation.FixedSubspaceIntervention"):
        pretrained_intervention(FixedSubspaceIntervention, out)


def test_model_card_names_the_lm_layer_metrics_and_command(tmp_path):
    out = save_pretrained(tmp_path, _das(), CARD)
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "lit-interventions" and "lit-interventions" in card.data.tags
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    text = card.text
    assert "`smollm2-135m-instruct`" in text and "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct" in text
    assert "residual stream after block 3" in text and "`subject` region" in text
    assert "| `val/odds` | 2.5 |" in text and "| `val/iia` | 0.75 |" in text
    assert CARD["command"] in text and "agr_sv_num_pp" in text
    # an LM with no known hub id: no base_model in the front matter
    out = save_pretrained(tmp_path / "local", _das(), {**CARD, "model": str(tmp_path / "my-model")})
    assert ModelCard.load(out / "README.md").data.base_model is None


def test_old_intervention_directories_still_load(tmp_path):
    das = _das()
    save_intervention(tmp_path, das, CARD)  # intervention.safetensors + intervention.json only
    assert not (tmp_path / "config.json").exists()
    for loaded in (pretrained_intervention(RotatedSpaceIntervention, tmp_path), from_pretrained(tmp_path)):
        _same_outputs(das, loaded)


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    das = _das()
    served = save_pretrained(tmp_path / "served", das, CARD)
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(served)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = pretrained_intervention(RotatedSpaceIntervention, "someone/das-agr", revision="v1")
    _same_outputs(das, loaded)
    assert calls[0][0] == "someone/das-agr" and calls[0][1]["revision"] == "v1"
    assert calls[0][1]["library_name"] == "lit-interventions"
    assert type(from_pretrained("someone/das-agr")) is RotatedSpaceIntervention and len(calls) == 2

    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no cached copy and the hub is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="'runs/das_typo' is not a local directory.*LocalEntryNotFoundError"):
        from_pretrained("runs/das_typo")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a hub id"):
        from_pretrained(tmp_path / "no" / "such" / "dir")
    assert len(calls) == 2


@pytest.fixture
def uploads(monkeypatch):
    """HfApi.create_repo / upload_folder replaced: records each upload and the files it would send."""
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        texts = {p.name: p.read_text() for p in Path(folder_path).iterdir() if p.suffix in (".json", ".yaml", ".md")}
        calls.append(("upload_folder", repo_id, {"folder_path": folder_path, "files": files, "texts": texts, **kwargs}))
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return calls


def test_push_to_hub_uploads_the_directory(tmp_path, uploads):
    out = save_pretrained(tmp_path / "das", _das(), CARD)
    (out / "events.out.tfevents.1").write_text("logs stay behind")
    assert hub.push_to_hub(out, "someone/das-agr", private=True) == "commit-info"
    (_, repo, created), (_, repo2, upload) = uploads
    assert repo == repo2 == "someone/das-agr" and created["exist_ok"] and created["private"]
    assert upload["files"] == ["README.md", "config.json", "intervention.safetensors"]  # no logs
    assert upload["repo_type"] == "model"
    assert {"config.json", "README.md", "intervention.safetensors"} <= set(upload["allow_patterns"])
    assert not any("tfevents" in pattern or "ckpt" in pattern for pattern in upload["allow_patterns"])
    # from the object: saved to a temporary directory first
    assert push_intervention(_das(), "someone/das-2", CARD) == "commit-info"
    assert uploads[-1][2]["files"] == ["README.md", "config.json", "intervention.safetensors"]


# --- dictionaries -----------------------------------------------------------------------------------


def test_dictionary_round_trip_equal_outputs(tmp_path, tiny_lm_dir, tokenizer):
    from lit_interventions.core.lm import load_lm

    lm_dir = tiny_lm_dir("llama")
    d = _dictionary(lm_dir)
    out = d.save_pretrained(tmp_path / "dict")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dictionary.safetensors"]
    loaded = Dictionary.from_pretrained(out)
    torch.testing.assert_close(loaded.vectors, d.vectors)
    torch.testing.assert_close(loaded.max_activations, d.max_activations)
    assert (loaded.concepts, loaded.layer, loaded.method, loaded.auroc) == (d.concepts, 1, "diffmean", d.auroc)
    assert loaded.card == d.card  # what config.json adds is not carried into the card
    texts = ["My dog chased the ball.", "Rent a van."]
    lm = load_lm(lm_dir)
    torch.testing.assert_close(
        loaded.detect(texts, lm=lm, tokenizer=tokenizer), d.detect(texts, lm=lm, tokenizer=tokenizer)
    )
    assert isinstance(from_pretrained(out), Dictionary)
    # saving what was loaded gives the same files
    again = loaded.save_pretrained(tmp_path / "again")
    assert (again / "config.json").read_text() == (out / "config.json").read_text()
    assert (again / "dictionary.safetensors").read_bytes() == (out / "dictionary.safetensors").read_bytes()


def test_dictionary_card_and_old_layout(tmp_path, monkeypatch):
    d = _dictionary("smollm2-135m-instruct")
    out = d.save_pretrained(tmp_path / "dict")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and "concept-dictionary" in card.data.tags
    assert "residual stream after block 1" in card.text and "| `val/auroc` | 0.8 |" in card.text
    assert "lit-interventions fit --config configs/diffmean.yaml" in card.text and "rent" in card.text
    config = json.loads((out / "config.json").read_text())
    assert (
        config["kind"] == "dictionary"
        and config["concepts"] == d.concepts
        and config["weights"] == "dictionary.safetensors"
    )
    # the old layout (NAME.safetensors + NAME.json) loads by directory too
    d.save(tmp_path / "old" / "dictionary.safetensors")
    torch.testing.assert_close(Dictionary.from_pretrained(tmp_path / "old").vectors, d.vectors)
    # and from the hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(out))
    assert Dictionary.from_pretrained("someone/dict").concepts == d.concepts


def test_dictionary_push_to_hub(tmp_path, uploads):
    assert _dictionary("smollm2-135m-instruct").push_to_hub("someone/dict") == "commit-info"
    upload = uploads[-1][2]
    assert upload["files"] == ["README.md", "config.json", "dictionary.safetensors"]
    assert "dictionary.safetensors" in upload["allow_patterns"]


def test_base_model_ids(tmp_path):
    assert hub.base_model("gemma-3-270m") == "google/gemma-3-270m"
    assert hub.base_model("EleutherAI/pythia-70m") == "EleutherAI/pythia-70m"
    assert hub.base_model("model.gguf") is None and hub.base_model(None) is None
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "EleutherAI/pythia-70m"}))
    assert hub.base_model(str(tmp_path)) == "EleutherAI/pythia-70m"


def test_export_dictionary_callback_writes_the_hub_layout(tmp_path, monkeypatch):
    """ExportDictionary writes dictionary.safetensors and one card, config.json, with README.md and
    the command that ran (here: a fit started from Python)."""
    from types import SimpleNamespace

    from lit_interventions.callbacks.dictionary import ExportDictionary

    d = _dictionary("smollm2-135m-instruct")
    d.card.pop("command")
    module = SimpleNamespace(to_dictionary=lambda training_data: d)
    trainer = SimpleNamespace(
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        is_global_zero=True,
        datamodule=None,
        state=SimpleNamespace(fn="fit"),
        logger=None,
    )
    monkeypatch.setattr("sys.argv", ["pytest"])
    ExportDictionary().on_fit_end(trainer, module)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "config.json",
        "dictionary.safetensors",
    ]
    command = "lit-interventions fit --config config.yaml"  # the run's own config.yaml, beside the card
    assert json.loads((tmp_path / "config.json").read_text())["command"] == command
    assert command in (tmp_path / "README.md").read_text()
    loaded = Dictionary.from_pretrained(tmp_path)
    assert torch.equal(loaded.vectors, d.vectors) and loaded.card["command"] == command
    monkeypatch.setattr("sys.argv", ["/usr/bin/lit-interventions", "fit", "--config", "configs/diffmean.yaml"])
    assert hub.trainer_command(trainer, tmp_path) == "lit-interventions fit --config configs/diffmean.yaml"
    monkeypatch.setattr("sys.argv", ["train.py", "fit", "--model.lm", "a b"])
    assert hub.trainer_command(trainer, tmp_path) == "python train.py fit --model.lm 'a b'"


def test_a_readme_or_config_of_someone_else_is_never_replaced(tmp_path):
    (tmp_path / "README.md").write_text("# my project\n")
    with pytest.raises(FileExistsError, match="README.md not written by lit-interventions"):
        save_pretrained(tmp_path, _das(), CARD)
    assert (tmp_path / "README.md").read_text() == "# my project\n" and not (tmp_path / "config.json").exists()
    (tmp_path / "README.md").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileExistsError, match="config.json"):
        _dictionary("smollm2-135m-instruct").save_pretrained(tmp_path)
    # its own files are replaced: saving twice works
    out = save_pretrained(tmp_path / "own", _das(), CARD)
    save_pretrained(out, _das(), {**CARD, "layer": 4})
    assert json.loads((out / "config.json").read_text())["layer"] == 4


def test_from_pretrained_loads_an_sae_directory_by_its_files(tmp_path):
    """A directory ExportSAE wrote (sae.safetensors + sae.json, no config.json) loads as the SAE
    featurizer: encode and decode as the trained SAE on raw activations."""
    from safetensors.torch import save_file

    from lit_interventions.interventions.featurizers import SAEFeaturizer
    from lit_interventions.modules.sae import SparseAutoencoder

    torch.manual_seed(0)
    sae = SparseAutoencoder(8, 16)
    sae.initialize(torch.randn(8), 2.0)
    save_file({k: v.contiguous() for k, v in sae.export_weights().items()}, tmp_path / "sae.safetensors")
    (tmp_path / "sae.json").write_text(json.dumps({"method": "sae", "hidden_size": 8}))
    loaded = from_pretrained(tmp_path)
    x = torch.randn(5, 8)
    assert type(loaded) is SAEFeaturizer
    torch.testing.assert_close(loaded.encode(x), sae.encode(x).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        loaded.decode(loaded.encode(x)), sae.decode(sae.encode(x)).detach(), rtol=1e-5, atol=1e-6
    )


def test_from_pretrained_refuses_an_unknown_kind_and_an_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"library_name": "lit-interventions", "kind": "pickle"}))
    with pytest.raises(
        ValueError, match=r"kind='pickle' is not one of \['dictionary', 'intervention', 'sae', 'steering'\]"
    ):
        from_pretrained(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no lit-interventions artifact"):
        from_pretrained(empty)


# --- no absolute local path in what is shared ------------------------------------------------------


def test_a_run_shares_no_absolute_local_path(tmp_path, tiny_lm_dir, uploads):
    """A pairs run from a data file and into a root given as absolute paths: its card (config.json,
    README.md) names the file by its name and sha256 and the rest by name, and what `push_to_hub`
    sends (config.yaml too) holds no absolute path of the run's."""
    import hashlib
    import shutil

    from tests.helpers import ROOT, run_command

    lm = tiny_lm_dir("gpt2")
    assert not str(lm).startswith(str(tmp_path))  # the LM's directory is recorded as it is (apply checks it)
    data = tmp_path / "mine" / "tense.jsonl"
    data.parent.mkdir()
    shutil.copy(ROOT / "examples" / "data" / "pairs.jsonl", data)
    fit = run_command(
        "train.py", "fit", "--config", "configs/das_pairs.yaml", f"--data.path={data}", f"--model.lm={lm}",
        "--model.layer=1", "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-2000:]
    (card,) = (tmp_path / "runs").rglob("config.json")
    run = card.parent
    config = json.loads(card.read_text())
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    assert config["data"]["path"] == f"tense.jsonl (sha256 {digest})"
    assert "--data.path=tense.jsonl" in config["command"] and "--trainer.default_root_dir=runs" in config["command"]
    for name in ("config.json", "README.md"):
        assert str(tmp_path) not in (run / name).read_text(), name
    assert str(tmp_path) in (run / "config.yaml").read_text()  # the local config keeps them: it reruns here
    hub.push_to_hub(run, "someone/tense")
    sent = uploads[-1][2]
    assert "config.yaml" in sent["files"] and not any(f.endswith(".ckpt") or "tfevents" in f for f in sent["files"])
    for name, text in sent["texts"].items():
        assert str(tmp_path) not in text, name
    assert "path: tense.jsonl" in sent["texts"]["config.yaml"]
