"""The steering evaluation's checks, all made before any generation: the settings that need no
file, the LM to steer (it must match the artifacts), the cells (concepts per artifact) and a judge
that answers. The evaluation itself: `lit_interventions/studies/steer_eval.py`."""

from __future__ import annotations

from collections import Counter

from lit_interventions.core.lm import hidden_size, load_config
from lit_interventions.inference.apply import LoadedArtifact
from lit_interventions.metrics.judge import Judge, make_judge
from lit_interventions.studies.steer_sources import artifact_concepts, pick_concepts

FACTORS = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0]  # AxBench's steering factors


def artifact_paths(artifact, dictionary, checkpoint) -> list[str]:
    """The artifacts to steer with, a list: --artifact, or its spellings --dictionary and
    --checkpoint (exactly one of the three; each one path or a list)."""
    given = [value for value in (artifact, dictionary, checkpoint) if value is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --artifact, --dictionary or --checkpoint (a path or hub id, or a list)")
    paths = [given[0]] if isinstance(given[0], str) else list(given[0])
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"--artifact={given[0]!r} must be a path or hub id, or a non-empty list of them")
    return paths


def check_settings(factors, instructions, max_new_tokens, temperature, batch_size, top_k):
    """The factors (default FACTORS), once the settings that need no file are checked."""
    factors = list(FACTORS if factors is None else factors)
    if not factors or any(not isinstance(f, (int, float)) or f < 0 for f in factors):
        raise ValueError(f"factors={factors!r} must be a non-empty list of non-negative numbers")
    if not isinstance(instructions, int) or instructions < 2:
        raise ValueError(f"instructions={instructions!r} must be an integer >= 2 (half select, half report)")
    if max_new_tokens < 1 or temperature < 0 or batch_size < 1 or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}, temperature={temperature}, batch_size={batch_size}, top_k={top_k!r}: "
            "need max_new_tokens >= 1, temperature >= 0, batch_size >= 1, top_k an integer >= 0"
        )
    return factors


def steered_lm(artifacts: list[LoadedArtifact], lm: str | None) -> str:
    """The LM to steer: `lm`, or the one the artifacts' configs name; it must match them, in name
    and (where an artifact records it) hidden size. Reads the LM's config only."""
    models = {a.model for a in artifacts if a.model}
    if lm is None:
        if len(models) != 1:
            raise ValueError(f"cannot tell which LM to steer (the cards name {sorted(models) or 'none'}); pass --lm")
        lm = models.pop()
    elif models - {lm}:
        raise ValueError(f"--lm {lm!r} differs from the model the steering weights were trained on: {sorted(models)}")
    d = hidden_size(load_config(lm))
    for artifact in artifacts:
        width = getattr(artifact.obj, "hidden_size", None)
        if isinstance(width, int) and not isinstance(width, bool) and width != d:
            raise ValueError(f"{artifact.where} has hidden size {width}, but {lm!r} has {d}")
    return lm


def concept_cells(concepts, artifacts: list[LoadedArtifact]) -> dict:
    """{artifact: its concepts to evaluate}: the chosen ones (names or ids among all the
    artifacts' concepts, or 'all') of each artifact. Each artifact must name a concept (a
    dictionary's, or the one its config records); one artifact that names none (an intervention
    trained on another benchmark) is judged on the one concept name `concepts` gives. No concept
    may be steered by two."""
    if len(artifacts) == 1 and not artifact_concepts(artifacts[0])[0] and _one_name(concepts):
        artifacts[0].config["concept"] = concepts  # what its edit is judged on
    named = {artifact: artifact_concepts(artifact)[0] for artifact in artifacts}
    if unnamed := [a.where for a, names in named.items() if not names]:
        raise ValueError(
            f"{unnamed[0]} names no concept to steer toward; give the one it is judged on (--concepts NAME, "
            "with one artifact) or retrain with model.concept set"
        )
    every = [c for names in named.values() for c in names]
    if twice := sorted(c for c, n in Counter(every).items() if n > 1):
        raise ValueError(f"concept {twice[0]!r} is steered by two artifacts; evaluate them in separate runs (--out)")
    wanted = pick_concepts(concepts, every)
    cells_of = {}
    for artifact, names in named.items():
        own = set(names)
        if chosen := [c for c in wanted if c in own]:
            cells_of[artifact] = chosen
    return cells_of


def _one_name(concepts) -> bool:
    """Whether `concepts` is one concept name (not 'all', not an id)."""
    return isinstance(concepts, str) and bool(concepts.strip()) and concepts != "all" and not concepts.isdigit()


def ready_judge(judge: dict | Judge | None) -> Judge:
    """The judge (default the openai backend), checked to answer (e.g. the endpoint is down: stop
    before generating)."""
    if judge is None:
        judge = {"backend": "openai"}
    judge = judge if isinstance(judge, Judge) else make_judge(**judge)
    judge.check()
    return judge
