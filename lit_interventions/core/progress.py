"""The studies' progress: a tqdm bar when stdout is a terminal, else a plain line every few seconds.

A study opens its progress over its coarse units of work (`Progress(total, "sites", "site")`:
sites, cells, tasks), and the code under it reports its inner units (training batches, scoring
forwards, generated tokens, judged generations) in a stage nested in the innermost progress open
(`stage(total, desc, unit)`; outside a study's progress a stage shows nothing). Every level has
its total, taken from the plan, and its ETA: (elapsed / units done here) × units left.

On a terminal each level is a tqdm bar on stdout (a stage's bar is removed when it ends). When
stdout is not a terminal (`> log.txt`, a pipe), as `callbacks.progress.LineProgress` does for a
fit, progress is plain lines on stdout, flushed: the levels open, the innermost last, e.g.

    sites 0/8 (agr_gender: das)  elapsed 00:42  eta ?  |  training batches 120/400  elapsed 00:40  eta 01:33

one when a study's progress opens, at most one every `LIT_INTERVENTIONS_PROGRESS_SECONDS`
seconds (default 10; 0: one per update) while it runs, and one when it ends. `off` shows nothing.

A level may go to another stream (`file=sys.stderr`: the GGUF conversion, which runs under
commands whose stdout is their result). Work that runs long without counting (one library call)
is wrapped in `heartbeat(level)`: the level is shown again every interval (its bar refreshed, or
its line printed again), so its elapsed time keeps moving.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

ENV = "LIT_INTERVENTIONS_PROGRESS_SECONDS"
DEFAULT_SECONDS = 10.0
OFF = "off"

_open: ContextVar[tuple[Progress, ...]] = ContextVar("lit_interventions_progress", default=())


def line_seconds() -> float | None:
    """Seconds between two progress lines (`LIT_INTERVENTIONS_PROGRESS_SECONDS`, default 10);
    None when it is `off`. A study reads it before any heavy work: a bad value is one ValueError."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    if raw.lower() == OFF:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{ENV}={raw!r} must be a number of seconds >= 0 (between two progress lines) or {OFF!r}")
    return value


def _clock(seconds: float) -> str:
    return tqdm.format_interval(seconds)


class _Lines:
    """What a study's levels share when stdout is not a terminal: when the last line was printed."""

    def __init__(self, every: float, file=None):
        self.every, self.last, self.shown, self.file = every, -math.inf, None, file

    def print(self, chain: list[Progress], force: bool = False, again: bool = False) -> None:
        """The chain's line, at most once an interval (`force`: now); a line with the counts of
        the last one is skipped unless `again` (a heartbeat: the elapsed time moved)."""
        now = time.monotonic()
        if force or now - self.last >= self.every:
            counts = [(level.desc, level.n, level.total, level.text) for level in chain]
            if again or counts != self.shown:  # a level closing as its last update left it: not shown twice
                print("  |  ".join(level.line(now) for level in chain), file=self.file or sys.stdout, flush=True)
            self.last, self.shown = now, counts


class Progress:
    """A level of progress: `total` units (None: unknown, no ETA), `initial` of them done before it
    opened (resumed work: not counted in the ETA's rate). Open it with `with`; it is then where the
    stages below it nest (`stage`). A `parent` of None makes it a study's outermost level; `file`
    is the stream an outermost level shows on (default stdout; a stage shows on its parent's);
    `note` is what it is on when it opens (as `note()` sets it)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        parent: Progress | None = None,
        file=None,
        note: str = "",
    ):
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.parent, self.text, self.closed = parent, note, False
        self.start = time.monotonic()
        self._bar = self._lines = None
        self.file = parent.file if parent is not None else file or sys.stdout
        every = line_seconds() if parent is None else None
        self.shown = parent.shown if parent is not None else every is not None
        if not self.shown:
            return
        if (parent is None and self.file.isatty()) or (parent is not None and parent._bar is not None):
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                initial=initial,
                leave=parent is None,
                file=self.file,
                dynamic_ncols=True,
                postfix=note or None,
            )
        else:
            self._lines = parent._lines if parent is not None else _Lines(every, self.file)
            if parent is None:
                self._lines.print([self], force=True)

    def __enter__(self) -> Progress:
        _open.set((*_open.get(), self))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chain(self) -> list[Progress]:
        """The levels from the study's outermost one to this one."""
        return ([] if self.parent is None else self.parent.chain()) + [self]

    def line(self, now: float) -> str:
        """This level as text: desc done/total (note)  elapsed  eta."""
        done = self.n - self.initial
        total = "?" if self.total is None else self.total
        left = (now - self.start) / done * (self.total - self.n) if done > 0 and self.total is not None else None
        note = f" ({self.text})" if self.text else ""
        eta = "?" if left is None else _clock(max(left, 0.0))
        return f"{self.desc} {self.n}/{total}{note}  elapsed {_clock(now - self.start)}  eta {eta}"

    def update(self, n: float = 1) -> None:
        """`n` more units done."""
        self.update_to(self.n + n)

    def update_to(self, n: float) -> None:
        """`n` units done in all."""
        if self.closed or n == self.n:
            return
        if self._bar is not None:
            self._bar.update(n - self.n)
        self.n = n
        if self._lines is not None:
            self._lines.print(self.chain())

    def note(self, text: str) -> None:
        """What this level is on (the task, the cell), shown beside its count."""
        self.text = text
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def show(self) -> None:
        """Shows this level now, whatever the interval: its bar refreshed, or its line printed
        (unless the last line showed the same counts and notes). For a step that starts."""
        if self._bar is not None:
            self._bar.refresh()
        elif self._lines is not None:
            self._lines.print(self.chain(), force=True)

    def close(self) -> None:
        """Ends this level (and any stage still open below it); a study's outermost level prints its last line."""
        if self.closed:
            return
        for level in reversed(_open.get()):
            if level.parent is self:
                level.close()
        self.closed = True
        _open.set(tuple(level for level in _open.get() if level is not self))
        if self._bar is not None:
            self._bar.close()
        elif self._lines is not None and self.parent is None:
            self._lines.print([self], force=True)


class _Silent(Progress):
    """What `current` gives outside a study's progress: counts and notes go nowhere, and the stages
    opened in it show nothing."""

    def __init__(self):
        self.total, self.desc, self.unit, self.n, self.initial = None, "", "it", 0, 0
        self.parent, self.text, self.closed, self.shown, self.file = None, "", False, False, sys.stdout
        self.start, self._bar, self._lines = time.monotonic(), None, None

    def update_to(self, n: float) -> None:
        pass

    def note(self, text: str) -> None:
        pass


_SILENT = _Silent()


def current() -> Progress:
    """The innermost progress open (outside a study's progress: one that shows nothing)."""
    levels = _open.get()
    return levels[-1] if levels else _SILENT


HEARTBEAT_MIN_SECONDS = 1.0  # a heartbeat's shortest interval (LIT_INTERVENTIONS_PROGRESS_SECONDS=0 included)


@contextmanager
def heartbeat(level: Progress) -> Iterator[Progress]:
    """Shows `level` (with the levels above it) again every interval while the block runs:
    its bar is refreshed once a second; as lines, the line is printed again every
    `LIT_INTERVENTIONS_PROGRESS_SECONDS` (at least HEARTBEAT_MIN_SECONDS), though no count moved.
    For a step that counts nothing (one library call), so that its elapsed time keeps moving."""
    if not level.shown or (level._bar is None and level._lines is None):
        yield level
        return
    every = HEARTBEAT_MIN_SECONDS if level._bar is not None else max(level._lines.every, HEARTBEAT_MIN_SECONDS)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            if level.closed:
                return
            if level._bar is not None:
                level._bar.refresh()
            elif time.monotonic() - level._lines.last >= every:
                level._lines.print(level.chain(), force=True, again=True)

    thread = threading.Thread(target=beat, name="progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield level
    finally:
        done.set()
        thread.join()


def stage(total: int | None, desc: str, unit: str = "it", initial: int = 0) -> Progress:
    """A stage nested in the innermost progress open (shown as it is shown), to use with `with`;
    outside a study's progress one that shows nothing."""
    return Progress(total, desc, unit, initial, current())


class TokenSteps(BaseStreamer):
    """A `generate` streamer that counts decoding steps in `shown` (a stage of `per_batch` ×
    batches steps): each call's prompt is put first, then each step's tokens; a batch that stops
    early (every row at its end token) counts the steps it skipped when it ends."""

    def __init__(self, shown: Progress, per_batch: int):
        self.shown, self.per_batch, self.steps = shown, per_batch, None

    def put(self, value) -> None:
        if self.steps is None:  # the prompt
            self.steps = 0
            return
        self.steps += 1
        self.shown.update()

    def end(self) -> None:
        self.shown.update(self.per_batch - (self.steps or 0))
        self.steps = None
