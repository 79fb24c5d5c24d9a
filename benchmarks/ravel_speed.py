"""RAVEL DAS and MDAS for one attribute at one layer: ours against the official RAVEL loop, same run.

Both sides train the same intervention (rank-k DAS at the block output after `--layer`, the
entity's last token) on the same data, from the same init, with the same hyperparameters, then
score Cause and Iso on the test split by the official 3-token rule:
- ours: the Lightning fit `train.py fit --config configs/ravel/{das,mdas}.yaml` runs, called in
  process, then `test`. The frozen states at the layer, and the keys and values above it of each
  base's tokens before its site, are computed once per sentence (the activation cache); a step
  runs only the blocks above the layer, from the site on, with the LM head on the last position.
- reference: the loop of the official `train_intervention.py` and `eval_with_interventions`: one
  `pyvene.IntervenableModel` with `LowRankRotatedSpaceIntervention`, a full base and a full
  source forward every step (logits at every position), and each of the 3 answer tokens scored
  by full intervened forwards of the base extended by the tokens so far. Its loss is our objective's
  formula in plain torch (L_Cause, MDAS: + the mean over the other attributes of L_Iso on the
  first answer token) and its optimizer and schedule the config's (Adam, 10% warmup, linear
  decay), so the two give the same numbers. The data module, the seed and the init come from the
  same config; the reference's rotation starts from our initial parametrization.

pyvene 0.1.8 maps Gemma 2 but not Gemma 3, whose decoder layers sit at the same place
(`model.layers[i]`): the benchmark registers Gemma 2's mapping for `Gemma3ForCausalLM`.

Each side runs in its own spawned process (`measure.alternate`); loading the LM, parsing the
config and building the data (the filtering by the model's answers, cached on disk once per
model) are set-up both sides share, taken off their seconds. The script checks that Cause and
Iso agree within 0.02 (exit status 1 when not) and prints `METHOD ratio=X` per method, MDAS last.

    python benchmarks/ravel_speed.py [--ravel_dir data/ravel] [--attribute Country] [--device cuda]
    python benchmarks/ravel_speed.py --train_size 1000 --eval_size 200 --epochs 3   # the configs' sizes
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyvene
import torch
import torch.nn.functional as F
from lit_interventions.datamodules.ravel_files import load_ravel
from measure import OneLineParser, alternate, built_cli, exit_if_unequal, pyvene_last_logits, report
from pyvene.models.gemma2.modelings_intervenable_gemma2 import (
    gemma2_lm_type_to_dimension_mapping,
    gemma2_lm_type_to_module_mapping,
)
from transformers import Gemma3ForCausalLM, get_linear_schedule_with_warmup

from lit_interventions.cli.parsing import fail
from lit_interventions.core.batch import CAUSE, ISO, PairBatch
from lit_interventions.core.lm import check_device, load_config, num_layers
from lit_interventions.metrics.disentangle import Disentanglement
from lit_interventions.modules.generation import answer_length, extend

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("das", "mdas")
TOLERANCE = 0.02  # Cause and Iso of the two sides must agree within this

pyvene.type_to_module_mapping.setdefault(Gemma3ForCausalLM, gemma2_lm_type_to_module_mapping)
pyvene.type_to_dimension_mapping.setdefault(Gemma3ForCausalLM, gemma2_lm_type_to_dimension_mapping)


@dataclass(frozen=True)
class Setting:
    """One benchmark cell: a method (`configs/ravel/<method>.yaml`) and the options both sides share."""

    method: str
    lm: str
    ravel_dir: str | None
    attribute: str
    layer: int
    k: int
    train_size: int
    eval_size: int
    epochs: int
    device: str
    entity_type: str = "city"
    max_candidates: int = 200

    def cli_args(self, root: str) -> list[str]:
        """`train.py fit`'s arguments (no subcommand: the trainer runs it) with the method's config and this setting; validation off (the official
        loop trains, then scores once)."""
        options = {
            "--model.lm": self.lm,
            "--model.layer": self.layer,
            "--model.k": self.k,
            "--data.ravel_dir": self.ravel_dir,
            "--data.entity_type": self.entity_type,
            "--data.target_attribute": self.attribute,
            "--data.train_size": self.train_size,
            "--data.eval_size": self.eval_size,
            "--data.max_candidates": self.max_candidates,
            "--trainer.max_epochs": self.epochs,
            "--trainer.accelerator": "gpu" if self.device == "cuda" else "cpu",
            "--trainer.default_root_dir": root,
            "--trainer.limit_val_batches": 0,
            "--trainer.num_sanity_val_steps": 0,
            "--trainer.enable_progress_bar": "false",
        }
        args = ["--config", str(ROOT / "configs" / "ravel" / f"{self.method}.yaml")]
        for name, value in options.items():
            args += [name, "null" if value is None else str(value)]
        return args


def ours(setting: Setting) -> tuple[float, dict]:
    """Our fit and test, through the CLI's trainer: (set-up seconds, scores and bases)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cli = built_cli(setting.cli_args(root), setting.device)
        initial = cli.model.intervention.basis.detach().cpu().clone()
        setup = time.perf_counter() - start
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
        scores = cli.trainer.callback_metrics
        basis = cli.model.intervention.basis.detach().cpu()
        return setup, {
            "cause": float(scores["test/cause"]),
            "iso": float(scores["test/iso"]),
            "basis": basis,
            "initial": initial,
        }


def pyvene_das(model: torch.nn.Module, layer: int, ours_intervention: torch.nn.Module, device: str):
    """(IntervenableModel, its LowRankRotatedSpaceIntervention) at the block output after `layer`,
    its orthogonal parametrization set to our intervention's (its weight, (d, k), is our Wᵀ)."""
    config = pyvene.IntervenableConfig(
        representations=[
            pyvene.RepresentationConfig(layer=layer, component="block_output", low_rank_dimension=ours_intervention.k)
        ],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    intervenable.set_device(device)
    intervenable.disable_model_gradients()
    intervention = next(iter(intervenable.interventions.values()))
    intervention = intervention[0] if isinstance(intervention, (tuple, list)) else intervention
    theirs, mine = intervention.rotate_layer.parametrizations.weight, ours_intervention.rotate.parametrizations.weight
    with torch.no_grad():  # torch runs our wide (k, d) original transposed: the same tall (d, k) map
        theirs.original.copy_(mine.original.mT)
        theirs[0].base.copy_(mine[0].base)
    return intervenable, intervention


def cause_iso_loss(logits: torch.Tensor, batch: PairBatch, multitask: bool) -> torch.Tensor:
    """L_Cause, with `multitask` plus the mean over the Iso attributes of each one's L_Iso
    (RAVEL §4), the cross-entropy of the first answer token."""
    losses = F.cross_entropy(logits.float(), batch.target, reduction="none")
    parts = []
    if (batch.kind == CAUSE).any():
        parts.append(losses[batch.kind == CAUSE].mean())
    iso = batch.kind == ISO
    if multitask and iso.any():
        attributes = batch.attribute[iso].unique()
        parts.append(torch.stack([losses[iso & (batch.attribute == a)].mean() for a in attributes]).mean())
    return torch.stack(parts).sum() if parts else losses.sum() * 0.0


@torch.no_grad()
def reference_scores(intervenable, data, device: str) -> dict[str, float]:
    """Cause and Iso on the test split: each answer token by a full intervened forward of the base
    extended by the tokens before it (the intervention at the same site in every one)."""
    metric = Disentanglement(len(data.attributes), data.group_attribute, data.hparams.average)
    for batch in data.test_dataloader():
        batch = batch.to(device)
        base, tokens = batch.base, []
        for _ in range(answer_length(batch)):
            if tokens:
                base = extend(base, tokens[-1])
            tokens.append(pyvene_last_logits(intervenable, base, batch.source).argmax(-1))
        metric.update_batch(torch.stack(tokens, 1).cpu(), batch.to("cpu"))
    values = metric.compute()
    return {"cause": float(values["cause"]), "iso": float(values["iso"])}


def reference(setting: Setting) -> tuple[float, dict]:
    """The official loop's structure on the same data and init: (set-up seconds, scores and bases)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cli = built_cli(setting.cli_args(root), setting.device)
    module, data = cli.model, cli.datamodule
    initial = module.intervention.basis.detach().cpu().clone()
    state = torch.get_rng_state()  # building pyvene's intervention draws; ours draws the order next
    intervenable, intervention = pyvene_das(module.lm, setting.layer, module.intervention, setting.device)
    torch.set_rng_state(state)
    loader = data.train_dataloader()
    args, total = module.optimizer_args, cli.trainer.max_epochs * len(loader)
    optimizer = torch.optim.Adam(intervention.parameters(), lr=args.lr)
    schedule = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    setup = time.perf_counter() - start
    for _ in range(cli.trainer.max_epochs):
        for batch in loader:
            batch = batch.to(setting.device)
            cause_iso_loss(
                pyvene_last_logits(intervenable, batch.base, batch.source), batch, module.objective.multitask
            ).backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    scores = reference_scores(intervenable, data, setting.device)
    basis = intervention.rotate_layer.weight.detach().T.cpu()
    return setup, {**scores, "basis": basis, "initial": initial}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work: the published files, the attribute, layer and k."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="gemma-3-270m")
    parser.add_argument(
        "--ravel_dir", default="data/ravel", help="the published RAVEL files (lit-interventions data ravel)"
    )
    parser.add_argument("--entity_type", default="city")
    parser.add_argument("--attribute", default="Country", help="the target attribute")
    parser.add_argument("--layer", type=int, default=6)
    parser.add_argument("--k", type=int, default=64, help="rank of the DAS subspace")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--train_size", type=int, default=96, help="Cause examples to train on (MDAS: as many Iso)")
    parser.add_argument("--eval_size", type=int, default=48, help="Cause test examples (and as many Iso)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--max_candidates",
        type=int,
        default=200,
        help="(entity, template) pairs checked per attribute and split (the data module's max_candidates)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=1, help="alternate ours and the reference n times")
    args = parser.parse_args(argv)
    for name in ("train_size", "eval_size", "epochs", "repeat", "k", "max_candidates"):
        if getattr(args, name) < 1:
            fail(f"--{name} {getattr(args, name)} must be a positive integer")
    try:
        check_device(args.device)
    except ValueError as err:
        fail(str(err))
    if not Path(args.ravel_dir).is_dir():
        fail(
            f"--ravel_dir {args.ravel_dir} is not a directory: get the published files with "
            f"`lit-interventions data ravel --out {args.ravel_dir}`, or pass --ravel_dir"
        )
    try:
        load_ravel(args.ravel_dir, args.entity_type).check_attribute(args.attribute)
        config = load_config(args.lm)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err).splitlines()[0])
    if not 0 <= args.layer < num_layers(config):
        fail(f"--layer {args.layer} is not a layer of {args.lm}: choose 0..{num_layers(config) - 1}")
    if args.k > config.hidden_size:
        fail(f"--k {args.k} is more than {args.lm}'s hidden size {config.hidden_size}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(
        f"RAVEL {args.entity_type} {args.attribute}, {args.lm} layer {args.layer}, k={args.k}, {args.device}: "
        f"{args.train_size} train / {args.eval_size} test Cause examples, {args.epochs} epoch(s), batch 16"
    )
    unequal = []
    for method in args.methods:
        setting = Setting(
            method, args.lm, args.ravel_dir, args.attribute, args.layer, args.k,
            args.train_size, args.eval_size, args.epochs, args.device, args.entity_type, args.max_candidates,
        )  # fmt: skip
        mine, theirs = alternate(ours, reference, args.repeat, setting)
        a, b = mine.result, theirs.result
        gap = max(abs(a["cause"] - b["cause"]), abs(a["iso"] - b["iso"]))
        same = gap <= TOLERANCE
        print(
            f"{method}: Cause reference {b['cause']:.4f}, ours {a['cause']:.4f}; Iso reference {b['iso']:.4f}, "
            f"ours {a['iso']:.4f}: {'equal' if same else 'NOT equal'} within {TOLERANCE} "
            f"(largest difference of the trained bases {float((a['basis'] - b['basis']).abs().max()):.1e})"
        )
        if not same:
            unequal.append(method)
        report(method, mine, theirs, 1, "attribute")
    exit_if_unequal(unequal, "Cause / Iso", TOLERANCE)


if __name__ == "__main__":
    main()
