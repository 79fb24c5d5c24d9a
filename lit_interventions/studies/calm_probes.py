"""The CALM study's probes g_Z, one per property: saved ones reused (checked against the site and
the run's classes), or trained on the train entities with a kept value (best val epoch kept),
and each scored per split."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from lit_interventions.callbacks.progress import LoopProgress
from lit_interventions.core.progress import current
from lit_interventions.modules.probe import ProbeModule, load_probe, train_probe
from lit_interventions.studies.calm_data import POSITION, SPLITS, _labels


def load_saved_probes(probes: str | None, properties: list[str], where: tuple) -> dict:
    """{property: probe} from a directory of probes saved by an earlier run (PROPERTY.ckpt), each
    checked to have been trained at this site `where` = (lm, layer, hidden size); {} without one."""
    lm, layer, d = where
    loaded = {}
    if probes is not None:
        for prop in properties:
            path = Path(probes) / f"{prop}.ckpt"
            if not path.is_file():
                raise ValueError(f"no probe for property {prop!r} at {path}")
            loaded[prop] = load_probe(path)
            loaded[prop].check_site(lm, layer, d, POSITION)
    return loaded


def check_saved_classes(loaded: dict, classes: dict[str, list[str]]) -> None:
    """Each saved probe must have the classes this run keeps for its property."""
    for prop, g in loaded.items():
        if g.classes != classes[prop]:
            raise ValueError(f"the saved probe of {prop!r} has classes {g.classes}; this run keeps {classes[prop]}")


def fit_probes(data, prompts, site, classes, loaded, where, args: dict, seed: int, save_dir: Path):
    """A probe per property (trained on train entities with a kept value, best val epoch kept, or
    `loaded`), and its accuracy per split: ({property: probe}, {property: info}). Each probe
    trained is counted in the study's progress (`core.progress.current`), its batches a stage."""
    lm, layer, d = where
    probes, info = {}, {}
    torch.manual_seed(seed)  # the first probe's initial weights (each later one follows train_probe's seeding)
    for prop in classes:
        labels = {s: _labels(data, prompts[s], prop, classes[prop]) for s in SPLITS}
        known = {s: labels[s] >= 0 for s in SPLITS}  # entities whose value is a kept class
        if prop in loaded:
            probes[prop] = loaded[prop]
        else:
            module = ProbeModule(
                classes[prop],
                lm,
                layer,
                d,
                POSITION,
                kind=args["kind"],
                hidden=args["hidden"],
                lr=args["lr"],
                property_name=prop,
            )
            train = (site["train"][known["train"]], labels["train"][known["train"]])
            val = (site["val"][known["val"]], labels["val"][known["val"]])
            current().note(prop)
            probes[prop] = train_probe(
                module,
                train,
                val,
                args["epochs"],
                args["batch_size"],
                seed,
                save_to=save_dir / f"{prop}.ckpt",
                callbacks=[LoopProgress(validation=False)],  # its batches in the study's progress
            )
            current().update()
        with torch.no_grad():
            accs = {f"{s}_acc": _accuracy(probes[prop].predict(site[s]), labels[s]) for s in SPLITS}
        test_known = labels["test"][known["test"]].tolist()
        majority = max(Counter(test_known).values()) / len(test_known) if test_known else math.nan
        info[prop] = {
            "classes": classes[prop],
            **accs,
            "test_majority": majority,
            **{f"n_{s}": int(known[s].sum()) for s in SPLITS},
        }
    return probes, info


def _accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy over the examples with a kept class (label >= 0)."""
    known = labels >= 0
    return (predicted[known] == labels[known]).float().mean().item() if known.any() else math.nan
