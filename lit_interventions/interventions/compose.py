"""Several interventions applied together, one per site, in one forward (pyvene's list of
representations): e.g. DAS on the subject and DAS on the verb of one sentence. The module that
runs the LM gives each part the states of its own site."""

from __future__ import annotations

import torch
from torch import nn

from lit_interventions.core.edits import ApplyRequest, Edit, intervention_edits
from lit_interventions.interventions.base import Intervention, class_path, loadable_class, register_intervention
from lit_interventions.interventions.capabilities import Annealed, Penalised, intervene, is_source_free


@register_intervention
class Composition(Intervention):
    """Parts applied at their own sites: forward([f(b) at site i], [f(s) at site i]) →
    [f*_i(f(b)_i, f(s)_i)], each part on its own states."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if not parts:
            raise ValueError("a composition needs at least one intervention")
        self.parts = nn.ModuleList(parts)

    @property
    def trains(self) -> bool:
        return any(getattr(part, "trains", False) for part in self.parts)

    @property
    def edits_base_alone(self) -> bool:
        """Source-free when every part is: then no source state is read for it."""
        return all(is_source_free(part) for part in self.parts)

    def forward(self, base: list[torch.Tensor], source: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if source is None:
            source = [None] * len(self.parts)
        if len(base) != len(self.parts) or len(source) != len(self.parts):
            raise ValueError(
                f"a composition of {len(self.parts)} parts needs that many base and source states; "
                f"got {len(base)} and {len(source)}"
            )
        return [intervene(part, b, s) for part, b, s in zip(self.parts, base, source)]

    def penalty(self) -> torch.Tensor:
        """The sum of the parts' penalties (a mask's ‖σ(m/T)‖₁); parts without one add nothing."""
        return sum((part.penalty() for part in self.parts if isinstance(part, Penalised)), torch.zeros(()))

    def anneal(self, step: int, total: int) -> None:
        for part in self.parts:
            if isinstance(part, Annealed):
                part.anneal(step, total)

    def edits(self, config: dict, request: ApplyRequest, where: str = "the composition") -> list[Edit]:
        """Each part at its own site (config.json's `site.sites`, in the parts' order)."""
        sites = (config.get("site") or {}).get("sites") if isinstance(config.get("site"), dict) else None
        if not isinstance(sites, list) or len(sites) != len(self.parts):
            raise ValueError(f"{where}: config.json records {sites!r} as the sites of its {len(self.parts)} parts")
        return [
            edit
            for i, (part, site) in enumerate(zip(self.parts, sites))
            for edit in intervention_edits(part, {**config, "site": site}, request, f"{where} (part {i})")
        ]

    def export(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{name}": tensor for i, part in enumerate(self.parts) for name, tensor in part.export().items()}

    def config(self) -> dict:
        return {"parts": [{"class_path": class_path(part), "config": part.config()} for part in self.parts]}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], parts: list[dict]) -> Composition:
        rebuilt = []
        for i, part in enumerate(parts):
            own = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == str(i)}
            part_class = loadable_class(part["class_path"], f"{cls.__name__} part {i}")
            rebuilt.append(part_class.from_tensors(own, **part["config"]))
        return cls(rebuilt)
