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
   FGSM) and, as the control, add a random ±ε perturbation; write h + δ back into the forward;
4. score competence (top-k overlap with the causal graph's prediction, k = 1..k_max, ranked
   within the task's answer vocabulary: the first tokens of the queried attribute's values, as
   the paper ranks within the task's answer vocabulary, App. B.2), the
   targeted probe's success and accuracy after the attack, and the collateral damage (accuracy
   of the other properties' probes after it).

Writes DIR/results.csv (one row per task × method × property), DIR/summary.csv (one row per
task × method) and DIR/summary.json (both, plus probes, ε and the config); probes in DIR/probes/.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_interventions.cli.studies import run_cli
from lit_interventions.core.lm import DEFAULT_LM, load_lm, load_tokenizer
from lit_interventions.core.sharding import is_dispatched
from lit_interventions.interventions.attacks import attack, epsilon_scale, random_sign
from lit_interventions.metrics.competence import Competence
from lit_interventions.studies.calm_batch import make_batch, record
from lit_interventions.studies.calm_data import (
    POSITION,
    Prompt,
    _batches,
    _first_tokens,
    _other_class,
    answer_vocabulary,
    site_states,
    tokenize_splits,
)
from lit_interventions.studies.calm_plan import CalmArgs, CalmPlan, plan_calm
from lit_interventions.studies.calm_probes import fit_probes
from lit_interventions.studies.calm_report import result_row, run_config, summary_row, write_results

__all__ = ["POSITION", "RANDOM", "fit_probes", "main", "run_calm"]

RANDOM = "random"  # the control: ±ε per coordinate, same size as the attacks


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
    """What the interventions of every task share: the plan, the inputs, the probes and the draws
    (z′ from `rng`, the random control's signs from `noise`)."""

    args: CalmArgs
    plan: CalmPlan
    inputs: SiteInputs
    probes: dict  # property -> g_Z
    rng: random.Random
    noise: torch.Generator

    @property
    def names(self) -> list[str]:
        """The methods: the attacks, then the random control."""
        return [*self.plan.methods, RANDOM]


def read_inputs(args: CalmArgs, plan: CalmPlan) -> SiteInputs:
    """Tokenise every split's prompts, load the LM (onto `device` unless it is dispatched), read
    the states at the site once, and ε = epsilon × the site's scale if relative, else epsilon."""
    tokenizer = load_tokenizer(args.lm)
    prompts = tokenize_splits(tokenizer, plan.split_of, plan.properties, plan.templates, args.max_tokens)
    model = load_lm(args.lm, args.dtype, plan.placement.device_map, plan.placement.quantization)
    if not is_dispatched(model):
        model.to(args.device)
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
        deltas = {m: attack(m, g[prop], batch.h, target, inputs.eps, args.alpha, args.steps) for m in plan.methods}
        deltas[RANDOM] = random_sign(batch.h, inputs.eps, run.noise)
        causal = torch.full((len(chunk),), prop == task)
        for m, delta in deltas.items():
            edited = batch.logits(inputs.model, plan.layer, delta)
            metric[m].update(clean, edited, causal)
            record(tally[(m, prop)], batch, g, prop, target, delta, clean, edited, args.k_max, vocabulary)
    return correct


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
    control's signs, seeded, runs through them all)."""
    run = _Run(args, plan, inputs, probes, random.Random(args.seed), torch.Generator().manual_seed(args.seed))
    results, summary = [], []
    for task in plan.tasks:
        mine, rows = _run_task(run, task)
        results.extend(mine)
        summary.extend(rows)
    return results, summary


# --- the study: plan, run, report ------------------------------------------------------------------
def run_calm(
    lm: str = DEFAULT_LM,
    dtype: str = "float32",
    device: str = "cpu",
    ravel_dir: str | None = None,
    entity_type: str = "city",
    properties: list[str] | None = None,
    tasks: list[str] | None = None,
    layer: int | None = None,
    max_classes: int = 6,
    entities: dict[str, int] | None = None,
    templates_per_property: int = 3,
    max_tokens: int = 96,
    probe: str = "mlp",
    probe_hidden: int | None = None,
    probe_epochs: int = 32,
    probe_lr: float = 1e-3,
    probe_batch_size: int = 64,
    probes: str | None = None,
    methods: list[str] | None = None,
    epsilon: float = 0.1,
    epsilon_relative: bool = False,
    alpha: float | None = None,
    steps: int = 40,
    k_max: int = 10,
    batch_size: int = 16,
    seed: int = 0,
    out: str = "runs/calm",
    device_map: str | int | dict | None = None,
    quantization: str | None = None,
) -> list[dict]:
    """Run the CALM study; returns the summary rows (one per task × method).

    Args:
        lm, dtype, device: the frozen LM ("gemma-3-270m" by default) and where it runs.
        ravel_dir, entity_type: RAVEL files (None: our built-in data) and the entity type.
        properties: the attributes Z to probe and intervene on (default: all of the type).
        tasks: the attributes whose prompts form the tasks (default: every property).
        layer: residual stream after this block (default: the middle layer); site: entity's last token.
        max_classes: each property keeps its most frequent values among train entities.
        entities: at most this many entities per split, {"train": .., "val": .., "test": ..}.
        templates_per_property: prompt templates per attribute (probes read all of them; a task's
            examples use its own); templates longer than max_tokens (with the entity) are dropped.
        probe, probe_hidden, probe_epochs, probe_lr, probe_batch_size: g_Z ("mlp" or "linear").
        probes: a directory of probes saved by an earlier run (PROPERTY.ckpt) to reuse; each must
            have been trained at this site of this model.
        methods: attacks among fgsm, pgd (the random control always runs).
        epsilon: the L∞ radius, > 0. epsilon_relative: multiply it by the site's coordinate scale
            (the median per-coordinate std of the train states); False = absolute, as in the paper.
        alpha, steps: PGD step (default ε/10) and T (40).
        k_max: competence averages top-k overlap over k = 1..k_max (10), ranked within the task's
            answer vocabulary (k stops at its size if that is smaller).
        device_map, quantization: a frozen LM larger than one device (`lit_interventions.core.sharding`):
            e.g. "auto" and "4bit"; `device` is then where the inputs and probes go.
    """
    args = CalmArgs(**locals())  # the arguments as given: nothing else is defined yet
    plan = plan_calm(args)  # every check, before the LM's weights are read
    inputs = read_inputs(args, plan)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe_args = dict(kind=probe, hidden=probe_hidden, lr=probe_lr, epochs=probe_epochs, batch_size=probe_batch_size)
    where = (lm, plan.layer, plan.d)
    g, probe_info = fit_probes(
        plan.data, inputs.prompts, inputs.site, plan.classes, plan.loaded, where, probe_args, seed, out_dir / "probes"
    )
    results, summary = run_tasks(args, plan, inputs, g)
    config = run_config(args, plan, inputs.prompts, inputs.eps, inputs.scale)
    write_results(out_dir, results, summary, config, probe_info)
    return summary


def main(args=None) -> None:
    """`lit-interventions calm`: the study from the command line."""
    run_cli(run_calm, __doc__, args)
