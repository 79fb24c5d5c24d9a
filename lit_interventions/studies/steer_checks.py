"""The steering evaluation's checks, all made before any generation: the settings that need no
file, the LM to steer (it must match the steerers), the cells (concepts per steerer) and a judge
that answers. The evaluation itself: `lit_interventions/studies/steer_eval.py`."""

from __future__ import annotations

from lit_interventions.core.lm import hidden_size, load_config
from lit_interventions.metrics.judge import Judge, make_judge
from lit_interventions.studies.steer_sources import pick_concepts

FACTORS = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0]  # AxBench's steering factors


def check_settings(dictionary, checkpoint, factors, instructions, max_new_tokens, temperature, batch_size, top_k):
    """The factors (default FACTORS), once the settings that need no file are checked."""
    if (dictionary is None) == (checkpoint is None):
        raise ValueError("give exactly one of --dictionary PATH or --checkpoint PATH")
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


def steered_lm(steerers: list, lm: str | None) -> str:
    """The LM to steer: `lm`, or the one the steerers' cards name; it must match them, in name and
    hidden size."""
    models = {s.model for s in steerers if s.model}
    if lm is None:
        if len(models) != 1:
            raise ValueError(f"cannot tell which LM to steer (the cards name {sorted(models) or 'none'}); pass --lm")
        lm = models.pop()
    elif models - {lm}:
        raise ValueError(f"--lm {lm!r} differs from the model the steering weights were trained on: {sorted(models)}")
    d = hidden_size(load_config(lm))
    for steerer in steerers:
        if steerer.hidden_size is not None and steerer.hidden_size != d:
            raise ValueError(f"the dictionary has hidden size {steerer.hidden_size}, but {lm!r} has {d}")
    return lm


def concept_cells(concepts, steerers: list, from_dictionary: bool) -> dict:
    """{steerer: its concepts to evaluate}: the chosen concepts of the dictionary, or the
    checkpoints whose concept is chosen (each checkpoint's card must name one)."""
    if from_dictionary:
        return {steerers[0]: pick_concepts(concepts, steerers[0].concepts)}
    wanted = (
        None
        if concepts in (None, "all", ["all"])
        else set(pick_concepts(concepts, [s.concepts[0] for s in steerers if s.concepts]))
    )
    cells_of = {s: s.concepts for s in steerers if wanted is None or set(s.concepts) & wanted}
    if any(not s.concepts for s in steerers):
        raise ValueError("a checkpoint card names no concept; retrain with model.concept set")
    return cells_of


def ready_judge(judge: dict | Judge | None) -> Judge:
    """The judge (default the openai backend), checked to answer (e.g. the endpoint is down: stop
    before generating)."""
    if judge is None:
        judge = {"backend": "openai"}
    judge = judge if isinstance(judge, Judge) else make_judge(**judge)
    judge.check()
    return judge
