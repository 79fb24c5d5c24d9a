"""`train.py` end to end on a tiny model: fit, export, checkpoint contents, validate/test, bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from lit_interventions.core.forward import logits_at, read_site
from lit_interventions.core.lm import load_tokenizer
from lit_interventions.core.positions import encode_text, span_position
from lit_interventions.inference.apply import apply


def _fit(tmp_path, lm_dir, *extra):
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
    return train.main(args=args)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_lm_dir):
    tmp_path = tmp_path_factory.mktemp("fit")
    cli = _fit(tmp_path, tiny_lm_dir("gpt_neox"))
    return cli, Path(cli.trainer.log_dir)


def test_fit_logs_loss_and_odds_to_tensorboard(fitted):
    cli, log_dir = fitted
    metrics = cli.trainer.callback_metrics
    for name in ("train/loss", "val/odds", "val/iia", "val/loss"):
        assert torch.isfinite(metrics[name]), name
    assert log_dir.parts[-3:-1] == ("agr_sv_num_pp", "layer1") and log_dir.name.startswith(
        "version_"
    )  # named by the run
    assert list(log_dir.glob("events.out.tfevents.*"))


def test_fit_exports_a_unit_norm_direction_with_a_card(fitted):
    cli, log_dir = fitted
    basis = load_file(log_dir / "intervention.safetensors")["basis"]
    assert basis.shape == (1, 32)
    assert basis.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert not (log_dir / "intervention.json").exists()  # one card per run: config.json
    card = json.loads((log_dir / "config.json").read_text())
    assert card["layer"] == 1 and card["region"] == "subject" and card["task"] == "agr_sv_num_pp" and card["k"] == 1
    assert card["metrics"]["val/odds"] == pytest.approx(cli.trainer.callback_metrics["val/odds"].item())
    torch.testing.assert_close(basis, cli.model.intervention.basis.detach())


def test_the_exported_run_applies_to_its_recorded_example(fitted, tiny_lm_dir):
    """The run's config.json records what `apply` checks (layer count, model type) and one eval
    pair with the site's spans; applied to that pair at those spans, the run's directory gives
    the trained module's own interchange logits."""
    cli, log_dir = fitted
    config = json.loads((log_dir / "config.json").read_text())
    assert config["num_layers"] == 3 and config["model_type"] == "gpt_neox" and config["needs_source"] is True
    example = config["example"]
    pair = cli.datamodule.pairs["eval"][0]
    assert (example["prompt"], example["source"]) == (pair.base.text, pair.source.text)
    assert example["span"] == pair.base.text[slice(*pair.base.spans["subject"])]
    tok, lm = load_tokenizer(tiny_lm_dir("gpt_neox")), cli.model.lm
    base, source = encode_text(tok, example["prompt"]), encode_text(tok, example["source"])
    at, source_at = (
        span_position(tok, example["prompt"], example["span"]),
        span_position(tok, example["source"], example["source_span"]),
    )
    with apply(lm, str(log_dir), tokenizer=tok, source=example["source"], positions=at, source_positions=source_at):
        applied = lm(**base).logits[:, -1]
    state = read_site(lm, 1, source["input_ids"], source["attention_mask"], torch.tensor([source_at]))
    last = torch.tensor([base["input_ids"].shape[1] - 1])
    intervention = cli.model.intervention
    own = logits_at(
        lm, base["input_ids"], base["attention_mask"], last, 1, torch.tensor([at]), lambda h: intervention(h, state)
    )
    torch.testing.assert_close(applied, own, rtol=1e-5, atol=1e-5)


def test_checkpoint_holds_only_the_intervention(fitted):
    cli, log_dir = fitted
    (checkpoint,) = (log_dir / "checkpoints").glob("*.ckpt")
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert state and all(key.startswith("intervention.") for key in state), list(state)
    # a rank-1 direction and the (d, d) base of its orthogonal parametrization, no LM weights
    assert sum(v.numel() for v in state.values()) == 32 + 32 * 32
    assert sum(p.numel() for p in cli.model.lm.parameters()) > 100 * (32 + 32 * 32)


@pytest.mark.parametrize("subcommand,split", [("test", "test"), ("validate", "val")])
def test_evaluation_subcommands_reload_the_checkpoint(fitted, tmp_path, tiny_lm_dir, subcommand, split):
    cli, log_dir = fitted
    (checkpoint,) = (log_dir / "checkpoints").glob("*.ckpt")
    args = [
        subcommand,
        "--config",
        "configs/das.yaml",
        f"--model.lm={tiny_lm_dir('gpt_neox')}",
        "--model.layer=1",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.train_pairs=12",
        "--data.eval_pairs=4",
        "--trainer.enable_progress_bar=false",
        f"--ckpt_path={checkpoint}",
    ]
    tested = train.main(args=args)
    torch.testing.assert_close(tested.model.intervention.basis, cli.model.intervention.basis.detach())
    assert torch.isfinite(tested.trainer.callback_metrics[f"{split}/odds"])


def test_training_moves_the_direction(tmp_path, tiny_lm_dir):
    torch.manual_seed(0)
    cli = _fit(tmp_path, tiny_lm_dir("llama"), "--trainer.max_epochs=0")
    initial = cli.model.intervention.basis.detach().clone()
    trained = _fit(tmp_path, tiny_lm_dir("llama")).model.intervention.basis.detach()
    assert (trained - initial).abs().max() > 1e-3


@pytest.mark.parametrize(
    "option,message",
    [
        ("--data.task=agr_nope", "Unknown task 'agr_nope'"),
        ("--model.layer=7", "layer=7 is out of range: this model has 3 layers"),
        ("--model.region=verb", "Unknown region 'verb' for task 'agr_sv_num_pp'; regions: The, subject"),
        ("--data.templates=/nonexistent/t.json", "Template file not found: /nonexistent/t.json"),
    ],
)
def test_bad_input_is_one_line(tmp_path, tiny_lm_dir, capsys, option, message):
    with pytest.raises(SystemExit) as exit_info:
        _fit(tmp_path, tiny_lm_dir("gpt_neox"), option)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err


def test_label_words_sharing_a_token_are_one_line_before_training(tmp_path, tiny_lm_dir, capsys):
    templates = json.loads(Path("datamodules/data/causalgym.json").read_text())
    task = templates["agr_sv_num_pp"]
    task["labels"] = {t: ["is"] for t in task["labels"]}
    path = tmp_path / "templates.json"
    path.write_text(json.dumps({"agr_sv_num_pp": task}))
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            args=[
                "fit",
                "--config",
                "configs/das.yaml",
                f"--model.lm={tiny_lm_dir('gpt2')}",
                "--model.layer=1",
                f"--data.templates={path}",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: Task 'agr_sv_num_pp': label words") and "share their first token" in err[-1]
    assert not list(tmp_path.rglob("*.ckpt"))
