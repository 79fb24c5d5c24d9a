"""Time per site of a one-task CausalGym sweep: ours against a reference loop, same run.

- ours: `lit-interventions sweep causalgym` (activations of every layer computed once per task,
  in full batches; DAS at every layer and region of the task trained in one loop, one stacked
  forward per step; each site runs only the blocks above it; one unintervened forward shared by
  all methods; the odds from the two labels' rows of the LM head);
- reference `pyvene` (the default): per site, one `pyvene.IntervenableModel`; DAS trained with a
  full base and source forward every step; the base representations for the closed-form methods
  read with a forward per site; every method scored with full base and source forwards. Both use
  the same data, directions (`fit_direction`) and odds metric (`log_odds_ratio`). smollm2 is the
  default model because pyvene 0.1.8 has no mapping for Gemma 3;
- reference `per_layer`: our sweep with DAS trained in one loop per layer (the regions of a layer
  stacked, `train_das(one_loop=False)`), the loop before the stacked one; any model (Gemma 3 too).
  With `--repeat n`, the two sweeps alternate n times (a shared machine's load hits both alike).

    python benchmarks/sweep_speed.py [--lm smollm2-135m-instruct] [--layers 7 22] [--methods das diffmean probe]
    python benchmarks/sweep_speed.py --against per_layer --lm gemma-3-270m --dtype bfloat16 --layers all --methods das
    python benchmarks/sweep_speed.py --layers all --reference_layers 7 22   # a whole task against a sample
    python benchmarks/sweep_speed.py --lm /tmp/pythia-1b-random --device cuda   # both sides on the GPU

A reference site costs the same whatever the other sites are, so `--reference_layers` times it on
a sample of layers while ours runs all of `--layers`, as a whole study does; both figures are
seconds per site. Each side runs in its own spawned process (`measure.isolated`), which loads the
LM untimed and reports its peak RSS.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial

import numpy as np
import pyvene
import torch
import torch.nn.functional as F
from lit_interventions.datamodules.causalgym import CausalGymDataModule
from measure import alternate, isolated, pyvene_last_logits, report
from transformers import get_linear_schedule_with_warmup

from lit_interventions.cli.studies import choose_layers
from lit_interventions.core.forward import read_site
from lit_interventions.core.lm import check_device, load_config, load_lm, num_layers
from lit_interventions.interventions.directions import fit_direction
from lit_interventions.metrics.odds import log_odds_ratio
from lit_interventions.studies import causalgym_sweep as sweep
from lit_interventions.studies import causalgym_training as training


def reference_site(lm: str, task: str, layer: int, region: str, methods: list[str], device: str = "cpu") -> None:
    """One site the way the CausalGym code runs it, on `device`."""
    data = CausalGymDataModule(task=task, lm=lm, region=region)
    try:
        data.setup("fit")
    except ValueError:
        return
    model = load_lm(lm).to(device)
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(layer=layer, component="block_output", low_rank_dimension=1)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    intervenable.set_device(device)
    intervention = next(iter(intervenable.interventions.values()))
    intervention = intervention[0] if isinstance(intervention, (tuple, list)) else intervention

    def forward(batch):  # on `device`
        return pyvene_last_logits(intervenable, batch.base, batch.source)

    train = [b.to(device) for b in data.loader("train", 4)]
    evaluation = [b.to(device) for b in data.loader("eval", 16)]
    X = torch.cat(
        [
            read_site(model, layer, b.base.input_ids, b.base.attention_mask, b.base.pos).cpu()
            for b in (b.to(device) for b in data.loader("train", 16))
        ]
    )
    types = np.array([e.base_type for e in data.splits["train"]])
    for method in methods:
        if method == "das":
            optimizer = torch.optim.Adam(intervention.parameters(), lr=5e-3)
            schedule = get_linear_schedule_with_warmup(optimizer, len(train) // 10, len(train))
            for batch in train:
                F.cross_entropy(forward(batch), batch.source.label).backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        else:
            try:
                direction = fit_direction(method, X, types)
            except ValueError:  # a degenerate site (identical states): nothing to fit
                direction = None
            if direction is not None:
                with torch.no_grad():
                    intervention.rotate_layer.weight = direction[:, None].to(device)
        with torch.no_grad():
            for batch in evaluation:
                base = batch.base
                clean = model(input_ids=base.input_ids, attention_mask=base.attention_mask).logits
                clean = clean[torch.arange(len(batch), device=clean.device), base.last]
                log_odds_ratio(clean, forward(batch), base.label, batch.source.label)


def our_sweep(args, one_loop: bool = True) -> float:
    """Seconds of our sweep of the task (DAS in one loop, or one loop per layer)."""
    train_das = training.train_das
    training.train_das = partial(train_das, one_loop=one_loop)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as out:
            sweep.run_sweep(
                tasks=args.task,
                methods=args.methods,
                layers=args.layers,
                lm=args.lm,
                out=out,
                dtype=args.dtype,
                train_pairs=args.train_pairs,
                eval_pairs=args.eval_pairs,
            )
    finally:
        training.train_das = train_das
    return time.perf_counter() - start


def _loaded(lm: str, dtype: str) -> float:
    """Seconds to load the LM into this process's cache (set-up, not timed)."""
    start = time.perf_counter()
    load_lm(lm, dtype)
    return time.perf_counter() - start


def ours_side(args, one_loop: bool = True) -> tuple[float, float]:
    """(set-up seconds, seconds of our sweep of the task), in a process of its own."""
    setup = _loaded(args.lm, args.dtype)
    return setup, our_sweep(args, one_loop)


def per_layer_side(args) -> tuple[float, float]:
    """(set-up seconds, seconds of our sweep with one DAS loop per layer)."""
    return ours_side(args, one_loop=False)


def reference_side(args, reference_layers: list[int], regions: list[str]) -> tuple[float, None]:
    """(set-up seconds, None): the pyvene reference at every region of `reference_layers`."""
    setup = _loaded(args.lm, "float32")
    for layer in reference_layers:
        for region in regions:
            reference_site(args.lm, args.task, layer, region, args.methods, args.device)
    return setup, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="agr_sv_num_pp")
    parser.add_argument("--layers", nargs="+", default=["7", "22"], help="layer indices, or all")
    parser.add_argument("--methods", nargs="+", default=["das", "probe", "diffmean", "pca", "kmeans", "lda", "random"])
    parser.add_argument(
        "--reference_layers",
        nargs="+",
        default=None,
        help="the layers the pyvene reference runs (default: --layers); its time per site is their mean",
    )
    parser.add_argument("--against", choices=["pyvene", "per_layer"], default="pyvene")
    parser.add_argument("--dtype", default="float32", help="the LM's dtype (ours; pyvene runs float32)")
    parser.add_argument("--train_pairs", type=int, default=200)
    parser.add_argument("--eval_pairs", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=1, help="alternate ours and the per_layer reference n times")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu", help="both sides"
    )
    args = parser.parse_args()
    try:
        check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    if args.device == "cpu":  # the sweep takes a GPU whenever it sees one: the children see none
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.against == "pyvene" and (args.dtype, args.train_pairs, args.eval_pairs) != ("float32", 200, 50):
        parser.error("--against pyvene runs the paper's sizes in float32: leave --dtype, --train_pairs, --eval_pairs")
    layers = "all" if args.layers == ["all"] else [int(layer) for layer in args.layers]
    n_layers = num_layers(load_config(args.lm))
    args.layers = choose_layers(layers, n_layers)
    if args.against == "per_layer" and args.reference_layers is not None:
        parser.error("--reference_layers samples the pyvene reference; --against per_layer runs --layers")
    reference_layers = (
        args.layers
        if args.reference_layers is None
        else choose_layers([int(layer) for layer in args.reference_layers], n_layers)
    )  # checked before any work
    regions = CausalGymDataModule(task=args.task).template.regions
    sites = len(args.layers) * len(regions)

    if args.against == "per_layer":  # alternating --repeat times; the fastest run of each
        ours, reference = alternate(ours_side, per_layer_side, args.repeat, args)
        reference_sites = sites
    else:
        ours = isolated(ours_side, args)
        reference = isolated(reference_side, args, reference_layers, regions)
        reference_sites = len(reference_layers) * len(regions)
    ours.seconds, reference.seconds = ours.seconds / sites, reference.seconds / reference_sites

    print(
        f"{args.lm} ({args.dtype}), task {args.task}, layers {args.layers}, {len(regions)} regions, "
        f"methods {args.methods}, {args.train_pairs} train / {args.eval_pairs} eval pairs"
    )
    if args.against == "pyvene" and reference_layers != args.layers:
        print(f"the reference timed at layers {reference_layers} ({len(reference_layers) * len(regions)} sites)")
    print(f"reference: {args.against}")
    report("sweep", ours, reference, unit="site")


if __name__ == "__main__":
    main()
