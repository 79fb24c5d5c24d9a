"""Requests per second of `lit-interventions serve` against plain `transformers` generation of the
same prompts one by one, in the same run.

- reference: the LM alone (no artifact, no server), `generate` on each chat prompt in turn,
  greedy, `--max_tokens` new tokens at most;
- serve: `lit-interventions serve --artifact ARTIFACT` in a subprocess on 127.0.0.1, the same
  prompts sent through the `openai` client as chat completions (greedy, the same `max_tokens`),
  each client steering with its own concept at `--factor`; with 1 client (one request at a
  time), then with `--clients` clients at once (their requests batched into one `generate`).

Each client sends `--requests` requests (the prompts in turn); the reference generates
`--requests` prompts. The three settings run in turn, `--rounds` times, so that a change in the
machine's load falls on all of them. Steered replies do not have the unsteered replies' lengths,
so tokens per second (completion tokens, as `usage` counts them) are printed beside requests per
second. Prints one line per setting and `ratio_1=X ratio_N=Y` (requests per second over the
reference's) last.

    python benchmarks/serve_throughput.py [--artifact checkpoints/axbench/builtin-diffmean] [--max_tokens 32]
    python benchmarks/serve_throughput.py --device cuda --requests 16 --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import torch

from lit_interventions.core.lm import load_lm, load_tokenizer
from lit_interventions.core.positions import encode_text
from lit_interventions.inference.apply import load_artifact
from lit_interventions.inference.generate import prompt_text

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write one sentence about your day.",
    "Describe a walk in the park.",
    "What should I cook tonight?",
    "Tell me about your favourite book.",
    "Explain how a bicycle works.",
    "Give me advice for a job interview.",
    "Describe the view from a window.",
    "Write a short note to a friend.",
]


class Reference:
    """Plain `generate` on chat prompts one by one: the LM alone, greedy."""

    def __init__(self, lm_name: str, device: str, max_tokens: int):
        self.lm, self.tokenizer = load_lm(lm_name).to(device), load_tokenizer(lm_name)
        self.max_tokens = max_tokens
        self.one(PROMPTS[0])  # warm-up

    @torch.no_grad()
    def one(self, prompt: str) -> int:
        text, templated = prompt_text(self.tokenizer, prompt)
        enc = {k: v.to(self.lm.device) for k, v in encode_text(self.tokenizer, text, templated).items()}
        out = self.lm.generate(
            **enc, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
        )
        return out.shape[1] - enc["input_ids"].shape[1]

    def __call__(self, n: int) -> tuple[float, int]:
        """(seconds, completion tokens) of `n` prompts one by one."""
        start = time.perf_counter()
        tokens = sum(self.one(PROMPTS[k % len(PROMPTS)]) for k in range(n))
        return time.perf_counter() - start, tokens


def start_server(artifact: str, max_tokens: int, max_batch: int, device: str) -> tuple[subprocess.Popen, str]:
    """`lit-interventions serve` on a free port: (the process, its base URL)."""
    command = [sys.executable, "-m", "lit_interventions", "serve", "--artifact", artifact, "--port", "0"]
    command += ["--max_new_tokens", str(max_tokens), "--max_batch", str(max_batch), "--device", device]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().strip()
    if not line.startswith("serving "):
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, line.rsplit(" at ", 1)[1]


def clients(
    url: str, model: str, n_clients: int, n: int, max_tokens: int, factor: float, n_concepts: int
) -> tuple[float, int]:
    """(seconds, completion tokens) of `n_clients` clients at once, each sending `n` requests in
    turn; client k steers with concept k (modulo `n_concepts`)."""
    tokens = [0] * n_clients

    def client(k: int) -> None:
        api = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        for i in range(n):
            reply = api.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"concept": k % n_concepts, "factor": factor},
            )
            tokens[k] += reply.usage.completion_tokens

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default="checkpoints/axbench/builtin-diffmean")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3, help="requests per client (and prompts of the reference)")
    parser.add_argument("--clients", type=int, default=8, help="clients at once in the batched setting")
    parser.add_argument("--rounds", type=int, default=2, help="times the three settings run in turn")
    parser.add_argument("--factor", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    artifact = load_artifact(args.artifact)
    lm_name, n_concepts = artifact.model, len(artifact.concepts or [None])
    print(f"lm={lm_name} artifact={args.artifact} max_tokens={args.max_tokens} device={args.device}", end=" ")
    print(f"torch_threads={torch.get_num_threads()} rounds={args.rounds}")
    reference = Reference(lm_name, args.device, args.max_tokens)
    process, url = start_server(args.artifact, args.max_tokens, max(args.clients, 1), args.device)
    settings = ("reference", 1, args.clients)
    totals = {setting: [0.0, 0, 0] for setting in settings}  # seconds, requests, tokens
    try:
        clients(url, lm_name, 1, 1, args.max_tokens, args.factor, n_concepts)  # warm-up
        for _ in range(args.rounds):
            for setting in settings:
                if setting == "reference":
                    seconds, tokens = reference(args.requests)
                else:
                    seconds, tokens = clients(
                        url, lm_name, setting, args.requests, args.max_tokens, args.factor, n_concepts
                    )
                n = args.requests * (1 if setting == "reference" else setting)
                totals[setting] = [a + b for a, b in zip(totals[setting], (seconds, n, tokens), strict=True)]
    finally:
        process.terminate()
        process.wait(30)
    rate = {setting: requests / seconds for setting, (seconds, requests, _) in totals.items()}
    for setting, (seconds, requests, tokens) in totals.items():
        name = (
            "reference (transformers generate, one by one)" if setting == "reference" else f"serve, {setting} client(s)"
        )
        print(
            f"{name}: {rate[setting]:.3f} requests/s, {tokens / seconds:.1f} tokens/s ({requests} requests, {seconds:.1f} s)"
        )
    plain = rate["reference"]
    print(f"ratio_1={rate[1] / plain:.2f} ratio_{args.clients}={rate[args.clients] / plain:.2f}")


if __name__ == "__main__":
    main()
