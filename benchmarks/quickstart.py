"""Time the README's quickstart job (`python train.py fit --config configs/das.yaml`), model load
included, and print it as a ratio of the 5-minute target.

    python benchmarks/quickstart.py [--cold]

--cold empties the converted-model cache first, so the one-time GGUF conversion is timed too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="time the GGUF conversion too")
    args, extra = parser.parse_known_args()
    env = dict(os.environ)
    if args.cold:
        env["LIT_INTERVENTIONS_CACHE"] = tempfile.mkdtemp(prefix="lit-cache-")
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "train.py",
            "fit",
            "--config",
            "configs/das.yaml",
            f"--trainer.default_root_dir={out}",
            "--trainer.enable_progress_bar=false",
            *extra,
        ]
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        card = next(Path(out).glob("lightning_logs/version_*/intervention.json")).read_text()
    if args.cold:
        shutil.rmtree(env["LIT_INTERVENTIONS_CACHE"], ignore_errors=True)
    print(card)
    print(f"quickstart fit ({'cold' if args.cold else 'warm'} cache): {seconds:.1f} s on {os.cpu_count()} CPU cores")
    print(f"ratio to the {TARGET_SECONDS:.0f} s target: {seconds / TARGET_SECONDS:.2f} (below 1 meets it)")


if __name__ == "__main__":
    main()
