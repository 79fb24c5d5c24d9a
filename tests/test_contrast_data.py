"""Contrast-pair files (`datamodules/contrast.py`, `datamodules/contrast_files.py`): .jsonl, .csv
and a `save_to_disk` directory give the same rows; pairs become AxBench's rows (a prompt as the
instruction, or the text alone); a bad row is one line naming the row and the field, before any
model loads; DiffMean fitted from a file equals the mean difference of its states computed by
hand, detects a planted concept on the held-out pairs, and the console command writes a dictionary
that `detect` and `generate` use (tiny random-init models)."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from lit_interventions.datamodules.axbench_files import CATEGORIES, NEGATIVE_POOL
from lit_interventions.datamodules.contrast import ContrastDataModule
from lit_interventions.datamodules.contrast_files import assign_splits, read_contrast
from transformers import AutoModelForCausalLM

from lit_interventions.artifacts.dictionary import Dictionary
from lit_interventions.cli.commands import run
from lit_interventions.interventions.directions import PCADirection, ProbeDirection
from lit_interventions.modules.steering_closed_form import fit_concept_direction
from tests.helpers import run_command, write_jsonl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
CONTRAST = EXAMPLES / "contrast.jsonl"
PLACES = ["garden", "kitchen", "hallway", "yard", "barn", "shed", "attic", "porch", "room", "park"]
# a planted concept: the positive text names a dog, its negative a man; the same prompt
PLANTED = [
    {
        "prompt": f"Tell me about the {place}.",
        "positive": f"The dog is in the {place}.",
        "negative": f"The man is in the {place}.",
    }
    for place in PLACES
]


def fields(rows) -> list[tuple]:
    return [(row.concept, row.prompt, row.positive, row.negative, row.split) for row in rows]


def served(data: ContrastDataModule) -> dict:
    return {split: [vars(e) for e in examples] for split, examples in data.splits.items()}


def _shared(path: Path) -> str:
    """How a card names a data file (`artifacts.shareable`): its name and sha256, never its path."""
    return f"{path.name} (sha256 {hashlib.sha256(path.read_bytes()).hexdigest()})"


def test_jsonl_csv_and_a_saved_dataset_give_the_same_rows(tmp_path, tiny_lm_dir):
    datasets = pytest.importorskip("datasets")
    jsonl, table = read_contrast(str(CONTRAST)), read_contrast(str(EXAMPLES / "contrast.csv"))
    assert len(jsonl) == 32 and fields(jsonl) == fields(table)
    assert {row.concept for row in jsonl} == {"the ocean"} and all(row.prompt for row in jsonl)
    assert jsonl[6].where == "contrast.jsonl row 7" and table[6].where == "contrast.csv row 7"
    assert jsonl[0].positive == "I walked along the shore while the tide rolled in over the sand."
    saved = tmp_path / "saved"
    raw = [json.loads(line) for line in CONTRAST.read_text().splitlines()]
    datasets.Dataset.from_list(raw).save_to_disk(saved)
    assert fields(read_contrast(str(saved))) == fields(jsonl)
    lm = tiny_lm_dir("gpt2")
    found = []
    for path in (CONTRAST, EXAMPLES / "contrast.csv", saved):
        data = ContrastDataModule(str(path), lm=lm)
        data.setup()
        found.append(served(data))
    assert found[0] == found[1] == found[2]
    # 32 pairs: round(32 * 0.2) = 6 held out; a positive and a negative example each
    assert {split: len(examples) for split, examples in found[0].items()} == {"train": 2 * 26, "eval": 2 * 6}


def test_rows_are_split_per_concept_by_the_seed_and_keep_their_own_split(tmp_path):
    rows = [{"positive": f"a dog {i}", "negative": f"a man {i}"} for i in range(10)]
    rows += [{"concept": "cats", "positive": f"a cat {i}", "negative": f"a man {i}"} for i in range(5)]
    rows[0] |= {"split": "test"}
    rows[1] |= {"split": "val"}
    rows[2] |= {"split": "train"}
    read = read_contrast(str(write_jsonl(tmp_path / "dogs.jsonl", rows)))
    assert [row.concept for row in read] == ["dogs"] * 10 + ["cats"] * 5  # the stem names rows without one
    splits = assign_splits(read, 0.2, 0, "dogs.jsonl")
    evaluation = [row.positive for row in splits["eval"]]
    # dogs: the 2 rows split val / test, then round(7 * 0.2) = 1 of the 7 unsplit; cats: round(5 * 0.2) = 1
    assert evaluation[:2] == ["a dog 0", "a dog 1"] and len(evaluation) == 4
    assert {row.concept for row in splits["eval"]} == {"dogs", "cats"} and len(splits["train"]) == 11
    assert splits == assign_splits(read, 0.2, 0, "dogs.jsonl") and splits != assign_splits(read, 0.2, 1, "dogs.jsonl")
    named = read_contrast(str(tmp_path / "dogs.jsonl"), concept="a dog")
    assert [row.concept for row in named][:10] == ["a dog"] * 10
    with pytest.raises(ValueError, match=r"^dogs\.jsonl: concept 'cats' has 0 eval rows of its 5 \(its AUROC needs"):
        assign_splits(read, 0.0, 0, "dogs.jsonl")
    with pytest.raises(ValueError, match=r"^eval_fraction=1\.5 must be a number in \[0, 1\)$"):
        assign_splits(read, 1.5, 0, "dogs.jsonl")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"negative": "a man"}, "'positive' is missing"),
        ({"positive": "", "negative": "a man"}, "'positive' is empty"),
        ({"positive": "a dog", "negative": "  "}, "'negative' is empty"),
        ({"positive": "a dog", "negative": 7}, "'negative' is 7; a string is needed"),
        ({"positive": "a dog", "negative": "a man", "prompt": ["hi"]}, "'prompt' is ['hi']; a string is needed"),
        ({"positive": "a dog", "negative": "a man", "postive": "x"}, "unknown field 'postive'; the fields are"),
        (
            {"positive": "a dog", "negative": "a man", "split": "dev"},
            "'split' is 'dev'; choose one of train, val, test",
        ),
        ({"positive": "a dog", "negative": "a dog"}, "'negative' is the same text as 'positive'"),
    ],
)
def test_a_bad_row_is_one_line_naming_the_row_and_the_field_before_any_model_loads(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"positive": "a dog", "negative": "a man"}, row])
    with pytest.raises(ValueError) as err:
        ContrastDataModule(str(path), lm="no-such-model")  # the file is checked first: no model is looked up
    assert str(err.value).startswith(f"bad.jsonl row 2: {message}") and "\n" not in str(err.value)


def test_bad_files_and_arguments_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("positive,negative\n")
    with pytest.raises(ValueError, match=r"notes\.txt: a contrast file is \.jsonl or \.csv, not '\.txt'$"):
        read_contrast(str(tmp_path / "notes.txt"))
    (tmp_path / "bad.csv").write_text("positive,negative\na dog,a man,extra\n")
    with pytest.raises(ValueError, match=r"^bad\.csv row 1: more values than the header has columns$"):
        read_contrast(str(tmp_path / "bad.csv"))
    (tmp_path / "bad.jsonl").write_text('{"positive": "a dog", "negative": "a man"}\n{"positive": \n')
    with pytest.raises(ValueError, match=r"^bad\.jsonl row 2: not JSON"):
        read_contrast(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no rows; each row needs 'positive' and 'negative'$"):
        read_contrast(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match=r"^padding_side='middle'; choose 'left' or 'right'$"):
        ContrastDataModule(str(CONTRAST), padding_side="middle")
    with pytest.raises(ValueError, match=r"^concept='  ': give the concept's name"):
        ContrastDataModule(str(CONTRAST), concept="  ")


def test_pairs_are_served_as_axbench_rows_with_a_prompt_or_the_text_alone(tmp_path, tokenizer, tiny_lm_dir):
    rows = [dict(row) for row in PLANTED[:4]]
    rows[0] |= {"split": "train"}
    rows[1] |= {"split": "test"}
    del rows[2]["prompt"], rows[3]["prompt"]
    rows[2] |= {"split": "train"}
    rows[3] |= {"split": "test"}
    path = write_jsonl(tmp_path / "dogs.jsonl", rows)
    pool, own = ContrastDataModule(str(path), lm=tiny_lm_dir("gpt2")), None
    pool.setup()
    assert pool.concepts == ["dogs"] and pool.chat is False  # the tiny tokenizer has no chat template
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    positive, negative, alone, alone_negative = pool.splits["train"]
    prompt = [bos, *ids(rows[0]["prompt"] + "\n\n")]
    assert positive.ids == prompt + ids(rows[0]["positive"]) + [eos] and positive.response_start == len(prompt)
    assert (positive.label, positive.concept_id, positive.category) == (1, 0, CATEGORIES["positive"])
    assert negative.ids == prompt + ids(rows[0]["negative"]) + [eos]
    assert (negative.label, negative.concept_id) == (0, NEGATIVE_POOL)  # the shared pool (closed-form methods)
    assert alone.ids == [bos, *ids(rows[2]["positive"]), eos] and alone.response_start == alone.prefix == 1
    assert alone.output_end == len(alone.ids) - 1 and (alone.label, alone.concept_id) == (1, 0)
    assert (alone_negative.label, alone_negative.concept_id) == (0, NEGATIVE_POOL)
    held_out = pool.splits["eval"]
    assert [(e.label, e.concept_id) for e in held_out] == [(1, 0), (0, 0), (1, 0), (0, 0)]  # scored for the concept
    assert held_out[2].ids == [bos, *ids(rows[3]["positive"]), eos]
    own = ContrastDataModule(str(path), lm=tiny_lm_dir("gpt2"), genre_negatives=True)
    own.setup()
    assert [e.concept_id for e in own.splits["train"]] == [0, 0, 0, 0]  # negatives train with their pair's concept
    batch = next(iter(pool.val_dataloader()))
    assert batch["label"].tolist() == [1, 0, 1, 0] and batch["content_mask"][2].sum() == len(held_out[2].ids) - 1


def states_by_hand(model, tokenizer, rows: list[dict], layer: int, side: str) -> torch.Tensor:
    """The residual stream after block `layer` at the tokens of each row's `side` text (not the
    EOS that follows it), the row's prompt and text formatted by hand (`<bos>prompt\\n\\ntext<eos>`),
    (n, d)."""
    found = []
    for row in rows:
        prompt = [tokenizer.bos_token_id, *tokenizer(row["prompt"] + "\n\n", add_special_tokens=False)["input_ids"]]
        text = tokenizer(row[side], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model(torch.tensor([prompt + text + [tokenizer.eos_token_id]]), output_hidden_states=True)
        found.append(out.hidden_states[layer + 1][0, len(prompt) : len(prompt) + len(text)])
    return torch.cat(found)


def test_diffmean_from_a_file_is_the_mean_difference_by_hand_and_detects_held_out_pairs(
    tmp_path, tokenizer, tiny_lm_dir
):
    lm = tiny_lm_dir("llama")
    path = write_jsonl(tmp_path / "dogs.jsonl", PLANTED)
    argv = [
        "fit", "--config", "diffmean_contrast.yaml", f"--data.path={path}", f"--model.lm={lm}", "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    cli = run(argv)
    data, module = cli.datamodule, cli.model
    train = [row for row in PLANTED if row["positive"] in set(data.data.train["output"])]
    held_out = [row for row in PLANTED if row not in train]
    assert len(train) == 8 and len(held_out) == 2  # round(10 * 0.2) held out
    model = AutoModelForCausalLM.from_pretrained(lm).eval()
    w = states_by_hand(model, tokenizer, train, 1, "positive").mean(0) - states_by_hand(
        model, tokenizer, train, 1, "negative"
    ).mean(0)
    assert module.concepts == ["dogs"]
    torch.testing.assert_close(module.dictionary.weight[0], w / w.norm(), atol=1e-5, rtol=0)
    assert cli.trainer.callback_metrics["val/auroc/dogs"].item() == 1.0  # every held-out positive above its negative
    directory = Path(cli.trainer.log_dir)
    dictionary = Dictionary.from_pretrained(directory)
    assert dictionary.concepts == ["dogs"] and dictionary.training_data == _shared(path)
    scores = dictionary.detect(
        [row[side] for row in held_out for side in ("positive", "negative")], tokenizer=tokenizer
    )
    assert scores.shape == (4, 1) and scores[0, 0] > scores[1, 0] and scores[2, 0] > scores[3, 0]


def test_the_example_file_fits_a_dictionary_as_a_user_runs_it(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    done = run_command(
        "train.py", "fit", "--config", "configs/diffmean_contrast.yaml", "--data.path", str(CONTRAST),
        f"--model.lm={lm}", "--model.layer=1", "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    table = out[out.index("fit: final metrics") + 1 : -1]
    shown = {line.split()[0]: line.split()[1] for line in table}
    assert sorted(shown) == ["val/auroc", "val/auroc/the"], out  # the table's first column splits at the space
    run_dir = tmp_path / "layer1" / "version_0"
    assert out[-1] == f"files in {run_dir}" and (run_dir / "dictionary.safetensors").is_file()
    dictionary = Dictionary.from_pretrained(run_dir)
    assert dictionary.concepts == ["the ocean"] and dictionary.method == "diffmean" and dictionary.layer == 1
    steered = run_command(
        "generate", "--artifact", str(run_dir), "--prompt", "Describe your morning.", "--concept", "the ocean",
        "--factor", "2", "--max_new_tokens", "3", "--json",
    )  # fmt: skip
    assert steered.returncode == 0, steered.stderr[-3000:]
    assert set(json.loads(steered.stdout)) >= {"prompt", "unsteered", "steered"}
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"positive": "a dog", "negative": "a man"}, {"positive": "a dog"}])
    refused = run_command("train.py", "fit", "--config", "configs/diffmean_contrast.yaml", "--data.path", str(bad))
    assert refused.returncode == 2 and refused.stderr.strip() == "error: bad.jsonl row 2: 'negative' is missing"


def fitted(tmp_path, lm: str, config: str, *options: str):
    """`train.py fit` of an AxBench config on the planted pairs, its data swapped for a contrast
    file; the CLI and the dictionary it wrote."""
    tmp_path.mkdir(exist_ok=True)
    path = write_jsonl(tmp_path / "dogs.jsonl", PLANTED)
    argv = [
        "fit", "--config", config, "--data", "lit_interventions.datamodules.contrast.ContrastDataModule",
        f"--data.path={path}", f"--model.lm={lm}", "--model.layer=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", *options,
    ]  # fmt: skip
    cli = run(argv)
    dictionary = Dictionary.from_pretrained(Path(cli.trainer.log_dir))
    assert dictionary.concepts == ["dogs"] and dictionary.training_data == _shared(path)
    return cli, dictionary


@pytest.mark.parametrize(
    "config, method", [("pca.yaml", PCADirection()), ("probe.yaml", ProbeDirection(l2=1e-3, bias=False))]
)
def test_pca_and_the_probe_from_a_file_are_their_fits_on_the_text_tokens_by_hand(
    tmp_path, tokenizer, tiny_lm_dir, config, method
):
    lm = tiny_lm_dir("llama")
    cli, dictionary = fitted(tmp_path, lm, config)
    train = [row for row in PLANTED if row["positive"] in set(cli.datamodule.data.train["output"])]
    model = AutoModelForCausalLM.from_pretrained(lm).eval()
    positives = states_by_hand(model, tokenizer, train, 1, "positive")
    negatives = states_by_hand(model, tokenizer, train, 1, "negative")
    hand = fit_concept_direction(method, positives, negatives)  # pca: on the positives, oriented
    torch.testing.assert_close(dictionary.vectors[0], torch.as_tensor(hand).float(), atol=1e-4, rtol=0)


def test_lat_ssv_and_reft_r1_train_from_a_contrast_file(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    # the configs' data options that ContrastDataModule also takes carry over (reft_r1.yaml: genre_negatives)
    for config in ("lat.yaml", "ssv.yaml", "reft_r1.yaml"):
        cli, dictionary = fitted(tmp_path / config, lm, config, "--trainer.max_epochs=1")
        torch.testing.assert_close(dictionary.vectors, cli.model.to_dictionary().vectors)
        assert dictionary.method == config.removesuffix(".yaml")
        assert cli.datamodule.genre_negatives == (config == "reft_r1.yaml")
        assert dictionary.auroc["per_concept"]["dogs"] == pytest.approx(
            float(cli.trainer.callback_metrics["val/auroc"])
        )
    with pytest.raises(ValueError, match="genre_negatives"):  # ReFT-r1's train_on_negative needs each pair's concept
        fitted(tmp_path / "refused", lm, "reft_r1.yaml", "--trainer.max_epochs=1", "--data.genre_negatives=false")
