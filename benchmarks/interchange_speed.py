"""DAS training speed: our framework against the CausalGym reference loop, in the same run.

Both train a rank-1 DAS intervention for 100 steps, batch 4, on the same CausalGym pairs, at an
early, a middle and a late layer:
- reference: a plain loop over one `pyvene.IntervenableModel` with
  `LowRankRotatedSpaceIntervention`, a full base and source forward per step (as the CausalGym
  code does);
- ours: `train.py`'s module under a Lightning Trainer. The frozen states at the layer, and the
  keys and values above it of each base's tokens before its site, are computed once per sentence
  in length-sorted batches of 64 (the cache fill, timed on its own); a step then runs only the
  blocks above the site, on the columns from the earliest site on, with the LM head on the last
  position only.

The cache fill is a cost per dataset, not per step: a sweep fills it once for every layer and
region of a task (one forward), and more epochs reuse it. So the ratio is given both ways: over
the training steps, and end to end for this single site with the fill counted in.

`--dtype` sets the frozen LM's dtype for both (the CausalGym code runs float32 on a CPU and
bfloat16 on a GPU); the intervention itself always trains in float32.

Each (method, layer) runs in a fresh process so its peak memory is its own. Prints steps/s, the
ratio per layer, both methods' eval odds (same metric code), and `ratio=X` (middle layer) last.

    python benchmarks/interchange_speed.py [--lm smollm2-135m-instruct] [--steps 100] [--device cpu] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _data(lm: str, task: str, steps: int):
    from lit_interventions.datamodules.causalgym import CausalGymDataModule

    data = CausalGymDataModule(task=task, lm=lm, batch_size=4, train_pairs=max(2 * steps, 2), eval_pairs=50)
    data.setup("fit")
    return data


def _peak_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_ours(lm: str, layer: int, task: str, steps: int, device: str, dtype: str) -> dict:
    import lightning as L

    from lit_interventions.modules.interchange import InterchangeModule

    data = _data(lm, task, steps)
    L.seed_everything(0, verbose=False)
    module = InterchangeModule(lm=lm, layer=layer, dtype=dtype)
    _ = module.to(device).lm  # load the LM before the clock starts, as the reference does
    start = time.perf_counter()
    module.prefill(data.train_dataloader())  # once per dataset; fit's own prefill then finds it all
    fill = time.perf_counter() - start
    trainer = L.Trainer(
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        devices=1,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - start
    odds = module.score(data.test_dataloader())["odds"]
    return {
        "steps_per_s": steps / seconds,
        "fill_s": fill,
        "end_to_end_steps_per_s": steps / (seconds + fill),
        "odds": odds,
        "peak_mb": _peak_mb(device),
    }


def run_reference(lm: str, layer: int, task: str, steps: int, device: str, dtype: str) -> dict:
    import pyvene
    import torch.nn.functional as F
    from transformers import get_linear_schedule_with_warmup

    from lit_interventions.core.lm import load_lm
    from lit_interventions.metrics.odds import log_odds_ratio

    data = _data(lm, task, steps)
    torch.manual_seed(0)
    model = load_lm(lm, dtype).to(device)
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(layer=layer, component="block_output", low_rank_dimension=1)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    intervenable.set_device(device)
    intervention = next(iter(intervenable.interventions.values()))
    intervention = intervention[0] if isinstance(intervention, (tuple, list)) else intervention
    optimizer = torch.optim.Adam(intervention.parameters(), lr=5e-3)
    schedule = get_linear_schedule_with_warmup(optimizer, steps // 10, steps)

    def forward(batch):
        batch = batch.to(device)
        base, source = batch.base, batch.source
        locations = {"sources->base": ([[[p] for p in source.sites]], [[[p] for p in base.sites]])}
        _, out = intervenable(
            {"input_ids": base.input_ids, "attention_mask": base.attention_mask},
            [{"input_ids": source.input_ids, "attention_mask": source.attention_mask}],
            unit_locations=locations,
        )
        rows = torch.arange(len(batch), device=device)
        return out.logits[rows, base.last], batch

    start = time.perf_counter()
    for step, batch in enumerate(data.train_dataloader()):
        if step == steps:
            break
        logits, batch = forward(batch)
        F.cross_entropy(logits.float(), batch.source.label).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - start
    odds = []
    with torch.no_grad():
        for batch in data.test_dataloader():
            intervened, batch = forward(batch)
            base, rows = batch.base, torch.arange(len(batch), device=device)
            clean = model(input_ids=base.input_ids, attention_mask=base.attention_mask).logits
            odds.append(log_odds_ratio(clean[rows, base.last], intervened, base.label, batch.source.label))
    return {"steps_per_s": steps / seconds, "odds": torch.cat(odds).mean().item(), "peak_mb": _peak_mb(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="agr_sv_num_pp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, nargs="*", help="default: early, middle and late")
    parser.add_argument("--dtype", default="float32", help="the frozen LM's dtype, for both methods")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LAYER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, layer = args.worker[0], int(args.worker[1])
        run = run_ours if method == "ours" else run_reference
        print(json.dumps(run(args.lm, layer, args.task, args.steps, args.device, args.dtype)))
        return

    from lit_interventions.core.lm import load_config, num_layers

    n = num_layers(load_config(args.lm))
    layers = args.layers or [n // 8, n // 2, n - 1]
    print(
        f"{args.lm} ({args.dtype}): DAS k=1, task {args.task}, batch 4, {args.steps} steps, device {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        "layer | reference steps/s  odds  peak MB | ours steps/s  fill s  with fill  odds  peak MB | ratio  with fill"
    )
    ratios, end_to_end = {}, {}
    for layer in layers:
        result = {}
        for method in ("reference", "ours"):
            command = [
                sys.executable,
                __file__,
                "--lm",
                args.lm,
                "--task",
                args.task,
                "--steps",
                str(args.steps),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--worker",
                method,
                str(layer),
            ]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            result[method] = json.loads(done.stdout.strip().splitlines()[-1])
        ref, ours = result["reference"], result["ours"]
        ratios[layer] = ours["steps_per_s"] / ref["steps_per_s"]
        end_to_end[layer] = ours["end_to_end_steps_per_s"] / ref["steps_per_s"]
        print(
            f"{layer:5d} | {ref['steps_per_s']:17.2f} {ref['odds']:5.2f} {ref['peak_mb']:8.0f} | "
            f"{ours['steps_per_s']:12.2f} {ours['fill_s']:7.2f} {ours['end_to_end_steps_per_s']:10.2f} "
            f"{ours['odds']:5.2f} {ours['peak_mb']:8.0f} | {ratios[layer]:5.2f} {end_to_end[layer]:10.2f}"
        )
    middle = layers[len(layers) // 2]
    print(f"ratio={ratios[middle]:.2f} (training steps; {end_to_end[middle]:.2f} end to end with the cache fill)")


if __name__ == "__main__":
    main()
