"""A sweep on one machine's cores: N ranks of one thread each (torchrun, gloo) against one
process with N threads, the same units of work, alternating `--repeat` times.

On a small CPU, torch's threads share out the big matrix products, but the Python, the dispatch
and the small kernels between them run on one core. N processes of one thread keep every core
busy, each on its own units (`lit_interventions.studies.distributed`). Each command is timed whole (model
loads, cache fills and rank 0's merge included). The units should be several, of like size:
a rank waits for the slowest.

Every value but DAS's is identical between the two. DAS differs slightly: its training steps sum
matrix products in another order with another thread count, and in bfloat16 the trajectories
part (the odds of a site within about 0.1 on gemma-3-270m).

    python benchmarks/sweep_ranks.py --tasks agr_sv_num_pp agr_sv_num_obj-relc --layers 3 9 15
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(command: list[str], env: dict) -> float:
    """Seconds the command takes; its output goes to a log, shown if it fails."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def differing(one: Path, many: Path) -> set[str]:
    """The methods whose rows differ between two results.csv files of the same units."""
    rows = [list(csv.DictReader(open(path))) for path in (one, many)]
    key = lambda row: (row["task"], row["method"], row["layer"], row["region"])  # noqa: E731
    if sorted(map(key, rows[0])) != sorted(map(key, rows[1])):
        sys.exit(f"{one} and {many} hold different sites")
    theirs = {key(row): row for row in rows[1]}
    return {row["method"] for row in rows[0] if row != theirs[key(row)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", default="gemma-3-270m")
    parser.add_argument("--tasks", nargs="+", default=["agr_sv_num_pp", "agr_sv_num_obj-relc"])
    parser.add_argument("--layers", nargs="+", default=["3", "9", "15"], help="layer indices, or all")
    parser.add_argument("--ranks", type=int, default=os.cpu_count(), help="processes (default: one a core)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--control", action="store_true", help="score the control task too")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: at least 2 (a machine with one core has nothing to share out)")
    layers = args.layers[0] if args.layers == ["all"] else f"[{','.join(args.layers)}]"
    sweep = [
        "-m",
        "lit_interventions.studies.causalgym_sweep",
        "--config",
        "configs/sweep_causalgym.yaml",
        "--lm",
        args.lm,
        "--tasks",
        f"[{','.join(args.tasks)}]",
        "--layers",
        layers,
        "--dtype",
        args.dtype,
        "--control",
        str(args.control).lower(),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    threads = {**os.environ, "OMP_NUM_THREADS": str(args.ranks)}
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}

    one, many = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            one.append(timed([sys.executable, *sweep, "--out", f"{tmp}/one{i}"], threads))
            many.append(timed([*torchrun, *sweep, "--out", f"{tmp}/many{i}"], one_thread))
            print(
                f"round {i + 1}: one process × {args.ranks} threads {one[-1]:.1f} s, "
                f"{args.ranks} ranks × 1 thread {many[-1]:.1f} s",
                flush=True,
            )
        methods = differing(Path(f"{tmp}/one0/results.csv"), Path(f"{tmp}/many0/results.csv"))
    print(f"{args.lm} ({args.dtype}), tasks {args.tasks}, layers {args.layers}, control {args.control}")
    print(f"methods whose values differ: {sorted(methods) or 'none'}")
    print(f"ratio={min(one) / min(many):.2f}  (best of {args.repeat}: {min(one):.1f} s / {min(many):.1f} s)")


if __name__ == "__main__":
    main()
