"""The example data files in `examples/data/` (the formats `docs/data.md` describes), read by the
real readers and data modules: the CausalGym template file trains through `fit`, the RAVEL
directory and the AxBench concept directory load with the counts their files hold, and the
AxBench directory fits a dictionary through `fit` (tiny random-init models, fast)."""

from pathlib import Path

import pandas as pd
import pytest
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import load_concepts
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from lit_interventions.datamodules.ravel import RavelDataModule
from lit_interventions.datamodules.ravel_files import entity_types, load_ravel
from lit_interventions.datamodules.templates import load_task
from safetensors.torch import load_file

from lit_interventions.cli.commands import run
from lit_interventions.metrics.detection import UNSCORED
from tests.conftest import HIDDEN

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
TEMPLATES = EXAMPLES / "templates.json"
RAVEL = EXAMPLES / "ravel"
AXBENCH = EXAMPLES / "axbench"
BIKE, ARROW = "references to bicycles and cycling", "JavaScript arrow functions"


def test_the_example_files_are_small():
    sizes = {p.relative_to(EXAMPLES).as_posix(): p.stat().st_size for p in EXAMPLES.rglob("*") if p.is_file()}
    assert len(sizes) == 15 and max(sizes.values()) < 10240, sizes


def test_the_example_task_has_the_regions_and_pairs_its_file_defines():
    task = load_task("animal_sound", TEMPLATES)
    assert task.regions == ["time", ", the", "animal", "prep", "the", "place", "began to"]
    assert task.label_region == "animal" and task.types == ["dog", "cat"]
    assert task.label_words() == {"dog": [" bark", " growl"], "cat": [" meow", " purr"]}
    assert task.distinct_pairs() == 5 * 4 * 4 * 3 * 8  # time x dog x cat x prep x place


def test_the_example_templates_train_das_through_fit(tmp_path, tiny_lm_dir):
    argv = [
        "fit",
        "--config",
        "das.yaml",
        f"--data.templates={TEMPLATES}",
        "--data.task=animal_sound",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        "--model.layer=1",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        "--trainer.val_check_interval=1.0",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    cli = run(argv)
    data = cli.datamodule
    assert isinstance(data, CausalGymDataModule) and data.region == "animal"
    assert {split: len(examples) for split, examples in data.splits.items()} == {"train": 24, "dev": 8, "eval": 8}
    assert all(e.base_type != e.source_type for e in data.splits["train"])
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.parts[-3:] == ("animal_sound", "layer1", "version_0")
    assert (log_dir / "intervention.safetensors").is_file()


def test_the_example_ravel_directory_loads_with_its_entities_templates_and_splits(tiny_lm_dir):
    assert entity_types(RAVEL) == ["animal"]
    data = load_ravel(RAVEL, "animal")
    assert data.attributes == ["Class", "Home"] and len(data.entities) == 17 and len(data.wikipedia) == 8
    assert "hawk" not in data.values("Home") and data.values("Home")["lizard"] == "desert"
    splits = list(data.entity_split.values())
    assert {s: splits.count(s) for s in ("train", "val", "test")} == {"train": 9, "val": 4, "test": 4}
    module = RavelDataModule(
        lm=tiny_lm_dir("gpt2"), ravel_dir=str(RAVEL), entity_type="animal", target_attribute="Class"
    )
    assert module.attributes == ["Class", "Home"]
    # entity split: the split's entities (with a value) x the attribute's 3 templates
    assert len(module.candidates("Class", "train")) == 9 * 3 and len(module.candidates("Home", "train")) == 8 * 3
    assert len(module.candidates("Class", "val")) == 4 * 3
    context = RavelDataModule(
        lm=tiny_lm_dir("gpt2"), ravel_dir=str(RAVEL), entity_type="animal", target_attribute="Home", split="context"
    )
    assert len(context.candidates("Class", "test")) == 17  # every entity x the attribute's 1 test template


@pytest.mark.parametrize("genre_negatives", [False, True])
def test_the_example_axbench_directory_loads_its_concepts_and_rows(tiny_lm_dir, genre_negatives):
    data = AxBenchDataModule(lm=tiny_lm_dir("gpt2"), concept_dir=str(AXBENCH), genre_negatives=genre_negatives)
    assert data.concepts == [BIKE, ARROW] and data.concept_genres == ["text", "code"]
    data.setup()
    train, evaluation = data.splits["train"], data.splits["eval"]
    assert len(train) == 12 and len(evaluation) == 10  # 8 positives + 4 negatives (pool, or each by its genre)
    assert sum(e.label for e in train) == 8 and sum(e.label == 1 for e in evaluation) == 4
    assert sum(e.label == UNSCORED for e in evaluation) == 2  # hard negatives: left out of the AUROC, as AxBench
    negatives = sorted(e.concept_id for e in train if e.label == 0)
    assert negatives == ([0, 0, 1, 1] if genre_negatives else [-1, -1, -1, -1])  # by genre, or the shared pool
    assert sorted(e.category for e in evaluation if e.concept_id == 1) == [0, 0, 1, 1, 2]


def test_the_example_axbench_rows_read_the_same_as_parquet(tmp_path):
    for name in ("train_data", "latent_eval_data"):
        pd.read_json(AXBENCH / f"{name}.jsonl", lines=True).to_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / "metadata.jsonl").write_bytes((AXBENCH / "metadata.jsonl").read_bytes())
    jsonl, parquet = load_concepts(AXBENCH), load_concepts(tmp_path)
    assert parquet.train_path.suffix == ".parquet" and parquet.concepts == jsonl.concepts
    pd.testing.assert_frame_equal(parquet.train, jsonl.train)
    pd.testing.assert_frame_equal(parquet.eval, jsonl.eval)


def test_the_example_axbench_directory_fits_a_dictionary_through_fit(tmp_path, tiny_lm_dir):
    argv = [
        "fit",
        "--config",
        "diffmean.yaml",
        f"--data.concept_dir={AXBENCH}",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    cli = run(argv)
    tensors = load_file(Path(cli.trainer.log_dir) / "dictionary.safetensors")
    assert {tuple(t.shape) for t in tensors.values() if t.dim() == 2} == {(2, HIDDEN)}
