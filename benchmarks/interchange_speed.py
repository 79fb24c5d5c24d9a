"""DAS training steps per second: our path against the CausalGym reference loop structure, measured
in the same run on the same batches.

Reference: one pyvene IntervenableModel for the site, a full base and source forward every step
(LowRankRotatedSpaceIntervention, k=1). Ours: the source forward stops at the layer, and only the
base's last position goes through the LM head.

    python benchmarks/interchange_speed.py [--lm smollm2-135m-instruct] [--steps 30] [--layers 3 15 27]
"""

from __future__ import annotations

import argparse
import itertools
import time

import pyvene
import torch
import torch.nn.functional as F

from datamodules.causalgym import CausalGymDataModule
from lit_interventions.lm import load_lm, num_layers
from lit_interventions.modules.interchange import InterchangeModule


def _time(step, batches, steps: int) -> float:
    step(batches[0])  # warm-up
    start = time.perf_counter()
    for batch in itertools.islice(itertools.cycle(batches), steps):
        step(batch)
    return steps / (time.perf_counter() - start)


def ours(lm_name: str, layer: int, batches, steps: int) -> float:
    module = InterchangeModule(lm=lm_name, layer=layer)
    optimizer = torch.optim.Adam(module.intervention.parameters(), lr=5e-3)

    def step(batch):
        loss = F.cross_entropy(module.intervened_logits(batch), batch["source_label"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return _time(step, batches, steps)


def reference(lm_name: str, layer: int, batches, steps: int) -> float:
    model = load_lm(lm_name)
    config = pyvene.IntervenableConfig(
        representations=[pyvene.RepresentationConfig(layer=layer, component="block_output", low_rank_dimension=1)],
        intervention_types=pyvene.LowRankRotatedSpaceIntervention,
    )
    intervenable = pyvene.IntervenableModel(config, model)
    params = [p for iv in intervenable.interventions.values() for p in (iv[0] if isinstance(iv, tuple) else iv).parameters()]
    optimizer = torch.optim.Adam(params, lr=5e-3)

    def step(batch):
        rows = torch.arange(len(batch["base_pos"]))
        locations = {"sources->base": ([[[p] for p in batch["source_pos"].tolist()]], [[[p] for p in batch["base_pos"].tolist()]])}
        _, out = intervenable(
            {"input_ids": batch["base_input_ids"], "attention_mask": batch["base_attention_mask"]},
            [{"input_ids": batch["source_input_ids"], "attention_mask": batch["source_attention_mask"]}],
            unit_locations=locations,
        )
        loss = F.cross_entropy(out.logits[rows, batch["base_last"]], batch["source_label"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return _time(step, batches, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="agr_sv_num_pp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, nargs="*", help="default: early, middle and late")
    args = parser.parse_args()
    n = num_layers(load_lm(args.lm).config)
    layers = args.layers or [n // 8, n // 2, n - 1]
    data = CausalGymDataModule(task=args.task, lm=args.lm, batch_size=4)
    data.setup("fit")
    batches = list(itertools.islice(data.train_dataloader(), 20))
    print(f"{args.lm}, task {args.task}, batch 4, {args.steps} steps, {torch.get_num_threads()} threads")
    print("layer  reference steps/s  ours steps/s  speed-up")
    for layer in layers:
        ref, fast = reference(args.lm, layer, batches, args.steps), ours(args.lm, layer, batches, args.steps)
        print(f"{layer:5d}  {ref:17.2f}  {fast:12.2f}  {fast / ref:8.2f}x")


if __name__ == "__main__":
    main()
