"""Batching of concurrent requests: one worker thread owns the LM and runs one `generate` per
batch.

Requests (`Job`s) wait in arrival order. The worker takes the oldest and the others pending with
the same sampling settings, up to `max_batch`, once it has `max_batch` of them or the oldest has
waited `wait` seconds (the ones that arrived while a batch ran go at once), and hands them to
`run(jobs)`, which left-pads their prompts into one `generate`. During it, `RowStreamer` (a
`transformers` streamer) splits each step's new tokens per row into each job's `Reply`, and
`RowsDone` (a stopping criterion) marks rows that have ended, so `generate` stops when all have.

A job leaves as soon as its client does (`cancel`): dropped from the queue, or its row ended at
the next token. `stop` (the server stopping) fails the queued jobs at once and ends the running
rows at their next token, each with a 503 error; `close` then joins the worker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from lit_interventions.serving.completion_request import Sampling, Steering
from lit_interventions.serving.reply_stream import Reply

SHUTTING_DOWN = "the server is shutting down; retry later"


@dataclass
class Job:
    """One request: its prompt token ids, sampling, steering, and the `Reply` it fills."""

    ids: list[int]
    sampling: Sampling
    steering: Steering
    reply: Reply
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def limit(self) -> int:
        return self.reply.limit


class RowStreamer(BaseStreamer):
    """Each step's new tokens, (batch,), to each row's reply (the first call, the prompts, is
    skipped); rows still open when `generate` ends have reached the batch's token limit."""

    def __init__(self, replies: Sequence[Reply]):
        self.replies, self.prompt_seen = list(replies), False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for reply, token in zip(self.replies, value.reshape(len(self.replies), -1)[:, -1].tolist(), strict=True):
            reply.push(int(token))

    def end(self) -> None:
        for reply in self.replies:
            reply.end("length")


class RowsDone(StoppingCriteria):
    """Per row: ended (EOS, `stop`, client gone) or at its own token limit. `width`: the padded
    prompt length."""

    def __init__(self, replies: Sequence[Reply], width: int):
        self.replies, self.width = list(replies), width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        made = input_ids.shape[1] - self.width
        done = [reply.done or made >= reply.limit for reply in self.replies]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Batcher:
    """A queue of jobs and the worker thread that runs them in batches (see the module doc).
    `batches`: how many `run` calls were made; `running`: the jobs of the batch that is running."""

    def __init__(self, run: Callable[[list[Job]], None], max_batch: int = 8, wait: float = 0.01):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an integer >= 1")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
            raise ValueError(f"wait={wait!r} must be a number of seconds >= 0")
        self.run, self.max_batch, self.wait = run, max_batch, float(wait)
        self.pending: deque[Job] = deque()
        self.running: list[Job] = []
        self.changed = threading.Condition()
        self.closed = False
        self.batches = 0
        self.thread = threading.Thread(target=self._work, name="steered-lm", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; a closed batcher fails it at once (503)."""
        with self.changed:
            if not self.closed:
                self.pending.append(job)
                self.changed.notify()
                return
        job.reply.fail(SHUTTING_DOWN, 503)

    def cancel(self, job: Job) -> None:
        """The client of `job` left: drop it from the queue, or end its row at the next token."""
        job.reply.cancelled.set()
        with self.changed:
            self.pending = deque(queued for queued in self.pending if queued is not job)

    def stop(self, message: str = SHUTTING_DOWN) -> None:
        """Take no more jobs: fail the queued ones at once and end the running rows at their next
        token (failed as their `generate` returns), each with a 503 `message`."""
        with self.changed:
            self.closed = True
            left, self.pending = list(self.pending), deque()
            running = list(self.running)
            self.changed.notify_all()
        for job in left:
            job.reply.fail(message, 503)
        for job in running:
            job.reply.stop(message)

    def close(self) -> None:
        """`stop`, then wait for the worker to end (the running batch ends at its next token)."""
        self.stop()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _take(self) -> list[Job] | None:
        """The next batch (see the module doc), or None once closed."""
        with self.changed:
            while True:
                self.pending = deque(job for job in self.pending if not job.reply.cancelled.is_set())
                if self.closed:
                    return None
                if not self.pending:
                    self.changed.wait()
                    continue
                head = self.pending[0]
                batch = [job for job in self.pending if job.sampling == head.sampling][: self.max_batch]
                left = head.enqueued + self.wait - time.monotonic()
                if len(batch) >= self.max_batch or left <= 0:
                    taken = {id(job) for job in batch}
                    self.pending = deque(job for job in self.pending if id(job) not in taken)
                    self.running = batch
                    return batch
                self.changed.wait(left)

    def _work(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                self.batches += 1
                self.run(jobs)
            except Exception as err:  # noqa: BLE001 - every waiting client gets an error reply
                for job in jobs:
                    job.reply.fail(f"generation failed: {type(err).__name__}: {str(err)[:300]}")
            finally:
                with self.changed:
                    self.running = []
                for job in jobs:
                    job.reply.end("length")  # a row `generate` left open (no-op for ended ones)
