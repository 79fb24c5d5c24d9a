"""AxBench ReFT-r1 and DiffMean over N concepts: ours (one dictionary) against AxBench's loop (one model per concept), same run.

Both sides learn each concept's rank-1 row w_c at the residual stream after block `--layer` from
the same data, init and hyperparameters (`configs/reft_r1.yaml`, `configs/diffmean.yaml`), then
score detection on the eval split: Ψ(h_i) (ReFT-r1: ReLU(h·w_c), DiffMean: h·w_c) max-pooled over
every token after the chat prefix, min-max normalised per concept, AUROC per concept.
- ours: `train.py fit --config configs/{reft_r1,diffmean}.yaml`, called in process, then `test`:
  every concept is a row of one `ConceptDictionary` trained in one run (ReFT-r1: each example
  steers and trains its own concept's row; DiffMean: one pass keeps the response tokens, then the
  closed form), the LM head only on the response tokens, detection reading the states from a
  forward that stops at the layer, every concept's eval rows in one pass.
- reference: the loop of AxBench's `scripts/train.py` + `scripts/inference.py` (`LsReFT` = ReFT-r1
  with `TopKReLUIntervention`, `DiffMean`): for each concept in turn, a model of its own trained
  on that concept's examples alone (the same data module restricted to the concept: its positives
  and genre-matched negatives for ReFT-r1, its positives and the negative pool for DiffMean), then
  its detection forwards over its eval rows. ReFT-r1: a `pyvene.IntervenableModel` with one rank-1
  intervention at the block output, a full forward (logits at every position) per step, loss
  −log p(response) + λ_t·L1 (the dictionary's formulas: `ReFTR1Dictionary.forward`, `.penalty`,
  `.anneal`), the config's AdamW and linear schedule, the gradient's parallel component
  removed, its norm clipped at 1.0, the row renormalised. DiffMean and detection: a full forward
  of the LM with a hook at the layer (AxBench's `gather_residual_activations`).
The row of concept c starts from our dictionary's initial row c. With one concept the two sides
are the same computation (the same trained row, the same AUROC; tests/test_axbench_speed.py).
Over N > 1 concepts DiffMean stays the same per concept (a closed form); ReFT-r1 does not quite
(ours steps one AdamW, one schedule and one L1 ramp over all concepts' shuffled batches, clips
the joint gradient, and a row moves on its momentum in steps without its concept), so the script
checks that the mean AUROCs agree within 0.01 (exit status 1 when not).

Where the two loops leave AxBench's code alike: positions are every token with the content mask
applied inside the intervention (AxBench gathers the positions after the prefix, padded); the
parallel gradient is removed before the clip and the row renormalised after the step (AxBench:
clip, renormalise, remove, step); latents are not rounded to 3 decimals before the max pooling;
DiffMean's means are over the response tokens, the pool's against the concept's positives' (AxBench:
every token after the prefix, against the concept's genre-matched negatives).

Each side runs in its own spawned process (`measure.alternate`); loading the LM, parsing the
config and tokenising the data (per concept for the reference) are set-up both sides share, taken
off their seconds. Prints per method both AUROCs, then seconds per concept, peak RSS and
`METHOD ratio=X` last.

    python benchmarks/axbench_speed.py --concept_dir /work/shared/data/axbench/concept10_2b_l20 --device cuda
    python benchmarks/axbench_speed.py --concepts 2 --methods diffmean --device cpu
    python benchmarks/axbench_speed.py --concepts 0 3 7 --epochs 1 --repeat 3
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyvene
import torch
import torch.nn.functional as F
import yaml
from lit_interventions.datamodules.axbench import AxBenchDataModule
from lit_interventions.datamodules.axbench_files import load_concepts
from measure import OneLineParser, alternate, built_cli, exit_if_unequal, report

from lit_interventions.artifacts.dictionary import latent_values
from lit_interventions.callbacks.metrics import safe_name
from lit_interventions.cli.parsing import fail
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import DTYPES, check_device, hidden_size, load_config, num_layers
from lit_interventions.interventions.additive import ConceptDictionary
from lit_interventions.interventions.capabilities import intervene
from lit_interventions.metrics.detection import ConceptAUROC, per_concept_shapes
from lit_interventions.modules.steering_closed_form import fit_concept_rows, response_tokens
from lit_interventions.modules.steering_objective import intervention_mask

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("reft_r1", "diffmean")
TOLERANCE = 0.01  # the mean AUROC of the two sides must agree within this


@dataclass(frozen=True)
class Setting:
    """One benchmark cell: a method (`configs/<method>.yaml`) and the options both sides share
    (None: the config's)."""

    method: str
    lm: str
    concept_dir: str | None
    concepts: tuple[int, ...]
    device: str
    dtype: str = "float32"
    epochs: int | None = None
    layer: int | None = None
    max_length: int | None = None
    extra: tuple[str, ...] = ()  # further `train.py fit` arguments, e.g. ("--model.method.l1", "0.01")

    def cli_args(self, root: str) -> list[str]:
        """`train.py fit`'s arguments (the trainer runs fit, then test): validation off (AxBench
        trains, then scores once); DiffMean is one pass whatever `epochs`."""
        epochs = 1 if self.method == "diffmean" else self.epochs
        options = {
            "--model.lm": self.lm,
            "--model.dtype": self.dtype,
            "--model.layer": self.layer,
            "--data.concept_dir": self.concept_dir or "null",
            "--data.concepts": str(list(self.concepts)),
            "--data.max_length": self.max_length,
            "--trainer.max_epochs": epochs,
            "--trainer.accelerator": "gpu" if self.device == "cuda" else "cpu",
            "--trainer.default_root_dir": root,
            "--trainer.limit_val_batches": 0,
            "--trainer.num_sanity_val_steps": 0,
            "--trainer.enable_progress_bar": "false",
        }
        args = ["--config", str(ROOT / "configs" / f"{self.method}.yaml")]
        for name, value in options.items():
            args += [] if value is None else [name, str(value)]
        return args + list(self.extra)


def initial_rows(module, n: int) -> torch.Tensor:
    """The (n, d) rows the module's dictionary starts from (`_build`: seeded, whatever the global RNG)."""
    return ConceptDictionary(n, hidden_size(module.lm.config), module.unit_norm, module.hparams.direction_seed).weight


def ours(setting: Setting) -> tuple[float, dict]:
    """Our fit and test, through the CLI's trainer: (set-up seconds, AUROCs and rows)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cli = built_cli(setting.cli_args(root), setting.device)
        initial = initial_rows(cli.model, len(cli.datamodule.concepts)).detach()
        setup = time.perf_counter() - start
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
        scores = cli.trainer.callback_metrics
        auroc = {name: float(scores[f"test/auroc/{safe_name(name)}"]) for name in cli.model.concepts}
        rows = cli.model.dictionary.weight.detach().cpu().clone()
        return setup, {"auroc": auroc, "rows": rows, "initial": initial}


class ReFTR1Intervention(
    pyvene.SourcelessIntervention, pyvene.TrainableIntervention, pyvene.DistributedRepresentationIntervention
):
    """AxBench's `TopKReLUIntervention` (rank 1) on the dictionary's formula, Φ(h_i) = h_i +
    mean(TopK(ReLU(h·w)))·w at the `where` tokens of the `trained` rows. The row is a one-row
    `ReFTR1Dictionary` of the module's method's options, set by `train_reft_r1`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs, keep_last_dim=True)  # (batch, positions, d), not flattened
        self.dictionary, self.where, self.trained = None, None, None

    def forward(self, base, source=None, subspaces=None, **kwargs):
        row = torch.zeros(len(base), dtype=torch.long, device=base.device)
        return intervene(self.dictionary, base, concept_id=row, where=self.where, rows=self.trained)


def on_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def reft_r1_loss(intervenable, intervention: ReFTR1Intervention, module, batch: dict, step: int, total: int):
    """−log p(response) of the trained rows from a full intervened forward, + λ_step·L1."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    intervention.where = intervention_mask(batch, module.hparams.exclude_prefix)
    intervention.trained = module.method.trained_rows(batch)
    every = [list(range(ids.shape[1]))] * len(ids)
    _, out = intervenable({"input_ids": ids, "attention_mask": mask}, unit_locations={"base": [every]})
    targets = batch["response_mask"][:, 1:].bool() & intervention.trained[:, None]
    lm_loss = F.cross_entropy(out.logits[:, :-1][targets].float(), ids[:, 1:][targets])
    intervention.dictionary.anneal(step, total)
    return lm_loss + intervention.dictionary.penalty_weight * intervention.dictionary.penalty()


def train_reft_r1(module, data, start: torch.Tensor, epochs: int, clip: float | None, device: str) -> torch.Tensor:
    """One concept's row, trained as AxBench's `LsReFT.train` on its own pyvene model: (d,)."""
    config = pyvene.IntervenableConfig(
        representations=[{"layer": module.hparams.layer, "component": "block_output", "low_rank_dimension": 1}],
        intervention_types=ReFTR1Intervention,
    )
    intervenable = pyvene.IntervenableModel(config, module.lm)
    intervenable.set_device(device)
    intervenable.disable_model_gradients()
    intervention = next(iter(intervenable.interventions.values()))
    intervention = intervention[0] if isinstance(intervention, (tuple, list)) else intervention
    dictionary = intervention.dictionary = type(module.method)(**module.method.config()).allocate(1, len(start))
    dictionary.to(device)
    with torch.no_grad():
        dictionary.weight.copy_(start)
    loader = data.train_dataloader()
    parameters, total = list(dictionary.parameters()), epochs * len(loader)
    optimizer, schedule = module.optimizer_args.build(parameters, total)
    step = 0
    for _ in range(epochs):
        for batch in loader:
            reft_r1_loss(intervenable, intervention, module, on_device(batch, device), step, total).backward()
            dictionary.remove_parallel_grad()
            if clip:
                torch.nn.utils.clip_grad_norm_(parameters, clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            dictionary.renormalise()
            step += 1
    return dictionary.weight.detach()[0]


@torch.no_grad()
def layer_states(lm, layer: int, batch: dict) -> torch.Tensor:
    """AxBench's `gather_residual_activations`: a full forward of the LM (logits at every position),
    the residual stream after block `layer` kept by a hook, (batch, seq, d)."""
    kept = []

    def keep(hidden):
        kept.append(hidden)  # returns None: the stream goes on unchanged

    with residual_hook(lm, layer, keep):
        lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return kept[0]


@torch.no_grad()
def fit_diffmean(module, data, device: str) -> torch.Tensor:
    """One concept's row from full forwards over its positives and the negative pool: (d,)."""
    pieces = [
        response_tokens(layer_states(module.lm, module.hparams.layer, batch), batch, module.method_name)
        for batch in (on_device(b, device) for b in data.train_dataloader())
    ]
    hidden, labels = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
    return fit_concept_rows(module.method, hidden, labels, data.concepts, module.unsupervised_on)[0]


@torch.no_grad()
def detect(module, data, w: torch.Tensor, concept: int, metric: ConceptAUROC, device: str) -> None:
    """AxBench's `predict_latent` for one concept: its eval rows' latents from full forwards, into `metric`."""
    w = w.to(device)
    for batch in data.val_dataloader():
        batch = on_device(batch, device)
        hidden = layer_states(module.lm, module.hparams.layer, batch)
        scores = latent_values(
            torch.einsum("btd,bd->bt", hidden.float(), w.expand(len(hidden), -1).float()), module.latent
        )
        metric.update(
            scores, module.detection_mask(batch), torch.full_like(batch["concept_id"], concept), batch["label"]
        )


def reference(setting: Setting) -> tuple[float, dict]:
    """AxBench's loop on the same data and init, one concept at a time: (set-up seconds, AUROCs and rows)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cli = built_cli(setting.cli_args(root), setting.device)
    module, shared = cli.model, cli.datamodule
    names, initial = shared.concepts, initial_rows(module, len(shared.concepts)).detach()
    options = {k: v for k, v in shared.hparams.items() if k in inspect.signature(AxBenchDataModule).parameters}
    per_concept = []  # each concept's own data module: its rows of the same files, tokenised alike
    for c in setting.concepts:
        data = AxBenchDataModule(**{**options, "concepts": [c]})
        data.setup("fit")
        per_concept.append(data)
    metric = ConceptAUROC(len(names)).to(setting.device)
    setup = time.perf_counter() - start
    rows = []
    for index, data in enumerate(per_concept):
        if module.automatic_optimization:
            row = train_reft_r1(
                module, data, initial[index], cli.trainer.max_epochs, cli.trainer.gradient_clip_val, setting.device
            )
        else:
            row = fit_diffmean(module, data, setting.device)
        detect(module, data, row, index, metric, setting.device)
        rows.append(row.cpu())
    per = per_concept_shapes(metric.compute())["auroc_per_concept"].tolist()
    return setup, {"auroc": dict(zip(names, per)), "rows": torch.stack(rows), "initial": initial}


def concept_ids(values: list[int] | None, available: int) -> list[int]:
    """`--concepts N` (one number): the first N concepts; several numbers: those concept ids; none: all."""
    if values is None:
        return list(range(available))
    if len(values) == 1:
        if not 1 <= values[0] <= available:
            fail(f"--concepts {values[0]}: choose 1..{available} concepts (or give several concept ids)")
        return list(range(values[0]))
    bad = [c for c in values if not 0 <= c < available]
    if bad or len(set(values)) < len(values):
        fail(f"--concepts {' '.join(map(str, values))}: give distinct concept ids in 0..{available - 1}")
    return values


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work: the published files, the concepts, the layer."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="smollm2-135m-instruct", help="the chat model")
    parser.add_argument("--concept_dir", default="data/axbench/concept10_2b_l20", help="the published Concept10 files")
    parser.add_argument("--concepts", nargs="+", type=int, help="N (the first N) or concept ids (default: all)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--epochs", type=int, default=None, help="ReFT-r1's epochs (default: the config's 3)")
    parser.add_argument(
        "--layer", type=int, default=None, help="residual stream after this block (default: the config's)"
    )
    parser.add_argument("--max_length", type=int, default=None, help="longest sequence (default: the config's 256)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the LM's dtype")
    parser.add_argument("--repeat", type=int, default=1, help="alternate ours and the reference n times")
    args = parser.parse_args(argv)
    for name in ("epochs", "repeat", "max_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name} {getattr(args, name)} must be a positive integer")
    try:
        check_device(args.device)
    except ValueError as err:
        fail(str(err))
    if not Path(args.concept_dir).is_dir():
        fail(f"--concept_dir {args.concept_dir} is not a directory: get the published files with "
             f"`lit-interventions data axbench-concept10 --out {args.concept_dir}`, or pass --concept_dir")  # fmt: skip
    try:
        available = len(load_concepts(args.concept_dir).concepts)
        lm_config = load_config(args.lm)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err).splitlines()[0])
    args.concepts = concept_ids(args.concepts, available)
    config_file = yaml.safe_load((ROOT / "configs" / "reft_r1.yaml").read_text())
    args.layer = config_file["model"]["init_args"]["layer"] if args.layer is None else args.layer
    args.epochs = config_file["trainer"]["max_epochs"] if args.epochs is None else args.epochs
    args.batch_size = config_file["data"]["init_args"]["batch_size"]
    if not 0 <= args.layer < num_layers(lm_config):
        fail(f"--layer {args.layer} is not a block of {args.lm}: choose 0..{num_layers(lm_config) - 1}")
    return args


def mean_auroc(per_concept: dict[str, float]) -> float:
    """The mean over the concepts that have an AUROC (NaN: a concept without positives or negatives)."""
    values = [v for v in per_concept.values() if v == v]
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(
        f"AxBench {args.concept_dir}, concepts {args.concepts}, {args.lm} layer {args.layer} ({args.dtype}, "
        f"{args.device}); ReFT-r1 {args.epochs} epoch(s) of batches of {args.batch_size}, DiffMean one pass"
    )
    unequal = []
    for method in args.methods:
        setting = Setting(
            method, args.lm, args.concept_dir, tuple(args.concepts), args.device, args.dtype,
            args.epochs, args.layer, args.max_length,
        )  # fmt: skip
        mine, theirs = alternate(ours, reference, args.repeat, setting)
        a, b = mine.result, theirs.result
        mean_a, mean_b = (mean_auroc(r["auroc"]) for r in (a, b))
        per = max(abs(a["auroc"][name] - b["auroc"][name]) for name in a["auroc"])
        same = abs(mean_a - mean_b) <= TOLERANCE
        print(
            f"{method}: AUROC reference {mean_b:.4f}, ours {mean_a:.4f}: {'equal' if same else 'NOT equal'} within "
            f"{TOLERANCE} (largest per-concept difference {per:.4f}, of the rows {float((a['rows'] - b['rows']).abs().max()):.1e})"
        )
        if not same:
            unequal.append(method)
        report(method, mine, theirs, len(args.concepts), "concept")
    exit_if_unequal(unequal, "the AUROC", TOLERANCE)


if __name__ == "__main__":
    main()
