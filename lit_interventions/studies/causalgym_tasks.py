"""What the CausalGym sweep sweeps: its tasks, each a name, its regions, the regions its overall
odds count, and a data factory (region, kind -> the region's data module).

Two sources give them, checked before the output directory is claimed and the model loaded:
- a template file (`template_tasks`: CausalGym's 29 built-in tasks, or a file in its schema):
  each task's pairs sampled `train_pairs` / `eval_pairs` by the seed, its regions the template's,
  scored from the first label-variable region on (`TaskTemplate.scored_regions`), the dog/give
  control task available (kind `CONTROL`);
- a counterfactual pairs file (`pairs_task`, `datamodules/pairs.py`): one task named for the
  file's stem, regions `site` and `last`, both scored, the file's own splits (its rows without a
  split divided by the seed, as `train.py` divides them), no control task.

A template task's sentences are read where `positions` says (`CausalGymDataModule`: `own`, each
side at its own region's last token, or `official`, the source at the base's token index); a
pairs file's rows name each side's position themselves, so it takes `own` only.

What a resumed run must find unchanged is recorded in its meta.json (`data_meta`): the template
file's or the pairs file's sha256, the sizes and the seed, and `positions` where it is not `own`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from lit_interventions.cli.studies import choose_names
from lit_interventions.core.files import file_sha256
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.datamodules.causalgym import (
    OWN,
    CausalGymDataModule,
    EmptyRegionError,
    check_positions,
    split_pairs,
)
from lit_interventions.datamodules.pairs import REGIONS as PAIRS_REGIONS
from lit_interventions.datamodules.pairs import PairsDataModule
from lit_interventions.datamodules.pairs_files import read_pairs
from lit_interventions.datamodules.templates import BUILTIN_TEMPLATES, load_task, load_templates

DEFAULT_TASK = "agr_sv_num_pp"


@dataclass(frozen=True)
class SweepTask:
    """One task of a sweep: `data(region, kind=None)` is the region's data module, set up (None:
    the region is empty in every pair; kind: None, or the control task `CONTROL`; region None:
    the task's default region, whose sentences fill the activation cache)."""

    name: str
    regions: list[str]
    scored_regions: list[str]
    data: Callable[..., BenchmarkDataModule | None]


def check_sizes(tasks: list[str], templates: str | None, sizes: dict) -> None:
    """`train_pairs` / `eval_pairs` positive and no more than each task's distinct pairs, and each
    task's splits drawn (`split_pairs`: eval and dev share no sentence with train), so a task that
    cannot give them is refused before any work, not when the sweep reaches it."""
    for name in ("train_pairs", "eval_pairs"):
        if not isinstance(sizes[name], int) or sizes[name] < 1:
            raise ValueError(f"{name}={sizes[name]!r} must be a positive integer")
    for task in tasks:
        template = load_task(task, templates)
        available = template.distinct_pairs()
        for name in ("train_pairs", "eval_pairs"):
            if sizes[name] > available:
                raise ValueError(
                    f"{name}={sizes[name]} but task {task!r} has only {available} distinct pairs; "
                    f"ask for at most {available}"
                )
        split_pairs(template, sizes["train_pairs"], sizes["eval_pairs"], sizes["seed"])


def template_tasks(
    tasks: str | list[str], templates: str | None, lm: str, sizes: dict, positions: str = OWN
) -> dict[str, SweepTask]:
    """{name: SweepTask} of the template file's tasks asked for (a name, a list or 'all'),
    `sizes` ({train_pairs, eval_pairs, seed}) checked against each (`check_sizes`), their data
    read at `positions` (`CausalGymDataModule`)."""
    path = Path(templates) if templates else BUILTIN_TEMPLATES
    names = choose_names(tasks, list(load_templates(path)), "tasks")
    check_sizes(names, templates, sizes)
    found = {}
    for name in names:
        template = load_task(name, templates)
        data = partial(_template_data, name, templates, lm, sizes, positions)
        found[name] = SweepTask(name, template.regions, template.scored_regions, data)
    return found


def _template_data(task, templates, lm, sizes, positions, region, kind=None):
    """A template task's data module at `region` (kind: None, or the control task), set up."""
    return _region_data(task, templates, lm, region, kind, sizes, positions)


def _region_data(task, templates, lm, region, control, sizes, positions=OWN) -> CausalGymDataModule | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pairs where this region is empty are expected: skipped quietly
        data = CausalGymDataModule(
            task=task, templates=templates, lm=lm, region=region, control=control, positions=positions, **sizes
        )
        try:
            data.setup("fit")
        except EmptyRegionError:
            return None  # the region is empty in every pair: no site (any other error is the user's to see)
    return data


def _pairs_data(path: str, lm: str, seed: int, region: str | None, kind: str | None = None) -> PairsDataModule:
    """The pairs file's data module at `region`, set up (the options `configs/das_pairs.yaml`
    gives, the split by `seed`)."""
    if kind is not None:
        raise ValueError(f"kind={kind!r}: a pairs file has no control task")
    data = PairsDataModule(path, lm=lm, region=region, seed=seed)
    data.setup("fit")
    return data


def pairs_task(path: str, lm: str, seed: int) -> SweepTask:
    """The SweepTask of a counterfactual pairs file (`PairsDataModule`): named for its stem,
    regions `site` and `last`, both scored. The file is read and checked here (every row, the
    labels' tokens under `lm`'s tokenizer, the splits), before any model loads."""
    _pairs_data(path, lm, seed, None)  # a bad row or split is refused here, before any model loads, as one line
    regions = list(PAIRS_REGIONS)
    name = Path(path.rstrip("/")).stem
    return SweepTask(name, regions, regions, partial(_pairs_data, path, lm, seed))


def pairs_digest(path: str) -> str:
    """The sha256 of a pairs file's bytes; of a dataset directory or a hub id, of its rows as read
    (`read_pairs`, each row's fields without its place)."""
    if Path(path).is_file():
        return file_sha256(path)
    rows = [{k: v for k, v in asdict(row).items() if k != "where"} for row in read_pairs(path)]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def sweep_tasks(
    tasks, templates, pairs, control: bool, lm: str, sizes: dict, positions: str = OWN
) -> tuple[dict[str, SweepTask], dict]:
    """The sweep's tasks ({name: SweepTask}: a pairs file's one, else the template file's) and
    what meta.json records of their data: the file's sha256 (a resumed run on a changed file is
    refused), the sizes and, where it is not `own`, `positions`. `--pairs` with `--tasks`,
    `--templates`, `--control` or `--positions official` is refused."""
    check_positions(positions)
    if pairs is None:
        found = template_tasks(DEFAULT_TASK if tasks is None else tasks, templates, lm, sizes, positions)
        digest = file_sha256(Path(templates) if templates else BUILTIN_TEMPLATES)
        meta = {"templates": templates or "builtin", "templates_sha256": digest, **sizes}
        return found, meta | ({} if positions == OWN else {"positions": positions})
    if not isinstance(pairs, str) or not pairs.strip():
        raise ValueError(
            f"pairs={pairs!r}: give a .jsonl or .csv file, a dataset directory or a Hugging Face dataset id"
        )
    for option, value in (("tasks", tasks), ("templates", templates)):
        if value is not None:
            raise ValueError(
                f"{option}={value!r} with pairs={pairs!r}: a pairs file is the sweep's one task; "
                f"give --pairs or --{option}, not both"
            )
    if control:
        raise ValueError(
            f"control=True with pairs={pairs!r}: the dog/give control relabels a template task's types, "
            "a pairs file has none; leave --control false"
        )
    if positions != OWN:
        raise ValueError(
            f"positions={positions!r} with pairs={pairs!r}: a pairs file's rows name each side's position "
            "themselves; leave --positions own"
        )
    task = pairs_task(pairs, lm, sizes["seed"])
    return {task.name: task}, {"pairs": pairs, "pairs_sha256": pairs_digest(pairs), "seed": sizes["seed"]}


def controlled_tasks(control: bool | list[str], tasks: list[str]) -> frozenset[str]:
    """The tasks the dog/give control runs on: `control` true (all of `tasks`), false (none), or a
    list of task names, each one of `tasks` (the paper runs it on the agreement and NPI tasks)."""
    if isinstance(control, bool):
        return frozenset(tasks if control else ())
    if not isinstance(control, (list, tuple)) or not all(isinstance(name, str) for name in control):
        raise ValueError(f"control={control!r}: give true, false or a list of the sweep's task names")
    return frozenset(choose_names(list(control), tasks, "control tasks"))
