"""The JSON side shared by the servers' Starlette apps: errors in the OpenAI shape
({"error": {message, type, param}}), a bounded body read, bounded request slots, and `json_app`,
a Starlette app whose unknown paths and failures answer in that shape. An app adds its routes with
`json_app(routes)` (or `app.add_route`); `http_server.HTTPServer` serves it."""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from lit_interventions.serving.http_server import error_payload

__all__ = [
    "MAX_NESTING",
    "BadRequest",
    "Busy",
    "error_response",
    "json_app",
    "nesting",
    "read_body",
    "read_json",
    "slot",
]

MAX_NESTING = 64  # lists and objects inside each other in a request body; no OpenAI request needs more


class BadRequest(ValueError):
    """A request field of the wrong type or out of range: `field` names it; `status` is the reply's."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


class Busy(Exception):
    """No request slot freed up in time, or the server is stopping: a 503 with Retry-After."""

    def __init__(self, message: str = "the server is busy; retry later"):
        super().__init__(message)


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error reply."""
    return JSONResponse(error_payload(status, message, field), status_code=status, headers=headers)


async def _collect(request: Request) -> bytes:
    chunks = []
    async for chunk in request.stream():
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The body, Content-Length bytes of it: 411 without the header (chunked bodies too), 413 over
    `max_bytes` (not read), 408 when it does not arrive within `timeout` seconds in all, 400 when
    the client leaves before sending it all."""
    length = request.headers.get("content-length")
    if length is None:
        raise BadRequest("Content-Length", "header is required", status=411)
    if not length.strip().isdigit():
        raise BadRequest("Content-Length", f"must be a non-negative integer, got {length[:40]!r}")
    size = int(length)
    if size > max_bytes:
        raise BadRequest("body", f"is {size} bytes; at most {max_bytes}", status=413)
    try:
        return await asyncio.wait_for(_collect(request), timeout)
    except asyncio.TimeoutError as err:
        raise BadRequest("body", f"not received within {timeout:g} s (Content-Length {size})", status=408) from err
    except ClientDisconnect as err:
        raise BadRequest("body", f"the client left before its {size} bytes arrived") from err


def nesting(value) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar: 0), counted without
    recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


async def read_json(request: Request, max_bytes: int, timeout: float):
    """The body (`read_body`) parsed as JSON; a BadRequest on field "body" when it is not JSON or
    nests lists and objects deeper than MAX_NESTING."""
    body = await read_body(request, max_bytes, timeout)
    too_deep = BadRequest("body", f"nests lists and objects more than {MAX_NESTING} deep")
    try:
        parsed = json.loads(body)
    except RecursionError:  # deeper than the parser goes
        raise too_deep from None
    except (UnicodeDecodeError, ValueError) as err:
        raise BadRequest("body", f"is not valid JSON ({err})") from err
    if nesting(parsed) > MAX_NESTING:
        raise too_deep
    return parsed


@contextlib.asynccontextmanager
async def slot(slots: asyncio.Semaphore, timeout: float):
    """Hold one of `slots` for the block; `Busy` when none frees up within `timeout` seconds."""
    try:
        await asyncio.wait_for(slots.acquire(), timeout)
    except asyncio.TimeoutError as err:
        raise Busy from err
    try:
        yield
    finally:
        slots.release()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return error_response(404, f"unknown path {request.url.path}", headers={"Connection": "close"})
    return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", headers=exc.headers)


async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
    return error_response(exc.status, f"bad request: {exc}", exc.field, headers={"Connection": "close"})


async def _busy(request: Request, exc: Busy) -> JSONResponse:
    return error_response(503, str(exc), headers={"Retry-After": "1", "Connection": "close"})


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"server error: {type(exc).__name__}: {str(exc)[:300]}")


def json_app(routes) -> Starlette:
    """A Starlette app of `routes`; BadRequest, Busy, unknown paths (404), wrong methods (405) and
    uncaught errors (500) are JSON error replies. Bad requests, 404 and 503 close the connection."""
    return Starlette(
        routes=list(routes),
        exception_handlers={
            HTTPException: _http_error,
            BadRequest: _bad_request,
            Busy: _busy,
            Exception: _server_error,
        },
    )
