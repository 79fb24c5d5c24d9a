"""The steered server's routes: GET /v1/models, POST /v1/chat/completions and POST
/v1/completions (also without /v1, and with a trailing slash), in the OpenAI shapes.

A request holds one of `max_concurrent` slots from its body's arrival to its reply's end (a
streamed reply: to its last event). Its fields are checked (`validate_request`,
`request_options`), its steering against the artifacts (`SteeredLM.check`), then it is queued
for the batcher. The reply is one JSON body with `usage`, or with `stream: true` server-sent
events: `chat.completion.chunk`s with a `delta` (the first carries the role), or
`text_completion` chunks, one per piece of text, then one with the `finish_reason`, a usage chunk
when `stream_options.include_usage` asks, and `data: [DONE]`.

A client that leaves is noticed at once, streamed or not (ASGI's `http.disconnect`, which
uvicorn sends when the connection closes): its job leaves the queue or its row ends at the next
token, and its slot is free. Once the server stops (`stopping` set), a request waiting for a slot
or for its body gets 503, and the ones queued or generating end with 503 (`SteeredLM.stop`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lit_interventions.serving.batcher import SHUTTING_DOWN
from lit_interventions.serving.chat_handler import MODEL_PATHS, completion
from lit_interventions.serving.chat_request import validate_request
from lit_interventions.serving.completion_request import completion_prompt, request_options
from lit_interventions.serving.http_server import error_payload
from lit_interventions.serving.json_api import Busy, error_response, read_json
from lit_interventions.serving.reply_stream import EVENT_DONE, EVENT_ERROR, EVENT_TEXT

CHAT, TEXT = "chat", "text"
PATHS = {CHAT: ("/v1/chat/completions", "/chat/completions"), TEXT: ("/v1/completions", "/completions")}


def usage(n_prompt: int, n_reply: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply}


def text_completion(model: str, text: str, n_prompt: int, n_reply: int, finish: str) -> dict:
    """The `text_completion` reply body: one choice, with the token counts in `usage`."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": usage(n_prompt, n_reply),
    }


class Chunks:
    """The streamed chunks of one reply (`kind`: CHAT or TEXT), sharing an id."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        self.created = int(time.time())

    def _chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def piece(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        """A chunk with a piece of text (or none) and the finish reason (None until the last)."""
        if self.kind == TEXT:
            return self._chunk([{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}])
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    def usage(self, n_prompt: int, n_reply: int) -> dict:
        return {**self._chunk([]), "usage": usage(n_prompt, n_reply)}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def event_queue() -> tuple[asyncio.Queue, Callable[[tuple], None]]:
    """(a queue on this event loop, a function any thread calls to put an event on it)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody waits for the event
            pass

    return queue, emit


async def _left(request: Request) -> None:
    """Return once the client has disconnected (called after its body is read: the next ASGI
    message is `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(awaitable, other, timeout: float | None = None):
    """(True, the result of `awaitable`) if it ends first, else (False, None) once `other` ends
    or `timeout` seconds pass; the one still running is cancelled."""
    mine, theirs = asyncio.ensure_future(awaitable), asyncio.ensure_future(other)
    try:
        await asyncio.wait((mine, theirs), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        theirs.cancel()
        if not mine.done():
            mine.cancel()
    return (True, mine.result()) if mine.done() and not mine.cancelled() else (False, None)


async def _end(events: asyncio.Queue) -> str | None:
    """Wait for the reply to end: None, or the error message."""
    while True:
        kind, value = await events.get()
        if kind == EVENT_DONE:
            return None
        if kind == EVENT_ERROR:
            return value


async def _stream(job, events: asyncio.Queue, chunks: Chunks, include_usage: bool, finish):
    """The reply's server-sent events; `finish` (release the slot, stop the row) runs when they
    end or the client leaves."""
    try:
        if chunks.kind == CHAT:
            yield sse(chunks.piece(role=True))
        while True:
            kind, value = await events.get()
            if kind == EVENT_TEXT:
                yield sse(chunks.piece(value))
                continue
            if kind == EVENT_ERROR:
                yield sse(error_payload(job.reply.status, value))
            else:
                yield sse(chunks.piece(finish=value))
                if include_usage:
                    yield sse(chunks.usage(len(job.ids), len(job.reply.tokens)))
            break
        yield sse("[DONE]")
    finally:
        finish()


async def _prepare(steered, kind: str, body):
    """(prompt token ids, options) of a request body, every field checked; the steering is the
    one `SteeredLM.check` gives."""
    if kind == CHAT:
        messages, _, _ = validate_request(body, steered.max_new_tokens, allow_stream=True)
        tokenize = partial(steered.chat_ids, messages)
    else:
        tokenize = partial(steered.text_ids, completion_prompt(body))
    options = request_options(body, steered.max_new_tokens, steered.concept, steered.factor, steered.gate)
    options = replace(options, steering=await run_in_threadpool(steered.check, options.steering))
    return await run_in_threadpool(tokenize), options


def _once(fn):
    done = []

    def call():
        if not done:
            done.append(True)
            fn()

    return call


def steered_routes(
    steered,
    max_body_bytes: int = 1 << 20,
    timeout: float = 30.0,
    max_concurrent: int = 16,
    stopping: asyncio.Event | None = None,
):
    """The routes serving `steered` (a `SteeredLM`). `timeout` (seconds) bounds the wait for a
    slot (then 503, Retry-After: 1) and the body's arrival (then 408); a body over
    `max_body_bytes` is 413. `stopping`: set when the server stops (see the module doc)."""
    slots = asyncio.Semaphore(max_concurrent)
    stopping = stopping or asyncio.Event()

    async def models(request: Request) -> JSONResponse:
        card = {"id": steered.name, "object": "model", "owned_by": "local"}
        card |= {"artifacts": [a.where for a in steered.served], "concepts": steered.concepts}
        return JSONResponse({"object": "list", "data": [card]})

    async def complete(request: Request, kind: str):
        got, _ = await _first(slots.acquire(), stopping.wait(), timeout)
        if not got:
            raise Busy(SHUTTING_DOWN if stopping.is_set() else "the server is busy; retry later")
        release, streaming = _once(slots.release), False
        try:
            got, body = await _first(read_json(request, max_body_bytes, timeout), stopping.wait())
            if not got:
                raise Busy(SHUTTING_DOWN)
            ids, options = await _prepare(steered, kind, body)
            events, emit = event_queue()
            job = steered.submit(ids, options, emit)
            model = options.model or steered.name
            if options.stream:  # a stream cancelled before its first event still finishes (background)
                finish = _once(lambda: (steered.cancel(job), release()))
                stream = _stream(job, events, Chunks(kind, model), options.include_usage, finish)
                headers = {"Cache-Control": "no-cache"}
                response = StreamingResponse(stream, media_type="text/event-stream", headers=headers)
                response.background, streaming = BackgroundTask(finish), True
                return response
            try:
                ended, error = await _first(_end(events), _left(request))
            finally:
                steered.cancel(job)  # the client left (or the row has ended: then a no-op)
            if not ended:
                return Response(status_code=499)  # nobody reads it
            if error is not None:
                return error_response(job.reply.status, error)
            shape = completion if kind == CHAT else text_completion
            reply = job.reply
            return JSONResponse(shape(model, reply.text, len(job.ids), len(reply.tokens), reply.finish))
        finally:
            if not streaming:
                release()

    async def chat_completions(request: Request):
        return await complete(request, CHAT)

    async def completions(request: Request):
        return await complete(request, TEXT)

    routes = [Route(path, models, methods=["GET"]) for p in MODEL_PATHS for path in (p, p + "/")]
    routes += [Route(path, chat_completions, methods=["POST"]) for p in PATHS[CHAT] for path in (p, p + "/")]
    return routes + [Route(path, completions, methods=["POST"]) for p in PATHS[TEXT] for path in (p, p + "/")]
