"""The chat requests the servers accept: each field of an OpenAI `/chat/completions` body
checked for type and range (`validate_request`), a bad one raised as `BadRequest` naming it; and
the text an LM reads for a chat's messages (`chat_text`)."""

from __future__ import annotations

import math

from lit_interventions.serving.json_api import BadRequest

ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 256


def is_int(value) -> bool:
    """An int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _content(value, field: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": str} parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = []
        for k, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{field}[{k}]", 'must be {"type": "text", "text": "..."} (only text is supported)')
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(field, f"must be a string (or a list of text parts), got {type(value).__name__}")


def validate_request(request, max_new_tokens: int, allow_stream: bool = False) -> tuple[list[dict], int, str | None]:
    """(messages as {role, content: str}, max tokens to generate, model name) of a chat request;
    BadRequest naming the first bad field. Fields the server does not use are ignored, but the
    known ones must have their OpenAI type and range (`check_options`)."""
    if not isinstance(request, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(request).__name__}")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest("messages", f"has {len(messages)} entries; at most {MAX_MESSAGES}")
    clean = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{k}]", f"must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{k}].role", f"must be one of {', '.join(ROLES)}, got {role!r}"[:200])
        if "content" not in message:
            raise BadRequest(f"messages[{k}].content", "is missing")
        clean.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(message["content"], f"messages[{k}].content"),
            }
        )
    limit, model = check_options(request, max_new_tokens, allow_stream)
    return clean, limit, model


def check_options(request: dict, max_new_tokens: int, allow_stream: bool = False) -> tuple[int, str | None]:
    """(max tokens to generate, model name) of a completion request's options other than its
    prompt; BadRequest naming the first bad field. `stream: true` is refused unless
    `allow_stream`."""
    limit = max_new_tokens
    for field in ("max_tokens", "max_completion_tokens"):
        value = request.get(field)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise BadRequest(field, f"must be an integer >= 1, got {value!r}"[:200])
        limit = min(limit, value)
    for field, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("frequency_penalty", -2.0, 2.0),
        ("presence_penalty", -2.0, 2.0),
    ):
        value = request.get(field)
        if value is not None and not (is_number(value) and low <= value <= high):
            raise BadRequest(field, f"must be a number in [{low:g}, {high:g}], got {value!r}"[:200])
    if request.get("n") is not None and request.get("n") != 1:
        raise BadRequest("n", f"only n=1 is supported, got {request.get('n')!r}"[:200])
    stream = request.get("stream")
    if not allow_stream and stream not in (None, False):
        raise BadRequest("stream", "streaming is not supported; send stream: false")
    if allow_stream and stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", f"must be true or false, got {stream!r}"[:200])
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"must be a string, got {type(model).__name__}")
    stop = request.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise BadRequest("stop", "must be a string or a list of strings")
    return limit, model


def chat_text(tokenizer, messages: list[dict]) -> tuple[str, bool]:
    """(the text the LM reads for `messages`, whether the chat template wrote it)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:", False
