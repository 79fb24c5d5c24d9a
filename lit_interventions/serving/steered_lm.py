"""The served model: a frozen LM, the artifacts applied to it, and the batcher that owns it.

`SteeredLM` turns a request into prompt token ids (a chat through the tokenizer's chat template,
or "Role: content" lines ending in "Assistant:" when it has none; a text completion's prompt
after the BOS, as `encode_text` reads it), checks its steering against the artifacts (the same
`edits` call `apply` makes, so a concept no artifact holds is refused before it is queued), and
queues it. The worker runs each batch as one `generate` inside `apply`, with the concept, factor,
gate and on/off switch of each row. A gate (`inference.gate`) is checked in the request's thread;
the eval split's thresholds (`gate: true`) are computed once, by the worker that owns the LM (at
start with `gate=True`), and kept.

Clients see each artifact by its name (`public_name`: a local directory's or file's own name, a
hub id as given), never by its path: in /v1/models and in every error about their steering. A
request that names no concept, when the server has no default (`--concept`) and an artifact needs
one (a dictionary of several concepts), is answered with no concept: by the LM unedited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import StoppingCriteriaList

from lit_interventions.core.lm import check_device, load_lm, load_tokenizer
from lit_interventions.core.positions import encode_text
from lit_interventions.inference.apply import LoadedArtifact, apply, load_artifact, request_for
from lit_interventions.inference.gate import check_gate, gate_edits
from lit_interventions.serving.batcher import Batcher, Job, RowsDone, RowStreamer
from lit_interventions.serving.chat_request import chat_text, is_int
from lit_interventions.serving.completion_request import Options, Steering
from lit_interventions.serving.json_api import BadRequest
from lit_interventions.serving.reply_stream import Reply
from lit_interventions.serving.server_options import public_name


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))


class SteeredLM:
    """An LM with `artifacts` applied, generating for queued requests in batches.

    artifacts: directories, hub ids or loaded artifacts (`load_artifact`), applied together.
    lm: a model name (what `load_lm` takes; default: the first artifact's model), loaded with
        `dtype` onto `device`, or a loaded model (then `tokenizer` is required).
    concept, factor, gate: the steering of requests that do not name their own (gate: None, True
        or a threshold, `inference.gate`; True computes the eval split's thresholds here).
    max_batch, batch_wait_ms: the batcher's (`batcher.Batcher`).
    name: the model's id for clients (default: the LM's `public_name`); `lm_name` names what is loaded (a path or an id).
    """

    def __init__(
        self,
        artifacts: Any,
        lm: str | nn.Module | None = None,
        *,
        tokenizer=None,
        max_new_tokens: int = 256,
        dtype: str = "float32",
        device: str = "cpu",
        concept: str | int | None = None,
        factor: float = 1.0,
        gate: bool | float | str | None = None,
        max_batch: int = 8,
        batch_wait_ms: float = 10.0,
        name: str | None = None,
        trust_remote_code: bool = False,
    ):
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        check_device(device)
        items = list(artifacts) if isinstance(artifacts, (list, tuple)) else [artifacts]
        if not items:
            raise ValueError("artifacts is empty: give at least one artifact")
        self.artifacts = [load_artifact(item, trust_remote_code=trust_remote_code) for item in items]
        # the same artifacts, named for clients: used for requests (their errors go to clients)
        self.served = [LoadedArtifact(a.obj, a.config, public_name(a.where)) for a in self.artifacts]
        if isinstance(lm, nn.Module):
            if tokenizer is None:
                raise ValueError("a loaded lm needs its tokenizer (tokenizer=...)")
            self.model, self.tokenizer = lm, tokenizer
            self.lm_name = getattr(lm.config, "_name_or_path", "") or type(lm).__name__
        else:
            lm = lm or self.artifacts[0].model
            if not lm:
                raise ValueError(f"{self.artifacts[0].where} records no model; give lm=NAME")
            self.model, self.tokenizer = load_lm(lm, dtype).to(device), tokenizer or load_tokenizer(lm)
            self.lm_name = str(lm)
        self.name = name or public_name(self.lm_name)
        self.max_new_tokens, self.concept, self.factor = max_new_tokens, concept, factor
        self.gate = check_gate(gate, self.served)
        self.needs_concept = self._fits(concept, factor)
        if self.gate is True:  # the eval split's thresholds, before the worker owns the LM
            self._edits(concept if not self.needs_concept else 0, factor, self.served, gate=True)
        self.eos = _eos_ids(self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.batcher = Batcher(self.generate, max_batch, batch_wait_ms / 1000)

    @property
    def concepts(self) -> list[str]:
        """The concept names the artifacts hold."""
        return [name for artifact in self.artifacts for name in artifact.concepts or []]

    def _edits(self, concept: str | int | None, factor: float, artifacts: Sequence[LoadedArtifact], gate=None) -> None:
        """The edits `apply` would make for (concept, factor, gate), built and dropped: a
        ValueError when an artifact refuses them (another LM, an unknown concept, ...)."""
        request = request_for(self.model, tokenizer=self.tokenizer, concept=concept, factor=factor)
        for artifact in artifacts:
            gate_edits(artifact, artifact.edits(request), request, gate, artifact.gate_cache)

    def _fits(self, concept: str | int | None, factor: float) -> bool:
        """Whether requests naming no concept need one; a ValueError naming what does not fit
        when the artifacts do not fit the LM or the default steering. Without a default concept,
        concept 0 stands in for the ones requests will name."""
        try:
            self._edits(concept, factor, self.artifacts)
        except ValueError:
            if concept is not None:
                raise
            self._edits(0, factor, self.artifacts)
            return True
        return False

    def check(self, steering: Steering) -> Steering:
        """`steering` when every artifact accepts it (switched off when it names no concept and
        the artifacts need one: see the module doc); else a BadRequest on field "concept" naming
        the concept and the valid ones, and the artifacts by their names."""
        if steering.enabled and steering.concept is None and self.needs_concept:
            return replace(steering, enabled=False)
        if steering.enabled:
            try:
                self._edits(steering.concept, steering.factor, self.served)
            except ValueError as err:
                raise BadRequest("concept", str(err).splitlines()[0]) from None
            try:
                check_gate(steering.gate, self.served)
            except ValueError as err:
                raise BadRequest("gate", str(err).splitlines()[0]) from None
        return steering

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt token ids of a chat."""
        text, templated = chat_text(self.tokenizer, messages)
        return encode_text(self.tokenizer, text, templated)["input_ids"][0].tolist()

    def text_ids(self, prompt: str) -> list[int]:
        """The prompt token ids of a text completion (after the BOS)."""
        return encode_text(self.tokenizer, prompt)["input_ids"][0].tolist()

    def submit(self, ids: Sequence[int], options: Options, emit: Callable[[tuple], None]) -> Job:
        """Queue a request; its reply's events go to `emit` (from the worker thread). A prompt
        longer than the LM's context loses its start, keeping room for the reply."""
        limit = min(options.limit, self.max_new_tokens)
        room = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        ids = list(ids)[-max(1, room - limit) :] if room else list(ids)
        reply = Reply(self._decode, limit, self.eos, options.stop, emit)
        job = Job(ids, options.sampling, options.steering, reply)
        self.batcher.submit(job)
        return job

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def steering(self, jobs: Sequence[Job]):
        """`apply` with each row's concept, factor, gate and on/off switch (nothing when all are
        off). Rows switched off take an enabled row's concept, which they do not use."""
        rows = [job.steering for job in jobs]
        on = [s for s in rows if s.enabled]
        if not on:
            return nullcontext()
        concepts = [s.concept if s.enabled else on[0].concept for s in rows]
        if len(set(concepts)) > 1:  # one per row: None (an artifact's only concept) is its index 0
            concept = [0 if c is None else c for c in concepts]
        else:
            concept = concepts[0]
        return apply(
            self.model,
            self.served,
            tokenizer=self.tokenizer,
            concept=concept,
            factor=[s.factor if s.enabled else 0.0 for s in rows],
            enabled=None if len(on) == len(rows) else [s.enabled for s in rows],
            gate=[s.gate if s.enabled else None for s in rows],
        )

    @torch.no_grad()
    def generate(self, jobs: list[Job]) -> None:
        """One `generate` for `jobs`: their prompts padded on the left, each row's tokens streamed
        to its reply, stopping once every row has ended."""
        width = max(len(job.ids) for job in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, job in enumerate(jobs):
            ids[row, width - len(job.ids) :] = torch.tensor(job.ids, dtype=torch.long)
            mask[row, width - len(job.ids) :] = 1
        replies = [job.reply for job in jobs]
        with self.steering(jobs):
            self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                max_new_tokens=max(job.limit for job in jobs),
                pad_token_id=self.pad_id,
                streamer=RowStreamer(replies),
                stopping_criteria=StoppingCriteriaList([RowsDone(replies, width)]),
                **jobs[0].sampling.generate_kwargs(),
            )

    def cancel(self, job: Job) -> None:
        """The client of `job` left: drop it (`Batcher.cancel`)."""
        self.batcher.cancel(job)

    def stop(self) -> None:
        """Take no more requests; the queued and running ones end with a 503 (`Batcher.stop`)."""
        self.batcher.stop()

    def close(self) -> None:
        """`stop`, and wait for the worker to end."""
        self.batcher.close()
