"""Stopping a run with SIGTERM (a scheduler, `kill`) or SIGINT (Ctrl+C): one line, a failing exit
status (128 + the signal: 143, 130), and what finished before the signal kept.

Inside `stop_on_signals()`, either signal raises `Stopped` where the run is. It is not an
`Exception`, so no handler of the run's own swallows it; Lightning's loop passes it on after its
teardown (as it does Lightning's own `SIGTERMException`, which ends the block the same way).
Results already written stay: the sweeps' finished rows (a rerun resumes from them) and a fit's
checkpoints. A `Stopped` raised where Python swallows exceptions (a finalizer) is raised again at
the next training or validation batch of a Lightning run (`callbacks.guard.SignalGuard`, which
asks `pending_signal()`), at the next unit of a sweep (`raise_pending()`), and at the latest when
the block ends: a signal never ends in exit status 0. Inside `deferred()` (the results store
writing a unit) a signal waits for the block's end.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PENDING: list[int] = []  # signals received inside `stop_on_signals`, newest last
_DEFERRED: list[None] = []  # one entry per `deferred()` block the run is in


class Stopped(BaseException):
    """A run stopped by signal `signum`; its exit status is 128 + `signum`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def code(self) -> int:
        return 128 + self.signum


def _raise_stopped(signum, frame) -> None:
    _PENDING.append(signum)
    if not _DEFERRED:
        raise Stopped(signum)


def pending_signal() -> int | None:
    """The signal received inside `stop_on_signals`, if any (None: none)."""
    return _PENDING[-1] if _PENDING else None


def raise_pending() -> None:
    """Raise `Stopped` again if a signal was received (and its first `Stopped` swallowed): a loop
    calls it between its units of work."""
    if _PENDING:
        raise Stopped(_PENDING[-1])


def consume_pending() -> int | None:
    """The signal received, taken as handled (a server's normal stop): the block then ends as
    its code ends, without the stop line and exit status. None: no signal was received."""
    signum = pending_signal()
    _PENDING.clear()
    return signum


@contextmanager
def deferred() -> Iterator[None]:
    """A block that ends whole: a signal received inside it is raised (`Stopped`) when it ends,
    not where it is (a unit's rows stored and their CSV exported: both or neither)."""
    _DEFERRED.append(None)
    try:
        yield
    finally:
        _DEFERRED.pop()
    if not _DEFERRED:
        raise_pending()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Stopped` inside the block; the block then ends the process with
    one line on stderr and exit status 128 + the signal. Only the main thread can take signals:
    elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.signal(signum, _raise_stopped)
    try:
        yield
        raise_pending()  # received, but its `Stopped` swallowed where it was raised
    except Stopped as stop:
        _exit(stop.signum)
    except SystemExit as done:
        if _is_lightning_sigterm(done):
            _exit(signal.SIGTERM)
        raise
    finally:
        _PENDING.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _is_lightning_sigterm(done: SystemExit) -> bool:
    """Whether `done` is Lightning's `SIGTERMException` (looked up only if Lightning is loaded, so
    that a command without Lightning does not import it)."""
    exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")
    sigterm = getattr(exceptions, "SIGTERMException", None)
    return sigterm is not None and isinstance(done, sigterm)


def _exit(signum: int) -> None:
    for other in SIGNALS:  # a second signal while the line is written would end with a traceback
        signal.signal(other, signal.SIG_IGN)
    name = signal.Signals(signum).name
    print(f"stopped by {name}: what finished before it is kept (results written so far, checkpoints)", file=sys.stderr)
    raise SystemExit(128 + signum) from None
