"""The requests the steered server accepts, beyond the judge server's chat checks: the prompt of
a `/completions` body, and the options both endpoints share (`request_options`): sampling,
`stop`, streaming, and the steering fields `concept`, `factor`, `gate` and `steering`. A bad
field is a `BadRequest` naming it."""

from __future__ import annotations

from dataclasses import dataclass

from lit_interventions.serving.chat_request import check_options, is_int, is_number
from lit_interventions.serving.json_api import BadRequest

MAX_STOPS = 4
MAX_CONCEPT_CHARS = 200


@dataclass(frozen=True)
class Sampling:
    """How tokens are picked: greedy (`do_sample` False), or sampled at `temperature` within
    `top_p`. Requests with equal settings share a batch."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def generate_kwargs(self) -> dict:
        """The settings as `generate` takes them."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


@dataclass(frozen=True)
class Steering:
    """What one request asks of the artifacts: `concept` (a name, an index or None: the
    server's default), `factor`, `enabled` (False: the LM unedited) and `gate` (None: the edit
    at every token; True: τ per concept from the eval split; a number τ: the edit only where the
    concept's latent > τ, `inference.gate`)."""

    concept: str | int | None = None
    factor: float = 1.0
    enabled: bool = True
    gate: bool | float | None = None


@dataclass(frozen=True)
class Options:
    """A completion request's options other than its prompt."""

    limit: int
    model: str | None
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    steering: Steering


def completion_prompt(request) -> str:
    """The `prompt` of a `/completions` body: a string, or a list holding one string."""
    if not isinstance(request, dict):
        raise BadRequest("body", f"must be a JSON object, got {type(request).__name__}")
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt", "must be a string (or a list of one string); token ids are not accepted")
    if not prompt:
        raise BadRequest("prompt", "is empty")
    return prompt


def sampling_of(request: dict) -> Sampling:
    """Greedy unless `temperature` > 0 is given; then sampled with `top_p` (default 1)."""
    temperature = request.get("temperature")
    if temperature is None or temperature == 0:
        return Sampling()
    top_p = request.get("top_p")
    if top_p == 0:
        raise BadRequest("top_p", "must be > 0 when sampling (temperature > 0)")
    return Sampling(True, float(temperature), 1.0 if top_p is None else float(top_p))


def stops_of(request: dict) -> tuple[str, ...]:
    """The `stop` strings (checked as strings by `check_options`): at most MAX_STOPS, none empty."""
    stop = request.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOPS:
        raise BadRequest("stop", f"has {len(stops)} strings; at most {MAX_STOPS}")
    if any(not s for s in stops):
        raise BadRequest("stop", "holds an empty string")
    return stops


def steering_of(
    request: dict, default_concept: str | int | None, default_factor: float, default_gate: bool | float | None = None
) -> Steering:
    """`concept` (a name or an index >= 0), `factor` (a finite number), `gate` (true, false, null
    or a finite number) and `steering` (a bool), each defaulting to the server's. Whether the
    artifacts hold the concept, and can be gated, is the server's check."""
    concept = request.get("concept", default_concept)
    if concept is None:
        pass
    elif isinstance(concept, str):
        if not concept or len(concept) > MAX_CONCEPT_CHARS:
            raise BadRequest("concept", f"must be a concept name of 1 to {MAX_CONCEPT_CHARS} characters")
    elif not is_int(concept) or concept < 0:
        raise BadRequest("concept", f"must be a concept name or an index >= 0, got {concept!r}"[:200])
    factor = request.get("factor", default_factor)
    if not is_number(factor):
        raise BadRequest("factor", f"must be a finite number, got {factor!r}"[:200])
    enabled = request.get("steering", True)
    if not isinstance(enabled, bool):
        raise BadRequest("steering", f"must be true or false, got {enabled!r}"[:200])
    gate = request.get("gate", default_gate)
    if not (gate is None or isinstance(gate, bool) or is_number(gate)):
        raise BadRequest("gate", f"must be true, false, null or a finite threshold, got {gate!r}"[:200])
    gate = None if gate is False else gate if gate is None or gate is True else float(gate)
    return Steering(concept, float(factor), enabled, gate)


def _refuse_unsupported(request: dict) -> None:
    """Options this server does not implement, when set to other than their defaults."""
    if request.get("logprobs") not in (None, False):
        raise BadRequest("logprobs", "log probabilities are not returned; leave logprobs unset")
    if request.get("echo") not in (None, False):
        raise BadRequest("echo", "echo is not supported; leave it unset")
    if request.get("suffix") is not None:
        raise BadRequest("suffix", "suffix is not supported; leave it unset")
    if request.get("best_of") not in (None, 1):
        raise BadRequest("best_of", f"only best_of=1 is supported, got {request.get('best_of')!r}"[:200])


def request_options(
    request: dict,
    max_new_tokens: int,
    default_concept: str | int | None = None,
    default_factor: float = 1.0,
    default_gate: bool | float | None = None,
) -> Options:
    """The options of a chat or text completion body (a dict), each checked."""
    limit, model = check_options(request, max_new_tokens, allow_stream=True)
    _refuse_unsupported(request)
    stream = bool(request.get("stream"))
    stream_options = request.get("stream_options")
    if stream_options is not None and not (
        isinstance(stream_options, dict) and isinstance(stream_options.get("include_usage", False), bool)
    ):
        raise BadRequest("stream_options", 'must be {"include_usage": true|false}')
    include_usage = bool(stream and stream_options and stream_options.get("include_usage"))
    return Options(
        limit=limit,
        model=model,
        sampling=sampling_of(request),
        stop=stops_of(request),
        stream=stream,
        include_usage=include_usage,
        steering=steering_of(request, default_concept, default_factor, default_gate),
    )
