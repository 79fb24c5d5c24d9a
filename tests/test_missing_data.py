"""Data a command reads that is absent or empty (a RAVEL or AxBench directory, SyntaxGym suites,
CausalGym templates) is one `error:` line, exit 2, that says so and names the
`lit-interventions data NAME --out DIR` command that fetches it, with the directory it was given."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from lit_interventions.datamodules.axbench_files import load_concepts
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL, load_ravel
from lit_interventions.datamodules.templates import load_templates

from lit_interventions.studies.syntaxgym.suites import load_suite, suite_paths
from tests.helpers import run_command

RAVEL_FILES = "ravel_<type>_entity_attributes.json"


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


def _ravel(directory: Path) -> str:
    return f"fetch RAVEL with `lit-interventions data ravel --out {directory}`"


def _axbench(directory: Path) -> str:
    return f"`lit-interventions data axbench-concept10 --out {directory}` (or axbench-concept500)"


def _suites(directory: Path) -> str:
    return f"fetch the SyntaxGym suites with `lit-interventions data syntaxgym --out {directory}`"


def _templates(directory: Path) -> str:
    return (
        f"fetch CausalGym's templates with `lit-interventions data causalgym --out {directory}` and pass "
        f"--data.templates {directory / 'templates.json'}"
    )


@pytest.mark.parametrize("benchmark", ["ravel", "axbench", "syntaxgym", "causalgym"])
def test_console_script_on_an_empty_folder_names_the_data_command(tmp_path, tiny_lm_dir, benchmark):
    empty = tmp_path / "data"
    empty.mkdir()
    runs = tmp_path / "runs"
    fit = [f"--model.lm={tiny_lm_dir('llama')}", "--model.layer=1", f"--trainer.default_root_dir={runs}"]
    args, expected = {
        "ravel": (
            ("train.py", "fit", "--config", "ravel/mdas.yaml", *fit, f"--data.ravel_dir={empty}"),
            f"RAVEL directory {empty} holds no RAVEL files ({RAVEL_FILES}); {_ravel(empty)}",
        ),
        "axbench": (
            ("fit", "--config", "reft_r1.yaml", *fit, f"--data.concept_dir={empty}"),
            f"Concept directory {empty} holds no AxBench files (metadata.jsonl, train_data.parquet, "
            f"latent_eval_data.parquet); fetch them with {_axbench(empty)}",
        ),
        "syntaxgym": (
            ("syntaxgym", "--suites", str(empty), "--lm", "unused", "--out", str(tmp_path / "sg.csv")),
            f"no *.json suite files in directory {empty}; {_suites(empty)}",
        ),
        "causalgym": (
            ("train.py", "fit", "--config", "das.yaml", *fit, f"--data.templates={empty}"),
            f"--data.templates {empty} is a directory, not a JSON file, and holds no templates.json; "
            f"{_templates(empty)}",
        ),
    }[benchmark]
    assert _one_line(run_command(*args)) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no run directory, no CSV


def test_a_missing_ravel_directory_and_a_nested_copy(tmp_path):
    with pytest.raises(ValueError) as err:
        load_ravel(tmp_path / "ravel", "city")
    assert str(err.value) == f"RAVEL directory {tmp_path / 'ravel'} does not exist; {_ravel(tmp_path / 'ravel')}"
    nested = tmp_path / "ravel" / "data"  # data.tgz extracted as is, one level down
    nested.mkdir(parents=True)
    shutil.copy(BUILTIN_RAVEL / "ravel_city_entity_attributes.json", nested)
    with pytest.raises(ValueError) as err:
        load_ravel(tmp_path / "ravel", "city")
    assert str(err.value) == (
        f"RAVEL directory {tmp_path / 'ravel'} holds no RAVEL files ({RAVEL_FILES}); {nested} does: pass that directory"
    )


def test_an_empty_ravel_file_names_the_data_command(tmp_path):
    for path in BUILTIN_RAVEL.glob("*.json"):
        shutil.copy(path, tmp_path)
    (tmp_path / "ravel_city_entity_to_split.json").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        load_ravel(tmp_path, "city")
    assert str(err.value) == (
        f"{tmp_path / 'ravel_city_entity_to_split.json'} is empty; restore the file or "
        f"fetch RAVEL again with `lit-interventions data ravel --out {tmp_path}`"
    )


def test_a_missing_concept_directory_names_the_data_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_concepts(tmp_path / "concept10")
    assert str(err.value) == (
        f"Concept directory {tmp_path / 'concept10'} does not exist; fetch AxBench with {_axbench(tmp_path / 'concept10')}"
    )


def test_missing_and_empty_suites_name_the_data_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        suite_paths([str(tmp_path / "suites")])
    assert str(err.value) == (
        f"--suites path not found: {tmp_path / 'suites'} (give a directory of *.json or suite files); "
        f"{_suites(tmp_path / 'suites')}"
    )
    with pytest.raises(FileNotFoundError) as err:
        suite_paths([str(tmp_path / "suites" / "mvrr.json")])  # a file: fetched into its directory
    assert str(err.value).endswith(_suites(tmp_path / "suites"))
    empty = tmp_path / "mvrr.json"
    empty.write_bytes(b"")
    with pytest.raises(ValueError) as err:
        load_suite(empty)
    assert str(err.value) == f"suite file {empty} is empty; {_suites(tmp_path)}"


def test_missing_and_empty_template_files_name_the_data_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_templates(tmp_path / "causalgym" / "templates.json")
    assert str(err.value) == (
        f"Template file not found: {tmp_path / 'causalgym' / 'templates.json'} (--data.templates must name a JSON "
        f"file); {_templates(tmp_path / 'causalgym')}"
    )
    (tmp_path / "templates.json").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        load_templates(tmp_path / "templates.json")
    assert str(err.value) == f"Template file {tmp_path / 'templates.json'} is empty; {_templates(tmp_path)}"
    with pytest.raises(FileNotFoundError) as err:
        load_templates(tmp_path)  # the folder `data causalgym --out` wrote, not its file
    assert (
        str(err.value)
        == f"--data.templates {tmp_path} is a directory; pass the file in it: {tmp_path / 'templates.json'}"
    )
