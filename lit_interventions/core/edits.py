"""What an applied artifact does to the LM: a list of `Edit`s, each one forward hook.

An artifact object says what it edits through one method, `edits(config, request) -> list[Edit]`
(its config.json is `config`; the LM, the positions and the per-request settings are `request`).
Every intervention of the protocol gets it from `Intervention` (`intervention_edits`: the
intervention at the site its config.json records); a composition gives one edit per part, a
concept dictionary and a LoRA adapter their own.

An `Edit` names where (a site: layer and component, or a submodule by name), which positions
(`Positions`) and the function: `fn(states, rows, inputs)` gets the states at the chosen
positions, (n, d), which batch row each comes from, (n,), and for a submodule edit its inputs at
those positions; it returns the new states, (n, d). `install` puts the hooks on the LM.

Interchange interventions read their source state here (`source_states`): the source text runs
through the LM once, before any hook of this request is on it, and the state at the site is read
at the source position (by default the source's last token). One source state replaces, through
the intervention, every chosen position of the base.

The steering factor. An artifact whose edit takes a `factor` of its own keeps its meaning (a
concept dictionary: h + factor·m_c·w_c, m_c the concept's max activation; an intervention whose
forward takes `factor`). Any other artifact's edit f*(h) (LoReFT, an interchange such as DAS, a
LoRA adapter) is scaled by it (`scaled`):

    f(h) = h + factor·(f*(h) − h)

so factor 0 leaves h as it is, factor 1 is f*(h) itself (taken as it is, bit for bit, not
recomputed), and factor 2 moves twice as far from h.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lit_interventions.core.blocks import BLOCK_OUTPUT, check_component, decoder_layers, site_width
from lit_interventions.core.forward import read_layers
from lit_interventions.core.hooks import site_hook
from lit_interventions.core.lm import num_layers
from lit_interventions.core.positions import Positions, PositionTracker, encode_text

STEERING_RULE, INTERCHANGE_RULE = "all", "last"


@dataclass(frozen=True)
class Edit:
    """One hook: `fn(states (n, d), rows (n,), inputs (n, d_in) | None) -> (n, d)` at the
    positions `positions` of a site (`layer`, `component`) or of the submodule named `module`."""

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    positions: Positions
    layer: int | None = None
    component: str = BLOCK_OUTPUT
    module: str | None = None
    head: int | tuple[int, ...] | None = None  # the head(s) of a head component


@dataclass
class ApplyRequest:
    """What one `apply` asks of its artifacts.

    lm, tokenizer: the loaded LM and its tokenizer (needed for a source text).
    positions: the base positions edited (`Positions`; "site": the artifact's own rule).
    source, source_positions: an interchange's source: a text, or its state(s) as a tensor, (d,);
        the source position rule (default: the source's last token).
    concept: a concept name or index (dictionaries), or one per batch row.
    factor: the steering factor, or one per batch row.
    enabled: None, or a bool per batch row (rows with False are left unedited).
    """

    lm: nn.Module
    tokenizer: object | None = None
    positions: Positions = field(default_factory=Positions)
    source: str | torch.Tensor | None = None
    source_positions: Positions = field(default_factory=lambda: Positions("last"))
    concept: str | int | Sequence | None = None
    factor: float | Sequence[float] = 1.0
    enabled: Sequence[bool] | None = None

    def per_row(self, values, rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """`values` (one value, or one per batch row) for each of `rows`, (n,)."""
        if isinstance(values, (list, tuple)):
            return torch.as_tensor(values, dtype=dtype, device=rows.device)[rows]
        return torch.full(rows.shape, values, dtype=dtype, device=rows.device)


def scaled(states: torch.Tensor, edited: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """h + factor·(f*(h) − h) per row, with f*(h) = `edited` itself where the factor is 1.
    states, edited (n, d); factor (n,)."""
    if bool((factor == 1).all()):
        return edited
    dtype = torch.promote_types(torch.promote_types(states.dtype, edited.dtype), torch.float32)
    factor, h = factor.to(states.device, dtype)[:, None], states.to(dtype)
    return torch.where(factor == 1, edited.to(dtype), h + factor * (edited.to(dtype) - h))


def site_of(config: dict, where: str) -> tuple[int, str, int | tuple[int, ...] | None]:
    """(layer, component, head) of the site config.json records (`site`, else its top-level
    `layer`, `component` and `head`)."""
    site = config.get("site")
    site = site if isinstance(site, dict) else {}
    layer = site.get("layer", config.get("layer"))
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"{where}: records no site layer (site={config.get('site')!r}); it cannot be applied")
    head = site.get("head", config.get("head"))
    head = tuple(head) if isinstance(head, list) else head
    return layer, site.get("component") or config.get("component") or BLOCK_OUTPUT, head


def check_width(width: int, lm: nn.Module, config: dict, where: str, component: str = BLOCK_OUTPUT, head=None) -> None:
    """One ValueError naming both when the artifact's width is not the LM's at its site (the
    hidden size; head_dim × heads for a head component, the MLP's units for `mlp_neuron`)."""
    size = site_width(lm.config, component, head)
    if width != size:
        what = "hidden size" if component in (BLOCK_OUTPUT, "block_input") else f"width at {component}"
        raise ValueError(
            f"{where} was trained on {config.get('model')!r} ({what} {width}); the LM given, "
            f"{lm_name(lm)!r}, has {what} {size}"
        )


def check_site(layer: int, component: str, lm: nn.Module, config: dict, where: str, head=None) -> None:
    """One ValueError naming both when the LM is of another type or layer count than the ones
    recorded, or has no such layer."""
    trained_type, lm_type = config.get("model_type"), getattr(lm.config, "model_type", None)
    if isinstance(trained_type, str) and lm_type and trained_type != lm_type:
        raise ValueError(
            f"{where} was trained on {config.get('model')!r} (a {trained_type} model); the LM given, "
            f"{lm_name(lm)!r}, is a {lm_type} model"
        )
    n_layers, recorded = num_layers(lm.config), config.get("num_layers")
    if (isinstance(recorded, int) and recorded != n_layers) or not -1 <= layer < n_layers:
        trained = f"{recorded} layers" if isinstance(recorded, int) else f"layer {layer}"
        raise ValueError(
            f"{where} was trained on {config.get('model')!r} ({trained}); the LM given, {lm_name(lm)!r}, "
            f"has {n_layers} layers (0..{n_layers - 1})"
        )
    check_component(layer, component, n_layers, head, lm.config)


def lm_name(lm: nn.Module) -> str:
    return getattr(lm.config, "_name_or_path", "") or type(lm).__name__


def _context(intervention: nn.Module, where: str) -> set[str]:
    """The per-batch context keywords its forward takes among those a request gives
    (`concept_id`, `factor`); one it requires that a request does not give (an attack's
    `target`) is refused."""
    parameters = inspect.signature(intervention.forward).parameters
    needed = [
        name
        for name, p in parameters.items()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in ("concept_id", "factor")
    ]
    if needed:
        raise ValueError(
            f"{where}: a {type(intervention).__name__} needs {', '.join(needed)} for every row, which apply "
            "does not give; it is applied by its own study (CALM)"
        )
    return set(parameters) & {"concept_id", "factor"}


def concept_index(concept, names: Sequence[str] | None, count: int, where: str) -> int:
    """The row of `concept` (a name among `names`, or an index below `count`)."""
    if isinstance(concept, str) and names and concept in names:
        return list(names).index(concept)
    if isinstance(concept, str) and concept.lstrip("-").isdigit():
        concept = int(concept)
    if isinstance(concept, int) and not isinstance(concept, bool) and 0 <= concept < count:
        return concept
    shown = ", ".join(repr(n) for n in list(names or [])[:5])
    valid = f"one of {shown}{' …' if names and len(names) > 5 else ''} or " if names else ""
    raise ValueError(f"{where}: concept={concept!r}; give {valid}an index 0..{count - 1}")


def concept_rows(request: ApplyRequest, names: Sequence[str] | None, count: int, where: str) -> list[int] | int:
    """The concept row of the request (one, or one per batch row)."""
    if request.concept is None:
        if count == 1:
            return 0
        raise ValueError(f"{where} holds {count} concepts: name one (concept=NAME or an index 0..{count - 1})")
    if isinstance(request.concept, (list, tuple)):
        return [concept_index(c, names, count, where) for c in request.concept]
    return concept_index(request.concept, names, count, where)


@torch.no_grad()
def source_states(request: ApplyRequest, layer: int, component: str, where: str, head=None) -> torch.Tensor:
    """The source state at (layer, component) and the request's source position, (d,): read from
    the source text before this request's hooks are placed (an enclosing `apply` still edits
    it), or the tensor given."""
    if request.source is None:
        raise ValueError(f"{where} is an interchange intervention: give a source (a text, or its state as a tensor)")
    if torch.is_tensor(request.source):
        return request.source.reshape(-1)
    if request.tokenizer is None:
        raise ValueError(f"{where}: a source text needs the LM's tokenizer (tokenizer=...)")
    enc = encode_text(request.tokenizer, request.source)
    ids, mask = enc["input_ids"].to(request.lm.device), enc["attention_mask"].to(request.lm.device)
    hidden = read_layers(request.lm, [layer], ids, mask, component=component, head=head)[layer][0]  # (seq, d)
    rule, width = request.source_positions, hidden.shape[0]
    if rule.rule in ("last", "site"):
        return hidden[-1]
    if rule.rule == "indices" and len(rule.indices) == 1 and -width <= rule.indices[0] < width:
        return hidden[rule.indices[0]]
    raise ValueError(f"source_positions={rule}: one source token is read (last, or one index in -{width}..{width - 1})")


def intervention_edits(intervention: nn.Module, config: dict, request: ApplyRequest, where: str) -> list[Edit]:
    """The edit of an intervention of the protocol at the site `config` records: f* =
    intervention(f(b), f(s)) for an interchange, intervention(f(b), concept_id, factor) for one
    that edits base alone (steering: every position by default). One whose forward takes no
    `factor` is scaled by the request's: f(b) + factor·(f* − f(b)) (`scaled`)."""
    layer, component, head = site_of(config, where)
    check_site(layer, component, request.lm, config, where, head)
    tensors = intervention.export()
    if tensors:
        check_width(next(iter(tensors.values())).shape[-1], request.lm, config, where, component, head)
    steering = bool(getattr(intervention, "edits_base_alone", False))
    positions = request.positions.resolved(STEERING_RULE if steering else INTERCHANGE_RULE)
    context = _context(intervention, where)
    if steering:
        count = int(tensors["weight"].shape[0]) if "concept_id" in context else 1
        concepts = concept_rows(request, config.get("concepts"), count, where) if "concept_id" in context else 0

        def steer(states, rows, inputs=None):
            keywords = {}
            if "concept_id" in context:
                keywords["concept_id"] = request.per_row(concepts, rows, torch.long)
            if "factor" in context:
                keywords["factor"] = request.per_row(request.factor, rows)
                return intervention(states, None, **keywords)
            return scaled(states, intervention(states, None, **keywords), request.per_row(request.factor, rows))

        return [Edit(steer, positions, layer, component, head=head)]
    source = source_states(request, layer, component, where, head)

    def interchange(states, rows, inputs=None):
        edited = intervention(states, source.to(states.device, states.dtype).expand_as(states))
        return scaled(states, edited, request.per_row(request.factor, rows))

    return [Edit(interchange, positions, layer, component, head=head)]


@contextmanager
def install(lm: nn.Module, edits: list[Edit], request: ApplyRequest) -> Iterator[PositionTracker]:
    """The hooks of `edits` on `lm` inside the block, each editing its chosen positions (rows
    switched off by `request.enabled` untouched). Yields the position tracker."""
    tracker = PositionTracker(request.enabled)
    with ExitStack() as stack:
        stack.enter_context(tracker.following(lm))
        for edit in edits:
            stack.enter_context(_hook(lm, edit, tracker))
        yield tracker


def _apply_at(edit: Edit, hidden: torch.Tensor, chosen: torch.Tensor, inputs: torch.Tensor | None):
    if not chosen.any():
        return None
    rows = chosen.nonzero()[:, 0]
    new = edit.fn(hidden[chosen], rows, None if inputs is None else inputs[chosen])
    out = hidden.clone()
    out[chosen] = new.to(hidden.dtype)
    return out


@contextmanager
def _hook(lm: nn.Module, edit: Edit, tracker: PositionTracker):
    if edit.module is None:
        decoder_layers(lm)  # the blocks, found before generation starts

        def on_hidden(hidden):
            return _apply_at(edit, hidden, tracker.mask(edit.positions, hidden.shape[0], hidden.device), None)

        with site_hook(lm, edit.layer, edit.component, on_hidden, head=edit.head):
            yield
        return
    module = dict(lm.named_modules()).get(edit.module)
    if module is None:
        raise ValueError(f"the LM {lm_name(lm)!r} has no module {edit.module!r} to edit")

    def post_hook(module, args, output):
        chosen = tracker.mask(edit.positions, output.shape[0], output.device)
        return _apply_at(edit, output, chosen, args[0])

    handle = module.register_forward_hook(post_hook)
    try:
        yield
    finally:
        handle.remove()
