"""AxBench concept data: built-in set, Concept10 loading, formatting, masks, labels, errors."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import (
    BUILTIN_DIR,
    CATEGORIES,
    COLUMNS,
    load_concepts,
    load_instructions,
)
from lit_interventions.datamodules.axbench_format import collate, encode, split_chat, tokenize_rows

from lit_interventions.core.lm import load_tokenizer

CONCEPT10 = Path(__file__).resolve().parents[2] / "shared" / "data" / "axbench" / "concept10_2b_l20"
needs_concept10 = pytest.mark.skipif(
    not CONCEPT10.exists(),
    reason="Concept10 data not present; get it: lit-interventions data axbench-concept10 --out ../shared/data/axbench/concept10_2b_l20",
)


def test_builtin_set_sizes():
    data = load_concepts()
    assert len(data.concepts) >= 10 and len(data.genres) == len(data.concepts)
    assert {"text", "code", "math"} <= set(data.genres)
    positives = data.train[data.train.category == "positive"].groupby("concept_id").size()
    assert list(positives.index) == list(range(len(data.concepts)))
    assert (positives >= 36).all()
    pool = data.train[data.train.concept_id == -1]
    assert set(pool.category) == {"negative"} and len(pool) >= 36
    per_concept = data.eval.groupby(["concept_id", "category"]).size().unstack()
    assert (per_concept["positive"] >= 24).all() and (per_concept["negative"] >= 36).all()
    assert (per_concept["hard negative"] >= 2).all()


def test_builtin_negative_pool_is_split_between_train_and_eval():
    data = load_concepts()
    train_pool = set(data.train.loc[data.train.concept_id == -1, "output"])
    eval_neg = data.eval[data.eval.category == "negative"]
    assert train_pool.isdisjoint(eval_neg.output)
    # every concept is evaluated on the same replicated eval part of the pool
    sets = [frozenset(g.output) for _, g in eval_neg.groupby("concept_id")]
    assert len(set(sets)) == 1 and len(train_pool) + len(sets[0]) >= 60


def test_builtin_files_have_the_published_fields():
    for name in ("train_data.jsonl", "latent_eval_data.jsonl"):
        row = json.loads((BUILTIN_DIR / name).read_text().splitlines()[0])
        assert set(COLUMNS) <= set(row)
    meta = json.loads((BUILTIN_DIR / "metadata.jsonl").read_text().splitlines()[0])
    assert set(meta) == {"concept_id", "concept", "ref", "concept_genres_map"}
    assert meta["concept_genres_map"] == {meta["concept"]: [load_concepts().genres[0]]}


def test_instructions():
    instructions = load_instructions()
    assert len(instructions) >= 30 and len(set(instructions)) == len(instructions)
    assert all(isinstance(x, str) and len(x) > 10 for x in instructions)


@needs_concept10
def test_concept10_loads_with_counts_of_the_files():
    data = load_concepts(CONCEPT10)
    raw_train = pd.read_parquet(CONCEPT10 / "train_data.parquet")
    raw_eval = pd.read_parquet(CONCEPT10 / "latent_eval_data.parquet")
    assert len(data.concepts) == 10 and len(data.train) == len(raw_train) and len(data.eval) == len(raw_eval)
    assert data.concepts[0] == "references to rental services and associated equipment"
    assert data.genres.count("code") >= 1 and data.genres.count("math") >= 1
    assert (data.train[data.train.category == "positive"].groupby("concept_id").size() == 72).all()
    assert (data.train.concept_id == -1).sum() == (raw_train.concept_id == -1).sum()
    for category in ("positive", "negative", "hard negative"):
        ours = data.eval[data.eval.category == category].groupby("concept_id").size()
        theirs = raw_eval[raw_eval.category == category].groupby("concept_id").size()
        assert ours.to_dict() == theirs.to_dict()


@needs_concept10
@pytest.mark.slow
def test_concept10_datamodule_counts_per_concept_and_category():
    dm = AxBenchDataModule(concept_dir=str(CONCEPT10), concepts=[2, 5])
    dm.setup()
    raw_eval = pd.read_parquet(CONCEPT10 / "latent_eval_data.parquet")
    raw_train = pd.read_parquet(CONCEPT10 / "train_data.parquet")
    assert len(dm.splits["train"]) == 2 * 72 + (raw_train.concept_id == -1).sum()
    batches = list(dm.test_dataloader())
    concept = torch.cat([b["concept_id"] for b in batches])
    category = torch.cat([b["category"] for b in batches])
    for position, original in enumerate([2, 5]):
        for name, code in CATEGORIES.items():
            expected = ((raw_eval.concept_id == original) & (raw_eval.category == name)).sum()
            assert ((concept == position) & (category == code)).sum().item() == expected


def _bad_copy(tmp_path, drop: str):
    data = load_concepts()
    data.train.drop(columns=[drop]).to_parquet(tmp_path / "train_data.parquet")
    data.eval.to_parquet(tmp_path / "latent_eval_data.parquet")
    (tmp_path / "metadata.jsonl").write_text((BUILTIN_DIR / "metadata.jsonl").read_text())


@pytest.mark.parametrize("column", ["output", "category", "concept_id"])
def test_missing_column_is_named(tmp_path, column):
    _bad_copy(tmp_path, column)
    with pytest.raises(ValueError, match=f"train_data.parquet has no column '{column}'"):
        load_concepts(tmp_path)


def test_missing_file_is_named(tmp_path):
    (tmp_path / "metadata.jsonl").write_text((BUILTIN_DIR / "metadata.jsonl").read_text())
    with pytest.raises(FileNotFoundError, match="train_data"):
        load_concepts(tmp_path)
    (tmp_path / "metadata.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="metadata.jsonl"):
        load_concepts(tmp_path)


def test_unknown_concept_ids_and_subset_errors():
    n = len(load_concepts().concepts)
    with pytest.raises(ValueError, match=rf"unknown ids \[{n}\].*valid ids: 0..{n - 1}"):
        AxBenchDataModule(concepts=[0, n])
    with pytest.raises(ValueError, match="distinct"):
        AxBenchDataModule(concepts=[1, 1])
    with pytest.raises(ValueError, match="padding_side"):
        AxBenchDataModule(padding_side="middle")


def test_subset_selects_rows_and_renumbers_concepts():
    dm = AxBenchDataModule(concepts=[3, 1])
    assert dm.concepts == [dm.data.concepts[3], dm.data.concepts[1]]
    assert dm.concept_genres == [dm.data.genres[3], dm.data.genres[1]]
    train, evaluation = dm.rows("train"), dm.rows("eval")
    assert set(train.concept_id) == {3, 1, -1} and set(evaluation.concept_id) == {3, 1}
    index = {3: 0, 1: 1}
    examples = tokenize_rows(evaluation, load_tokenizer("smollm2-135m-instruct"), True, 256, True, index)
    assert [e.concept_id for e in examples] == [index[c] for c in evaluation.concept_id]
    assert [e.category for e in examples] == [CATEGORIES[c] for c in evaluation.category]


def _response_text(tokenizer, batch, row, key="output_mask"):
    ids = batch["input_ids"][row][batch[key][row].bool()]
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_chat_masks_cover_exactly_the_response_with_smollm2():
    dm = AxBenchDataModule(eval_batch_size=64)
    dm.setup()
    assert dm.chat
    tokenizer = dm.tokenizer
    rows = dm.rows("eval")
    batch = next(iter(dm.test_dataloader()))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in range(64):
        assert _response_text(tokenizer, batch, i) == rows.output[i]
        assert _response_text(tokenizer, batch, i, "response_mask") == rows.output[i] + "<|im_end|>"
        last = batch["attention_mask"][i].sum() - 1
        assert batch["input_ids"][i, last] == end and batch["response_mask"][i, last] == 1
        prompt = tokenizer.decode(batch["input_ids"][i][: batch["response_mask"][i].argmax()])
        assert prompt.endswith(f"<|im_start|>user\n{rows.input[i]}<|im_end|>\n<|im_start|>assistant\n")
    # the full sequence is the chat template's rendering of the turn
    chat = [{"role": "user", "content": rows.input[0]}, {"role": "assistant", "content": rows.output[0]}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered.startswith(tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]))


def test_split_chat_of_smollm2():
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    prompt, text, end = split_chat(tokenizer, "Hi", "Hello there.")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (text, end) == ("Hello there.", "<|im_end|>\n")


@pytest.fixture
def plain(tokenizer, tiny_lm_dir):
    dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concepts=[0, 5], max_length=128, batch_size=4, eval_batch_size=8)
    dm.setup()
    return dm


def test_plain_format_masks_and_token_labels(plain, tokenizer):
    assert not plain.chat
    rows = plain.rows("eval")
    batch = next(iter(plain.test_dataloader()))
    for i in range(8):
        e = plain.splits["eval"][i]
        if not e.truncated:
            assert _response_text(tokenizer, batch, i) == rows.output[i]
        else:
            assert rows.output[i].startswith(_response_text(tokenizer, batch, i))
        prompt = tokenizer.decode(batch["input_ids"][i][: e.response_start])
        assert prompt == "<bos>" + rows.input[i] + "\n\n"
    # token_labels: the concept's position on the response text of positives, -1 elsewhere
    train = next(iter(plain.train_dataloader()))
    for b in (batch, train):
        positive = b["label"].bool()
        expected = torch.where(b["output_mask"].bool() & positive[:, None], b["concept_id"][:, None], -1)
        assert torch.equal(b["token_labels"], expected)
        assert torch.equal(b["label"], (b["category"] == 1).long())
    assert (batch["token_labels"] >= 0).any()


def test_train_has_positives_and_pool_shuffled_with_seed(tokenizer, tiny_lm_dir):
    def order(seed):
        dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concepts=[0, 5], max_length=128, seed=seed)
        dm.setup()
        return torch.cat([b["concept_id"] for b in dm.train_dataloader()]), dm

    a, dm = order(0)
    b, _ = order(0)
    c, _ = order(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    pool = (dm.data.train.concept_id == -1).sum()
    positives = dm.data.train[dm.data.train.category == "positive"].concept_id.value_counts()
    assert (a == -1).sum() == pool and (a == 0).sum() == positives[0] and (a == 1).sum() == positives[5]
    assert len(a) == len(dm.rows("train")) == pool + positives[0] + positives[5]


def test_left_and_right_padding_keep_the_same_tokens(tokenizer, tiny_lm_dir):
    dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concepts=[1], max_length=128)
    dm.setup()
    examples = dm.splits["eval"][:5]
    right, left = collate(examples, pad_id=0, padding_side="right"), collate(examples, pad_id=0, padding_side="left")
    for i in range(5):
        for key in ("input_ids", "response_mask", "output_mask", "token_labels"):
            assert torch.equal(
                right[key][i][right["attention_mask"][i].bool()], left[key][i][left["attention_mask"][i].bool()]
            )
        assert right["attention_mask"][i, 0] == 1 and left["attention_mask"][i, -1] == 1
    assert left["keys"][0] == right["keys"][0] and right["keys"][1] == [0] * 5
    assert left["keys"][1] == [left["input_ids"].shape[1] - len(e.ids) for e in examples]


def test_truncation_drops_the_end_of_turn_and_prompt_overflow_is_an_error(tokenizer):
    prompt, response, end, truncated = encode(tokenizer, "Tell me.", "The dog is here. " * 20, False, 20, True)
    assert truncated and end == [] and len(prompt) + len(response) == 20
    prompt, response, end, truncated = encode(tokenizer, "Tell me.", "Yes.", False, 128, True)
    assert not truncated and end == [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="max_length=3"):
        encode(tokenizer, "The dog is here and the dog is there.", "Yes.", False, 3, True)


def test_chat_template_true_without_one_is_an_error(tiny_lm_dir):
    dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), chat_template=True)
    with pytest.raises(ValueError, match="no chat template"):
        dm.setup()


def test_content_mask_starts_after_the_chat_prefix_with_smollm2():
    """AxBench's prefix_length: the tokens every chat prompt starts with (smollm2's default system
    turn and the user header); content_mask is every real token after them."""
    dm = AxBenchDataModule(eval_batch_size=8)
    dm.setup()
    tokenizer = dm.tokenizer
    batch = next(iter(dm.test_dataloader()))
    rows = dm.rows("eval")
    for i in range(8):
        real = batch["attention_mask"][i].bool()
        content = batch["content_mask"][i].bool()
        assert not (content & ~real).any() and (content | ~real).sum() > 0
        start = int(content.float().argmax())
        assert tokenizer.decode(batch["input_ids"][i][:start]).endswith("<|im_start|>user\n")
        assert tokenizer.decode(batch["input_ids"][i][start : real.sum()]).startswith(rows.input[i][:10])
        assert (content[start : real.sum()]).all()  # everything after the prefix: instruction + response
        assert (batch["response_mask"][i].bool() <= content).all()


def test_plain_content_mask_drops_only_bos(plain, tokenizer):
    batch = next(iter(plain.test_dataloader()))
    expected = batch["attention_mask"].clone()
    expected[:, 0] = 0  # right padding: BOS is the first token
    assert torch.equal(batch["content_mask"], expected)


def test_genre_negatives_copy_the_pool_once_per_concept_of_its_genre(tiny_lm_dir):
    dm = AxBenchDataModule(lm=tiny_lm_dir("llama"), concepts=[0, 1, 5], max_length=128, genre_negatives=True)
    rows = dm.rows("train")
    pool = dm.data.train[dm.data.train.concept_id == -1]
    assert (rows.concept_id >= 0).all()
    for c in (0, 1, 5):
        genre = dm.data.genres[c]
        negatives = rows[(rows.concept_id == c) & (rows.category == "negative")]
        expected = pool[pool.concept_genre == genre]
        assert len(negatives) == len(expected) > 0 and set(negatives.output) == set(expected.output)
        assert (negatives.concept_genre == genre).all()
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert (batch["concept_id"] >= 0).all() and (batch["label"] == 0).any()
    assert (batch["token_labels"][batch["label"] == 0] == -1).all()  # no concept tokens on negatives
