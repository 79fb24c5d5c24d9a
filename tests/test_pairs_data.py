"""Counterfactual pairs files (`datamodules/pairs.py`, `datamodules/pairs_files.py`): .jsonl, .csv
and a `save_to_disk` directory give the same pairs; a row's position is the last token of its
substring; a bad row is one line naming the row and the field, before any model loads; the
example file trains DAS through `train.py fit` and fits DiffMean (tiny random-init models)."""

import json
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.pairs import PairsDataModule
from lit_interventions.datamodules.pairs_files import read_pairs
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lit_interventions.cli.commands import run
from lit_interventions.core.batch import CAUSE, ISO
from tests.helpers import run_command, write_csv, write_jsonl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
PAIRS = EXAMPLES / "pairs.jsonl"
FIELDS = ["base", "source", "base_label", "source_label", "base_position", "source_position", "split", "type"]
ROW = {"base": "The keys to the cabinet", "source": "The key to the cabinet", "base_label": "are", "source_label": "is"}


def example_rows() -> list[dict]:
    return [json.loads(line) for line in PAIRS.read_text().splitlines()]


def served(data: PairsDataModule) -> dict:
    return {
        split: [(e.base_text, e.source_text, e.base_ids, e.base_positions, e.base_label, e.kind) for e in examples]
        for split, examples in data.splits.items()
    }


def test_jsonl_csv_and_a_saved_dataset_give_the_same_pairs(tmp_path, tiny_lm_dir):
    datasets = pytest.importorskip("datasets")
    rows = example_rows()
    rows[0] |= {"split": "test"}
    rows[1] |= {"type": "iso", "source_label": rows[1]["base_label"], "split": "train"}
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{field: row.get(field) for field in FIELDS} for row in rows]).save_to_disk(saved)
    lm = tiny_lm_dir("gpt2")
    found = []
    for path in (write_jsonl(tmp_path / "p.jsonl", rows), write_csv(tmp_path / "p.csv", rows, FIELDS), saved):
        data = PairsDataModule(str(path), lm=lm, multitask=True)
        data.setup()
        found.append(served(data))
    assert found[0] == found[1] == found[2]
    counts = {split: len(examples) for split, examples in found[0].items()}
    assert counts == {"train": 2 * 29, "dev": 2 * 9, "eval": 2 * 10}  # 47 unsplit: 9 val, 9 test, 29 train; doubled
    assert found[0]["eval"][0][0] == rows[0]["base"]
    assert [kind for *_, kind in found[0]["train"]].count(ISO) == 2
    assert all(kind == CAUSE for *_, kind in found[0]["eval"])


def test_the_rows_of_the_files_are_read_as_written():
    rows = read_pairs(str(EXAMPLES / "pairs.csv"))
    assert len(rows) == 8 and [row.split for row in rows] == ["train"] * 6 + ["val", "test"]
    assert [row.kind for row in rows] == ["cause"] * 4 + ["iso"] * 2 + ["cause"] * 2
    assert rows[6].base_position == "The bottles" and rows[0].where == "pairs.csv row 1"
    example = read_pairs(str(PAIRS))
    assert len(example) == 48 and {row.base_label for row in example} == {"are", "is"}
    assert example[6].where == "pairs.jsonl row 7" and example[6].split is None and example[6].kind == "cause"


@pytest.fixture(scope="module")
def word_lm(tmp_path_factory):
    """A directory holding a word-level tokenizer: one token per word, so indices are counted by hand."""
    words = ["<pad>", "<bos>", "<eos>", "The", "keys", "key", "to", "the", "cabinet", "are", "is"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("word-lm")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "position, site",  # <bos> The keys to the cabinet: tokens 0 1 2 3 4 5
    [(None, 5), ("keys", 2), ("The keys", 2), ("keys to", 3), ("the cab", 5), ("e", 5), ("The", 1)],
)
def test_the_site_is_the_last_token_of_the_position(tmp_path, word_lm, position, site):
    rows = [ROW | {"base_position": position, "split": split} for split in ("train", "val", "test")]
    data = PairsDataModule(str(write_jsonl(tmp_path / "p.jsonl", rows)), lm=word_lm, prepend_space=False)
    data.setup()
    example = data.splits["train"][0]
    assert example.base_ids == [1, 3, 4, 6, 7, 8]
    assert example.base_positions == {"site": site, "last": 5}
    assert example.source_positions == {"site": 5, "last": 5}
    assert (example.base_label, example.source_label) == (9, 10)
    batch = next(iter(data.loader("train", 2)))  # the pair, then its swap
    assert batch.base.pos.tolist() == [site, 5] and batch.source.pos.tolist() == [5, site]
    assert batch.target.tolist() == [10, 9] and batch.base.types == ["are", "is"]


BAD = [
    ({"source_label": None}, "row 2: 'source_label' is missing"),
    ({"base_label": "  "}, "row 2: 'base_label' is empty"),
    ({"base_position": "drawer"}, "row 2: 'base_position' 'drawer' does not occur in base 'The keys to the cabinet'"),
    ({"split": "dev"}, "row 2: 'split' is 'dev'; choose one of train, val, test"),
    ({"type": "iso", "split": "val"}, "row 2: 'split' is 'val', but an iso pair trains only; give it split train"),
    ({"base_label": "is"}, "row 2: 'source_label' equals 'base_label' ('is'); a cause pair's label must change"),
    ({"source": "The keys to the cabinet"}, "row 2: 'source' is the same sentence as 'base'"),
    ({"base_postion": "keys"}, "row 2: unknown field 'base_postion'"),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
@pytest.mark.parametrize("change, message", BAD, ids=[m.split(": ")[1][:24] for _, m in BAD])
def test_a_bad_row_is_one_line_naming_the_row_and_the_field(tmp_path, monkeypatch, suffix, change, message):
    if "base_postion" in change and suffix == ".csv":
        pytest.skip("a CSV's columns are its header's")
    monkeypatch.setattr("lit_interventions.datamodules.pairs.load_tokenizer", _no_model)
    bad = {k: v for k, v in (ROW | change).items() if v is not None}
    path = tmp_path / f"bad{suffix}"
    write_jsonl(path, [ROW, bad]) if suffix == ".jsonl" else write_csv(path, [ROW, bad], FIELDS)
    with pytest.raises(ValueError) as err:
        PairsDataModule(str(path))
    assert str(err.value).startswith(f"bad{suffix} {message}") and "\n" not in str(err.value)


def _no_model(lm):
    raise AssertionError("a bad row is refused before the tokenizer or any model loads")


def test_bad_files_and_options_are_refused(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("gpt2")
    three = [ROW, ROW | {"base": "The keys to the box"}, ROW | {"base": "The keys to the door"}]
    with pytest.raises(
        ValueError, match=r"^pairs\.jsonl has no cause pairs for val: give rows split 'val', or val_fraction"
    ):
        PairsDataModule(str(write_jsonl(tmp_path / "pairs.jsonl", three)), lm=lm, val_fraction=0)
    with pytest.raises(ValueError, match=r"/missing\.jsonl: no such file$"):
        PairsDataModule(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"^region='subject'; a pairs file's regions are site, last$"):
        PairsDataModule(str(PAIRS), lm=lm, region="subject")
    with pytest.raises(ValueError, match=r"^multitask=True trains on iso pairs, and pairs\.jsonl has none"):
        PairsDataModule(str(PAIRS), lm=lm, multitask=True)
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROW) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"^bad\.jsonl row 2: a JSON object is needed, not list$"):
        PairsDataModule(str(tmp_path / "bad.jsonl"))
    with pytest.warns(UserWarning, match=r"^pairs\.csv: its 2 iso pairs are left out; --data\.multitask true"):
        PairsDataModule(str(EXAMPLES / "pairs.csv"), lm=lm)


def test_labels_sharing_their_first_token_are_refused(tmp_path, word_lm):
    rows = [ROW | {"split": "train"}, ROW | {"split": "val", "base_label": "are"}, ROW | {"split": "test"}]
    rows[1] |= {"source_label": "are them"}  # first token: 'are'
    with pytest.raises(ValueError, match=r"^p\.jsonl row 2: 'source_label' 'are them' and 'base_label' 'are' share"):
        PairsDataModule(str(write_jsonl(tmp_path / "p.jsonl", rows)), lm=word_lm, prepend_space=False)


def test_the_example_file_trains_das_through_train_py(tmp_path, tiny_lm_dir):
    done = run_command(
        "train.py", "fit", "--config", "configs/das_pairs.yaml", f"--data.path={PAIRS}",
        f"--model.lm={tiny_lm_dir('gpt2')}", "--model.layer=1", "--trainer.max_epochs=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    table = out[out.index("fit: final metrics") + 1 : -1]
    shown = {line.split()[0]: float(line.split()[1]) for line in table}
    assert sorted(shown) == ["train/loss", "val/iia", "val/loss", "val/odds"], done.stdout
    assert round(shown["val/iia"] * 20, 6).is_integer()  # IIA over the 20 val examples (10 pairs, swapped too)
    assert out[-1] == f"files in {tmp_path / 'layer1' / 'version_0'}"


def test_diffmean_fits_on_the_example_file(tmp_path, tiny_lm_dir):
    argv = [
        "fit",
        "--config",
        "configs/das_pairs.yaml",
        f"--data.path={PAIRS}",
        f"--model.lm={tiny_lm_dir('gpt2')}",
        "--model.layer=1",
        "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
        "--model.intervention.method=diffmean",
        "--model.region=last",  # shared with the data module (train.py links them)
        "--trainer.max_epochs=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    cli = run(argv)
    data, module = cli.datamodule, cli.model
    assert isinstance(data, PairsDataModule) and data.region == "last"
    states, labels = [], []
    for batch in data.loader("train", 8, shard=False):
        states.append(module.site_representation(batch, "base").float())
        labels += batch.base.types
    states = torch.cat(states)
    plural = torch.tensor([label == "are" for label in labels])
    assert plural.sum().item() == len(labels) // 2 == 28  # each pair and its swap
    expected = states[plural].mean(0) - states[~plural].mean(0)
    (basis,) = module.intervention.basis  # (d,), its sign free: the interchange on a line ignores it
    torch.testing.assert_close(basis * torch.sign(basis @ expected), expected / expected.norm(), atol=1e-5, rtol=1e-4)
    assert "val/odds" in cli.trainer.callback_metrics
