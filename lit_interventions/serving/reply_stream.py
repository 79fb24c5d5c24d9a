"""One request's reply, built token by token as `generate` hands them over: the text so far, when
it ends (its own EOS, its token limit, a `stop` string, or the client leaving) and the pieces of
text ready to send.

A piece is sent once it cannot change: a trailing incomplete UTF-8 character ("\\ufffd" in the
decoded text) waits for its next token, and a tail that could still grow into a `stop` string
waits until it does not. The text is the decoded tokens (special tokens skipped), cut before the
first `stop` string; the EOS token ends the reply and is counted, not shown.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

EVENT_TEXT, EVENT_DONE, EVENT_ERROR = "text", "done", "error"


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` to hold: an unfinished UTF-8 character, or the
    longest tail that begins one of `stops`."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class Reply:
    """The reply of one batch row. `emit(event)` is called with (EVENT_TEXT, piece), then
    (EVENT_DONE, finish_reason) or (EVENT_ERROR, message), from the generating thread.

    `cancelled` (an event any thread sets) ends the row at its next token: the client left, or the
    server is stopping (then `stopping` holds the message its error reply carries). `status` is
    the HTTP status of an error reply: 500, or 503 when the server stopped it."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        limit: int,
        eos: Sequence[int] = (),
        stops: Sequence[str] = (),
        emit: Callable[[tuple], None] = lambda event: None,
    ):
        self.decode, self.limit, self.eos, self.stops, self.emit = decode, limit, set(eos), tuple(stops), emit
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` emitted
        self.finish: str | None = None  # "stop" or "length" once it has ended
        self.error: str | None = None
        self.status = 500
        self.cancelled = threading.Event()
        self.stopping: str | None = None

    @property
    def done(self) -> bool:
        """Whether the row needs no more tokens."""
        return self.finish is not None or self.error is not None or self.cancelled.is_set()

    def push(self, token: int) -> None:
        """The row's next token (ignored once it has ended)."""
        if self.done:
            return
        self.tokens.append(token)
        if token in self.eos:
            return self.end("stop")
        text = self.decode(self.tokens)
        cut = self._stop_at(text)
        if cut is not None:
            self.text = text[:cut]
            return self.end("stop")
        self.text = text
        if len(self.tokens) >= self.limit:
            return self.end("length")
        ready = len(text) - held_back(text, self.stops)
        if ready > self.sent:
            self.emit((EVENT_TEXT, text[self.sent : ready]))
            self.sent = ready

    def _stop_at(self, text: str) -> int | None:
        """Where the first `stop` string begins in `text`, if one does."""
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [at for at in (text.find(stop, start) for stop in self.stops) if at != -1]
        return min(found) if found else None

    def end(self, finish: str) -> None:
        """End the reply: send what is held back, then `finish` (no-op once ended); a row the
        server stopped (`stop`) ends with its error instead."""
        if self.stopping is not None:
            return self.fail(self.stopping, 503)
        if self.finish is not None or self.error is not None:
            return
        self.finish = finish
        if len(self.text) > self.sent:
            self.emit((EVENT_TEXT, self.text[self.sent :]))
            self.sent = len(self.text)
        self.emit((EVENT_DONE, finish))

    def fail(self, message: str, status: int = 500) -> None:
        """End the reply with an error, answered with HTTP `status` (no-op once ended)."""
        if self.finish is None and self.error is None:
            self.error, self.status = message, status
            self.emit((EVENT_ERROR, message))

    def stop(self, message: str) -> None:
        """Cancel the row because the server stops: the generating thread ends it with `message`
        (status 503) once its `generate` returns."""
        self.stopping = message
        self.cancelled.set()
