"""RePS (reference-free preference steering, AxBench's preference_model.py) as SteeringModule's
preference objective: the loss against a hand computation on the tiny llama (orig_add and
orig_sub), a planted concept that training must steer towards at +α and away from at −α (a
sign-flipped loss fails it), the preference data, bad options, and configs/reps.yaml in a
subprocess."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lit_interventions.datamodules.axbench import AxBenchDataModule
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_interventions.modules.steering import SteeringModule
from lit_interventions.modules.steering_objective import PreferenceObjective, preference_loss
from tests.helpers import run_command, write_jsonl
from tests.test_axbench_methods import _trainer

CONCEPT = " dog dog dog dog"  # the planted concept response: one fixed token sequence
ORIGINAL = " the cat is here"
INSTRUCTIONS = [
    f"Say something about {w}." for w in ("tea", "rain", "work", "books", "ships", "maps", "bread", "hills")
]


def concept_dir(path, original: bool = True):
    """One concept whose training positives all answer CONCEPT, each with the original ORIGINAL
    (a losing_output column); eval positives and negatives for its AUROC."""
    row = {"output_concept": "dogs", "concept_genre": "text", "dataset_category": "instruction", "concept_id": 0}
    train = [
        {
            **row,
            "input": i,
            "output": CONCEPT,
            "category": "positive",
            **({"losing_output": ORIGINAL} if original else {}),
        }
        for i in INSTRUCTIONS
    ]
    neg = {**row, "output_concept": "EEEEE", "concept_id": -1, "category": "negative"}
    train += [
        {**neg, "input": i, "output": ORIGINAL, **({"losing_output": ""} if original else {})} for i in INSTRUCTIONS[:2]
    ]
    evaluation = [{**row, "input": i, "output": CONCEPT, "category": "positive"} for i in INSTRUCTIONS[:3]]
    evaluation += [{**row, "input": i, "output": ORIGINAL, "category": "negative"} for i in INSTRUCTIONS[3:6]]
    path.mkdir(parents=True, exist_ok=True)
    write_jsonl(path / "train_data.jsonl", train)
    write_jsonl(path / "latent_eval_data.jsonl", evaluation)
    write_jsonl(
        path / "metadata.jsonl", [{"concept_id": 0, "concept": "dogs", "concept_genres_map": {"dogs": ["text"]}}]
    )
    return str(path)


def _data(lm, path, **kwargs) -> AxBenchDataModule:
    options = dict(lm=lm, concept_dir=concept_dir(path), max_length=64, batch_size=4, preference=True)
    data = AxBenchDataModule(**{**options, **kwargs})
    data.setup("fit")
    return data


def _batch(data) -> dict:
    return next(iter(data.loader("train", 4)))


# --- the loss by hand -----------------------------------------------------------------------------


def test_the_preference_losses_are_axbenchs_formulas_on_numbers():
    pc, pr, rc, rr = torch.tensor([-20.0]), torch.tensor([-8.0]), torch.tensor([-30.0]), torch.tensor([-6.0])
    lw, ll = torch.tensor([10]), torch.tensor([4])

    def nls(x):  # −log σ(x)
        return math.log1p(math.exp(-x))

    # scaled_simpo: max(1.5·(−6 + 30), 1)/10 · (−20) − (−8)/4 = 3.6·(−20) + 2 = −70
    got = preference_loss(pc, pr, rc, rr, lw, ll, "scaled_simpo", simpo_scaler=1.5)
    assert got.item() == pytest.approx(nls(-70.0))
    # the reference preferring the winning response: the scale is 1, −20/10 + 8/4 = 0
    got = preference_loss(pc, pr, torch.tensor([-1.0]), torch.tensor([-5.0]), lw, ll, "scaled_simpo")
    assert got.item() == pytest.approx(math.log(2.0))
    got = preference_loss(pc, pr, rc, rr, lw, ll, "simpo", beta=2.0, gamma=0.5)
    assert got.item() == pytest.approx(nls(2.0 / 10 * -20 - 2.0 / 4 * -8 - 0.5))
    got = preference_loss(pc, pr, rc, rr, lw, ll, "dpo", beta=0.1)
    assert got.item() == pytest.approx(nls(0.1 * ((-20 + 8) - (-30 + 6))))
    got = preference_loss(pc, pr, rc, rr, lw, ll, "apo_zero", beta=0.1)
    assert got.item() == pytest.approx(nls(0.1 * (-20 + 30)) - nls(0.1 * (-8 + 6)))


def _logps_by_hand(model, batch, rows, edit=None):
    """Σ log p of each row's response tokens from the full logits, with `edit(h, row)` applied to
    the output of block 1 by a plain forward hook (None: the unsteered LM)."""
    ids, mask, targets = batch["input_ids"][rows], batch["attention_mask"][rows], batch["response_mask"][rows]
    handle = None
    if edit is not None:
        handle = model.model.layers[1].register_forward_hook(
            lambda mod, args, out: (edit(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else edit(out)
        )
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        if handle is not None:
            handle.remove()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (logp * targets[:, 1:]).sum(-1)


@pytest.mark.parametrize("pair", ["orig_add", "orig_sub"])
def test_the_reps_loss_of_one_batch_is_the_hand_computation(tmp_path, tiny_lm_dir, pair):
    """orig_add: winning the concept response, losing the original, both at h + 2·w on the
    content tokens; orig_sub: winning the original, losing the concept response, both at the
    null-out edit h − (ReLU(h·w)/‖w‖²)·w. The scale max(r_l − r_w, 1) and the lengths (attention
    mask sums) as AxBench's scaled_simpo."""
    lm = tiny_lm_dir("llama")
    objective = PreferenceObjective(steering_factors=[2.0], pairs=[pair])
    module = SteeringModule(lm=lm, layer=1, method="reps", objective=objective, concept_names=["dogs"])
    with torch.no_grad():
        module.dictionary.weight.copy_(
            torch.randn(module.dictionary.weight.shape, generator=torch.Generator().manual_seed(3))
        )
    batch = _batch(_data(lm, tmp_path))
    n = batch["pairs"]
    concept, original = torch.arange(n), torch.arange(n, 2 * n)
    w = module.dictionary.weight[0].detach()
    where = (batch["content_mask"] & batch["attention_mask"]).bool()

    def edit_for(rows):
        def edit(h):
            if pair == "orig_add":
                return h + 2.0 * where[rows][..., None] * w
            coeff = -torch.relu(h @ w) / (w @ w)
            return h + (coeff * where[rows])[..., None] * w

        return edit

    won, lost = (concept, original) if pair == "orig_add" else (original, concept)
    with torch.no_grad():
        pw, pl = (_logps_by_hand(module.lm, batch, rows, edit_for(rows)) for rows in (won, lost))
        rw, rl = (_logps_by_hand(module.lm, batch, rows) for rows in (won, lost))
        lens = batch["attention_mask"].sum(-1).float()
        scale = torch.clamp(rl - rw, min=1.0)
        expected = -F.logsigmoid(scale / lens[won] * pw - pl / lens[lost]).mean()
        module._frozen["draws"] = torch.Generator().manual_seed(0)
        loss, _ = module._preference_loss(batch)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    assert (pw != rw).all() and ORIGINAL.strip() != CONCEPT.strip()  # the edit changes the log-probabilities


# --- a planted concept ----------------------------------------------------------------------------


def sharp_lm(tiny_dir: str, path) -> str:
    """The tiny llama with its LM head ×50: a random head's logits span well under a nat, too
    flat for a steering vector to move a response's probability far."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(path)
    return str(path)


def _train(tmp_path, lm, flip: bool):
    """RePS with orig_add at +1 and orig_sub at −1 (`subtraction: negate`), 16 steps."""
    objective = PreferenceObjective(steering_factors=[1.0], subtraction="negate")
    module = SteeringModule(lm=lm, layer=1, method="reps", objective=objective, concept_names=["dogs"], lr=0.05)
    data = _data(lm, tmp_path / "data")
    if flip:  # a broken RePS: winning and losing swapped
        module.objective.plan = _flipped(module.objective.plan)
    _trainer(tmp_path / "run", max_epochs=8, gradient_clip_val=1.0, limit_val_batches=0).fit(module, datamodule=data)
    module.eval()
    return module, data


def _flipped(plan):
    def swapped(n, generator):
        won, lost, won_at, lost_at = plan(n, generator)
        return lost, won, lost_at, won_at

    return swapped


def _steered_logps(module, data, factor):
    batch = _batch(data)
    n = batch["pairs"]
    ids, mask, targets = batch["input_ids"][:n], batch["attention_mask"][:n], batch["response_mask"][:n]
    w = module.dictionary.weight[0].detach()
    where = (batch["content_mask"] & batch["attention_mask"]).bool()[:n]

    def edit(h):
        return h + factor * where[..., None] * w

    with torch.no_grad():
        return _logps_by_hand(module.lm, {"input_ids": ids, "attention_mask": mask, "response_mask": targets},
                              torch.arange(n), edit if factor else None).mean().item()  # fmt: skip


@pytest.mark.slow
def test_reps_steers_a_planted_concept_both_ways_and_a_flipped_loss_does_not(tmp_path, tiny_lm_dir):
    lm = sharp_lm(tiny_lm_dir("llama"), tmp_path / "lm")
    module, data = _train(tmp_path / "reps", lm, flip=False)
    base, up, down = (_steered_logps(module, data, f) for f in (0.0, 1.0, -1.0))
    assert up > base + 20.0 and down < base - 20.0, (down, base, up)  # measured: −160, −118, −30
    broken, data = _train(tmp_path / "flipped", lm, flip=True)
    base, up, down = (_steered_logps(broken, data, f) for f in (0.0, 1.0, -1.0))
    assert up < base < down, (down, base, up)


# --- the preference data ----------------------------------------------------------------------------


def test_the_preference_data_pairs_each_positive_with_its_original(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    data = _data(lm, tmp_path)
    batch = _batch(data)
    n = batch["pairs"]
    assert n == 4 and batch["input_ids"].shape[0] == 8 and (batch["label"][:n] == 1).all()
    tok = data.tokenizer
    for i in range(n):  # one instruction, two responses
        concept = tok.decode(batch["input_ids"][i][batch["output_mask"][i].bool()])
        original = tok.decode(batch["input_ids"][n + i][batch["output_mask"][n + i].bool()])
        assert (concept, original) == (CONCEPT, ORIGINAL)
        prompt = batch["input_ids"][i][: batch["response_mask"][i].bool().nonzero()[0, 0]]
        assert prompt.tolist() == batch["input_ids"][n + i][: len(prompt)].tolist()
    assert len(data.preference_examples()) == len(INSTRUCTIONS)  # the positives alone, no pool negative
    without = AxBenchDataModule(lm=lm, concept_dir=concept_dir(tmp_path / "no", original=False), preference=True)
    without.setup("fit")
    assert without.missing_originals() == INSTRUCTIONS
    with pytest.raises(ValueError, match="preference: 8 training instruction.*no original response.*losing_output"):
        without.preference_examples()
    without.set_original_responses({i: ("" if i == INSTRUCTIONS[0] else ORIGINAL) for i in INSTRUCTIONS})
    with pytest.warns(UserWarning, match="1 example.*empty original response left out"):
        assert len(without.preference_examples()) == len(INSTRUCTIONS) - 1


def test_bad_preference_options_are_one_clear_error(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    with pytest.raises(ValueError, match="loss_type='ipo'; valid: scaled_simpo, simpo, dpo, apo_zero"):
        PreferenceObjective(loss_type="ipo")
    with pytest.raises(ValueError, match="pairs=.*'steered_add'.*orig_add, orig_sub"):
        PreferenceObjective(pairs=["steered_add"])
    with pytest.raises(ValueError, match="0 is the null-out edit"):
        PreferenceObjective(steering_factors=[0.0, 2.0])
    with pytest.raises(ValueError, match="subtraction='zero'; valid: null_it_out, negate"):
        PreferenceObjective(subtraction="zero")
    with pytest.raises(ValueError, match="diffmean is fitted in closed form"):
        SteeringModule(lm=lm, layer=1, method="diffmean", objective=PreferenceObjective())
    module = SteeringModule(lm=lm, layer=1, method="reps", concept_names=["dogs"])
    assert isinstance(module.objective, PreferenceObjective) and module.hparams.objective["init_args"]["pairs"] == [
        "orig_add",
        "orig_sub",
    ]
    assert SteeringModule(lm=lm, layer=1, method="ssv").objective is None
    data = AxBenchDataModule(lm=lm, concept_dir=concept_dir(tmp_path))
    with pytest.raises(ValueError, match="set the data module's preference: true"):
        _trainer(tmp_path / "run").fit(module, datamodule=data)


@pytest.mark.slow
def test_the_reps_config_trains_on_the_built_in_concepts_with_generated_originals(tmp_path, tiny_lm_dir):
    lm = tiny_lm_dir("llama")
    args = ["train.py", "fit", "--config", "configs/reps.yaml", f"--model.lm={lm}", f"--data.lm={lm}"]
    args += ["--model.layer=1", "--data.concepts=[0, 5]", "--data.max_length=96", "--trainer.max_epochs=1"]
    args += ["--trainer.limit_train_batches=2", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"]
    args += ["--model.objective.init_args.max_new_tokens=6", "--trainer.enable_progress_bar=false"]
    done = run_command(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generating the LM's original responses to 72 instructions (6 tokens)" in done.stdout + done.stderr
    assert "val/auroc" in done.stdout + done.stderr
    (card,) = tmp_path.glob("**/config.json")
    assert json.loads(card.read_text())["method"] == "reps"
