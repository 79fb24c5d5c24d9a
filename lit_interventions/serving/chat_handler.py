"""The judge server's routes: GET /v1/models and POST /v1/chat/completions (also without /v1, and
with a trailing slash), replying in the OpenAI shapes. A chat request holds one of `max_concurrent`
slots while its body is read and its reply generated (in a worker thread: the event loop keeps
serving). The server around them: `judge_server.make_server`."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lit_interventions.serving.chat_request import validate_request
from lit_interventions.serving.json_api import error_response, read_json, slot

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
MODEL_PATHS = ("/v1/models", "/models")


def completion(model: str, reply: str, n_prompt: int, n_reply: int, finish: str) -> dict:
    """The `chat.completion` reply body: one choice, with the token counts in `usage`."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_reply,
            "total_tokens": n_prompt + n_reply,
        },
    }


def chat_routes(chat, max_body_bytes: int = 1 << 20, timeout: float = 30.0, max_concurrent: int = 4) -> list[Route]:
    """The routes serving `chat` (an object with `name`, `max_new_tokens` and
    `complete(messages, max_tokens)`). `timeout` (seconds) bounds the wait for a slot (then 503,
    Retry-After: 1) and the body's arrival (then 408); a body over `max_body_bytes` is 413."""
    slots = asyncio.Semaphore(max_concurrent)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": chat.name, "object": "model", "owned_by": "local"}]})

    async def chat_completions(request: Request) -> JSONResponse:
        async with slot(slots, timeout):  # bodies are read and generations run in a slot
            request_body = await read_json(request, max_body_bytes, timeout)
            messages, limit, model = validate_request(request_body, chat.max_new_tokens)
            try:
                reply, n_prompt, n_reply, finish = await run_in_threadpool(chat.complete, messages, limit)
            except Exception as err:  # noqa: BLE001 - the client gets a reply, not a dropped connection
                return error_response(500, f"generation failed: {type(err).__name__}: {str(err)[:300]}")
        return JSONResponse(completion(model or chat.name, reply, n_prompt, n_reply, finish))

    return [Route(path, models, methods=["GET"]) for p in MODEL_PATHS for path in (p, p + "/")] + [
        Route(path, chat_completions, methods=["POST"]) for p in CHAT_PATHS for path in (p, p + "/")
    ]
