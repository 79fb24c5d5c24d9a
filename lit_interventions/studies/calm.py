"""The CALM study on RAVEL: probes, gradient-based interventions and competence (Davies et al.).

    lit-interventions calm --config configs/calm_ravel.yaml [--layer 6] [--out DIR]

Experimental model (CALM §5.2, App. C.2, adapted to RAVEL):
- properties Z: RAVEL attributes of one entity type (city: Country, Continent, Language), each
  restricted to its `max_classes` most frequent values among the train entities: a probe trains
  and is scored on the entities with a kept value, and attacks aim at a kept value z′ ≠ z;
- tasks T: a prompt that queries one attribute A, so A is the causal property and the others are
  environmental (one competence score per task);
- site: the residual stream after block `layer` at the last token of the entity.

Steps:
1. read the states at the site once (the LM is frozen) for train / val / test entities in the
   prompts of every property;
2. train a probe g_Z per property on train entities, keep its best val epoch, score it on test;
3. per task, per test example and per property Z: attack g_Z toward another kept value z′ (PGD,
   FGSM, or any class with delta(probe, h, target, epsilon) named in `methods` by class_path)
   and, as the control, add a random ±ε perturbation; write h + δ back into the forward;
4. score competence (top-k overlap with the causal graph's prediction, k = 1..k_max, ranked
   within the task's answer vocabulary: the first tokens of the queried attribute's values, as
   the paper ranks within the task's answer vocabulary, App. B.2), the
   targeted probe's success and accuracy after the attack, and the collateral damage (accuracy
   of the other properties' probes after it).

Writes DIR/results.csv (one row per task × method × property), DIR/summary.csv (one row per
task × method) and DIR/summary.json (both, plus probes, ε and the config); probes in DIR/probes/.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from lit_interventions.cli.studies import run_cli
from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.progress import Progress, current, line_seconds
from lit_interventions.core.sharding import is_dispatched
from lit_interventions.interventions.attacks import Attack, build_attack, epsilon_scale
from lit_interventions.metrics.competence import Competence
from lit_interventions.studies.calm_batch import make_batch, record
from lit_interventions.studies.calm_data import (
    POSITION,
    SPLITS,
    Prompt,
    _batches,
    _first_tokens,
    _other_class,
    answer_vocabulary,
    site_states,
    tokenize_splits,
)
from lit_interventions.studies.calm_plan import RANDOM, CalmArgs, CalmPlan, plan_calm
from lit_interventions.studies.calm_probes import fit_probes
from lit_interventions.studies.calm_report import result_row, run_config, summary_row, write_results

__all__ = ["POSITION", "RANDOM", "CalmArgs", "fit_probes", "main", "run_calm"]


@dataclass
class SiteInputs:
    """The frozen LM, every split's prompts and the states it computes at the site (read once),
    and ε in absolute units."""

    tokenizer: object
    model: torch.nn.Module
    prompts: dict[str, list[Prompt]]
    states: dict[str, list[torch.Tensor]]  # split -> the residual stream of each prompt, (seq, d)
    site: dict[str, torch.Tensor]  # split -> its rows at the site, (n, d)
    scale: float  # the site's coordinate scale (`epsilon_scale` of the train states)
    eps: float  # the L∞ radius in absolute units


@dataclass
class _Run:
    """What the interventions of every task share: the plan, the inputs, the probes, the draws of
    z′ (`rng`) and the methods built for this run (the random control's signs are its own draws)."""

    args: CalmArgs
    plan: CalmPlan
    inputs: SiteInputs
    probes: dict  # property -> g_Z
    rng: random.Random
    attacks: dict[str, Attack]  # name -> the attack, the random control last

    @property
    def names(self) -> list[str]:
        """The methods: the attacks, then the random control."""
        return list(self.attacks)


def read_inputs(args: CalmArgs, plan: CalmPlan) -> SiteInputs:
    """Tokenise every split's prompts, load the LM (onto `device` unless it is dispatched), read
    the states at the site once, and ε = epsilon × the site's scale if relative, else epsilon."""
    tokenizer = load_tokenizer(args.lm)
    prompts = tokenize_splits(tokenizer, plan.split_of, plan.properties, plan.templates, args.max_tokens)
    model = load_lm(args.lm, args.dtype, plan.placement.device_map, plan.placement.quantization)
    if not is_dispatched(model):
        model.to(args.device)
    batches = sum(math.ceil(len(prompts[split]) / args.batch_size) for split in SPLITS)
    with Progress(batches, "site states", "batch"):  # counted per batch (`read_states`)
        states, site = site_states(model, plan.layer, prompts, tokenizer.pad_token_id, args.batch_size, args.device)
    scale = epsilon_scale(site["train"])
    eps = args.epsilon * scale if args.epsilon_relative else float(args.epsilon)
    return SiteInputs(tokenizer, model, prompts, states, site, scale, eps)


def _intervene(run: _Run, task: str, chunk: list[int], vocabulary, metric: dict, tally: dict) -> int:
    """One batch of the task's test prompts: per property Z, a target z′ ≠ z per example, δ of
    each attack toward it and of the random control, h + δ written into the forward; updates the
    Competence `metric` and the (method, property) `tally`; returns how many clean top-1
    predictions are a first token of the right answer."""
    args, plan, inputs, g = run.args, run.plan, run.inputs, run.probes
    batch = make_batch(
        [inputs.prompts["test"][i] for i in chunk],
        [inputs.states["test"][i] for i in chunk],
        inputs.site["test"][chunk],
        plan.data,
        plan.classes,
        g,
        inputs.tokenizer.pad_token_id,
        args.device,
    )
    clean = batch.logits(inputs.model, plan.layer)
    answers = [_first_tokens(inputs.tokenizer, plan.data.entities[p.entity][task]) for p in batch.prompts]
    correct = sum(t in ids for t, ids in zip(clean.argmax(-1).tolist(), answers))
    for prop in plan.properties:
        n_classes = len(plan.classes[prop])
        target = torch.tensor([_other_class(int(y), n_classes, run.rng) for y in batch.truth[prop]])  # z′ ≠ z
        deltas = {m: _delta(m, a, g[prop], batch.h, target, inputs.eps) for m, a in run.attacks.items()}
        causal = torch.full((len(chunk),), prop == task)
        for m, delta in deltas.items():
            edited = batch.logits(inputs.model, plan.layer, delta)
            metric[m].update(clean, edited, causal)
            record(tally[(m, prop)], batch, g, prop, target, delta, clean, edited, args.k_max, vocabulary)
        current().update()  # the study's progress: one batch × property
    return correct


def _delta(name: str, attack: Attack, probe, h: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """The attack's δ toward `target`, checked to be (batch, d) as h is."""
    delta = attack.delta(probe, h, target, eps)
    if not isinstance(delta, torch.Tensor) or delta.shape != h.shape:
        got = tuple(delta.shape) if isinstance(delta, torch.Tensor) else type(delta).__name__
        raise ValueError(f"method {name!r}: delta(probe, h, target, epsilon) returned {got}; expected {tuple(h.shape)}")
    return delta


def _run_task(run: _Run, task: str) -> tuple[list[dict], list[dict]]:
    """The results rows (method × property) and summary rows (per method) of one task: its test
    prompts, in batches, under every method; competence ranks within the task's answer vocabulary."""
    args, plan, inputs = run.args, run.plan, run.inputs
    rows = [i for i, p in enumerate(inputs.prompts["test"]) if p.attribute == task]
    if not rows:
        raise ValueError(f"task {task!r} has no test prompt within max_tokens={args.max_tokens}")
    vocabulary = answer_vocabulary(inputs.tokenizer, plan.data, task, plan.templates[task])
    metric = {m: Competence(args.k_max, candidates=vocabulary) for m in run.names}
    tally = {(m, prop): Counter() for m in run.names for prop in plan.properties}
    lm_correct = 0
    for chunk in _batches(rows, args.batch_size):
        lm_correct += _intervene(run, task, chunk, vocabulary, metric, tally)
    results, summary = [], []
    for m in run.names:
        mine = [result_row(task, m, prop, tally[(m, prop)]) for prop in plan.properties]
        results.extend(mine)
        scores = {k: v.item() for k, v in metric[m].compute().items()}
        summary.append(
            summary_row(
                task,
                m,
                scores,
                mine,
                n_properties=len(plan.properties),
                lm_correct=lm_correct,
                n_examples=len(rows),
                answer_vocabulary=len(vocabulary),
                epsilon=args.epsilon,
                epsilon_abs=inputs.eps,
            )
        )
    return results, summary


def run_tasks(args: CalmArgs, plan: CalmPlan, inputs: SiteInputs, probes: dict) -> tuple[list[dict], list[dict]]:
    """Every task's results and summary rows, in task order (one draw of z′ and of the random
    control's signs, seeded, runs through them all: the methods are built afresh here)."""
    attacks = {spec.name: build_attack(spec) for spec in plan.methods}
    run = _Run(args, plan, inputs, probes, random.Random(args.seed), attacks)
    results, summary = [], []
    counts = Counter(p.attribute for p in inputs.prompts["test"])
    total = sum(math.ceil(counts[task] / args.batch_size) for task in plan.tasks) * len(plan.properties)
    with Progress(total, "interventions", "batch") as shown:  # a test batch × a property (`_intervene`)
        for task in plan.tasks:
            shown.note(f"task {task}")
            mine, rows = _run_task(run, task)
            results.extend(mine)
            summary.extend(rows)
    return results, summary


# --- the study: plan, run, report ------------------------------------------------------------------
def run_calm(config: CalmArgs | None = None, /, **settings) -> list[dict]:
    """Run the CALM study; returns the summary rows (one per task × method).

    `config`: the settings as a `CalmArgs` (its docstring says what each one is; default: its
    defaults); `settings`: any of its fields as keywords, over `config`'s, e.g.
    `run_calm(tasks=["Country"], methods=["pgd"], out="runs/calm")`.
    """
    names = [f.name for f in fields(CalmArgs)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise ValueError(f"run_calm has no setting {', '.join(unknown)}; the settings are {', '.join(names)}")
    args = replace(CalmArgs() if config is None else config, **settings)
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    plan = plan_calm(args)  # every check, before the LM's weights are read
    inputs = read_inputs(args, plan)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe_args = dict(
        kind=args.probe,
        hidden=args.probe_hidden,
        lr=args.probe_lr,
        epochs=args.probe_epochs,
        batch_size=args.probe_batch_size,
    )
    where = (args.lm, plan.layer, plan.d)
    training = len(set(plan.classes) - set(plan.loaded))
    with Progress(training, "probes", "probe") if training else nullcontext():  # each one trained (`fit_probes`)
        g, probe_info = fit_probes(
            plan.data,
            inputs.prompts,
            inputs.site,
            plan.classes,
            plan.loaded,
            where,
            probe_args,
            args.seed,
            out_dir / "probes",
        )
    results, summary = run_tasks(args, plan, inputs, g)
    record = run_config(args, plan, inputs.prompts, inputs.eps, inputs.scale)
    write_results(out_dir, results, summary, record, probe_info)
    return summary


def _arguments(parser) -> None:
    """The command's options: the fields of `CalmArgs`."""
    parser.add_class_arguments(CalmArgs)


def main(args=None) -> None:
    """`lit-interventions calm`: the study from the command line."""
    run_cli(run_calm, __doc__, args, customize=_arguments)
