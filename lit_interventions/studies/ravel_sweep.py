"""The RAVEL study: train and evaluate each method for every attribute of an entity type.

    lit-interventions sweep ravel --config configs/sweep_ravel.yaml --out DIR

Each method is a registered name or {name: NAME, model: <train.py's model section>} (the one
registry, `lit_interventions.interventions.registry`). A registered name with a file
`configs/ravel/<name>.yaml` (das, mdas, dbm, mdbm, pca_features, sae, full_swap, diffmean, probe)
runs that file's model section and epochs, the paper's settings; any other, and a {name, model}
entry, runs its spec's model section (`spec.model()`: intervention, lr, warmup_ratio, objective)
at layer 6 with RAVEL's objective L_Cause (`CauseIsoLoss(multitask: false)`) where it sets none,
for `--epochs` epochs (default 1); a registered closed-form direction (pca, lda, ...) runs as
`DirectionInterchange(method: NAME, k: 8)`. The sweep sets the LM (and with `--layer`, `--k` the
layer and the DAS rank), the data and the target attribute, fits on train, selects nothing on
dev (the method configs are fixed) and scores the test split with the validation metric
(`metrics.disentangle.Disentanglement`). It writes

- `DIR/summary.csv`: method, attribute, cause, iso, disentangle (one row per target attribute,
  plus an `average` row per method: RAVEL's Disentangle is averaged over attributes);
- `DIR/table.csv`: the `average` rows;
- `DIR/changes.csv` and `DIR/<method>_changes.png`: how often intervening on attribute A (row)
  changes the model's answer about attribute B (column), the paper's Figure 3a;

the results first and the figures last, every file whole (a temporary file renamed over it); a
figure that cannot be written (a full disk) is one `error:` line naming it, exit status 1, the
results kept. It resumes: a rerun skips the (method, attribute) cells already done. Finished
cells are kept in `DIR/results.sqlite` (one transaction per cell) and the CSVs exported from it,
whole, after each (`lit_interventions.artifacts.results`); one run at a time holds `DIR/.lock`.
`DIR/meta.json` records the settings and the sha256 of each data file: a rerun with other settings,
or on a data file changed in place, is refused in one line before the LM loads.

Under torchrun or srun each process takes the next cell left whenever it is free, and writes
`DIR/ranks/rank-R/`, and rank 0 merges them into the files one process would have written
(`lit_interventions.studies.distributed`), resuming what any earlier run finished, at any world size.
"""

from __future__ import annotations

import csv
import io
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import yaml
from torch import nn

from lit_interventions.artifacts.plots import attribute_figure, report_figures, save_figures
from lit_interventions.artifacts.results import Table, check_recorded
from lit_interventions.callbacks.progress import LoopProgress
from lit_interventions.cli.studies import choose_layers, choose_names, read_rows, run_cli
from lit_interventions.core.files import FILE_DIGESTS, unchanged_files, write_atomically
from lit_interventions.core.lm import DEFAULT_LM, load_config, num_layers
from lit_interventions.core.progress import Progress, line_seconds
from lit_interventions.core.signals import raise_pending
from lit_interventions.datamodules.ravel import ACCURACIES, RavelDataModule, check_entity_templates
from lit_interventions.datamodules.ravel_files import BUILTIN_RAVEL, FILES, load_ravel
from lit_interventions.interventions.base import import_class
from lit_interventions.interventions.capabilities import Fitted
from lit_interventions.interventions.directions import METHODS as DIRECTION_METHODS
from lit_interventions.interventions.registry import (
    INTERCHANGE_MODULE,
    MethodSpec,
    check_site_method,
    method_entry,
    registered_methods,
)
from lit_interventions.metrics.disentangle import AVERAGES
from lit_interventions.studies import distributed
from lit_interventions.studies.configs import build_module, model_section

ALL = ["das", "mdas", "dbm", "mdbm", "pca_features", "full_swap"]  # `all`: the paper's (sae needs a trained SAE)
CONFIGS = Path("configs/ravel")  # a registered name's settings, where configs/ravel/<name>.yaml exists
LAYER = 6  # the site of configs/ravel/*.yaml: a method without a config file runs there too (--layer: another)
OBJECTIVE = {"class_path": "lit_interventions.objectives.CauseIsoLoss", "init_args": {"multitask": False}}  # L_Cause
DIRECTIONS_K = 8  # a registered direction's one-vs-rest directions (configs/ravel/diffmean.yaml)
DAS = "lit_interventions.interventions.rotation.RotatedSpaceIntervention"
DIRECTION_INTERCHANGE = "lit_interventions.interventions.fitted.DirectionInterchange"
SUMMARY_COLUMNS = ["method", "attribute", "cause", "iso", "disentangle"]
CHANGE_COLUMNS = ["method", "intervened", "queried", "change_rate"]
SUMMARY = Table("summary", tuple(SUMMARY_COLUMNS), key=("method", "attribute"), numeric=("cause", "iso", "disentangle"))
CHANGES = Table("changes", tuple(CHANGE_COLUMNS), key=("method", "intervened", "queried"), numeric=("change_rate",))


def method_config(configs: Path, method: str) -> tuple[dict, int]:
    """The model options and epochs of `configs/<method>.yaml`."""
    path = configs / f"{method}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"No config for method {method!r}: {path} does not exist")
    config = yaml.safe_load(path.read_text())
    return model_section(path), int(config.get("trainer", {}).get("max_epochs", 1) or 1)


def spec_section(spec: MethodSpec, registered: bool = False) -> dict:
    """train.py's model section that runs `spec` at RAVEL's site: `spec.model()` at layer `LAYER`
    with RAVEL's objective (`OBJECTIVE`) where the spec sets none. A registered closed-form
    direction (`directions.METHODS`, `registered`) runs as DirectionInterchange(method: NAME,
    k: `DIRECTIONS_K`), as configs/ravel/diffmean.yaml runs diffmean; any other class must be an
    intervention (an `nn.Module`)."""
    if registered and spec.name in DIRECTION_METHODS:
        intervention = {"class_path": DIRECTION_INTERCHANGE, "init_args": {"method": spec.name, "k": DIRECTIONS_K}}
        init_args = {"layer": LAYER, "intervention": intervention, "objective": OBJECTIVE}
        return {"class_path": INTERCHANGE_MODULE, "init_args": init_args}
    cls = import_class(spec.class_path)  # the registry's, or the user's own config's
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"method {spec.name!r}: {spec.class_path} is not an intervention (an nn.Module); RAVEL runs an "
            f"intervention in InterchangeModule, or a registered direction ({', '.join(DIRECTION_METHODS)})"
        )
    section = spec.model()
    section["init_args"] = {"layer": LAYER, **section["init_args"]}
    section["init_args"].setdefault("objective", OBJECTIVE)
    return section


def choose_methods(
    methods: str | dict | list[str | dict], configs: Path = CONFIGS
) -> list[tuple[str, dict, int | None]]:
    """The methods asked for, each (name, train.py's model section, epochs: its config file's
    max_epochs, None without one): a list of registered names (`registry.registered_methods`;
    with a file `configs/<name>.yaml` its settings, else `spec_section` of its spec) and {name:
    NAME, model: <train.py's model section>} entries (`registry.method_entry`, `spec_section`),
    or 'all' (`ALL`). Each name once."""
    items = (
        list(ALL) if methods in ("all", ["all"]) else [methods] if isinstance(methods, (str, dict)) else list(methods)
    )
    choose_names([m for m in items if isinstance(m, str)], registered_methods(), "methods")
    chosen = []
    for item in items:
        if isinstance(item, str) and (Path(configs) / f"{item}.yaml").is_file():
            chosen.append((item, *method_config(Path(configs), item)))
        else:
            spec = method_entry(item)
            check_site_method(spec, "RAVEL sweep")
            chosen.append((spec.name, spec_section(spec, registered=isinstance(item, str)), None))
    names = [name for name, _, _ in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"methods {names} name a method twice: give each name once")
    return chosen


def _method_options(methods: list[tuple[str, dict, int | None]], lm: str, layer, k, epochs) -> dict:
    """{name: ((its `model:` section, the sweep's overrides: lm, layer, k), epochs)}: `epochs`,
    else the method's config file's max_epochs, else 1. `k` replaces the section's `k` or its DAS
    intervention's."""
    options = {}
    for name, section, config_epochs in methods:
        overrides = {"lm": lm, **({"layer": layer} if layer is not None else {})}
        intervention = section.get("init_args", {}).get("intervention") or {}
        if k is not None and "k" in section.get("init_args", {}):
            overrides["k"] = k
        elif k is not None and intervention.get("class_path") == DAS and "k" in intervention.get("init_args", {}):
            overrides["intervention"] = {**intervention, "init_args": {**intervention["init_args"], "k": k}}
        options[name] = ((section, overrides), epochs or config_epochs or 1)
    return options


def run_cell(
    method: str, attribute: str, options: tuple[dict, dict], epochs: int, data_options: dict, seed: int
) -> dict:
    """Fit one method for one target attribute and score it on the test split."""
    L.seed_everything(seed, verbose=False)
    section, overrides = options
    model = build_module(section, **overrides)
    data = RavelDataModule(target_attribute=attribute, multitask=model.objective.uses_iso, **data_options)
    trainer = L.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="auto",
        devices=1,
        callbacks=[LoopProgress()],  # its batches in the sweep's progress
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. Lightning's "no optimizer" for the full swap
        if model.trains or isinstance(model.intervention, Fitted):  # train, or fit the featurizer
            trainer.fit(model, data)
        trainer.test(model, data, verbose=False)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    return metrics


def run_ravel_sweep(
    methods: str | list[str | dict] = "all",
    entity_type: str = "city",
    attributes: str | list[str] = "all",
    ravel_dir: str | None = None,
    split: str = "entity",
    source: str = "attribute",
    entity_templates: str = "all",
    lm: str = DEFAULT_LM,
    layer: int | None = None,
    k: int | None = None,
    epochs: int | None = None,
    configs: str = "configs/ravel",
    train_size: int = 1000,
    eval_size: int = 200,
    max_candidates: int = 200,
    accuracy: str = "three_tokens",
    average: str = "templates",
    out: str = "runs/sweep_ravel",
    seed: int = 0,
) -> list[dict]:
    """Run (or resume) the RAVEL sweep; returns the summary rows.

    Args:
        methods: registered names (das, mdas, dbm, mdbm, pca_features, sae, full_swap, ...) and
            {name, model} entries (`choose_methods`), or 'all' (the paper's: these but sae).
        entity_type: an entity type of the data (built-in: city, physical_object).
        attributes: target attributes, or 'all' (every attribute of the entity type).
        ravel_dir: the published RAVEL directory (default: our built-in data).
        split: entity or context.
        source: attribute, wikipedia or mixed (where source prompts come from).
        entity_templates: all (the paper's §2.1) or train (the official code's), as in RavelDataModule.
        lm: the LM; layer: the site's layer (default: each method config's layer).
        k: the DAS / MDAS rank; epochs: training epochs (default: the method configs', or 1).
        configs: the directory of the method configs.
        train_size, eval_size, max_candidates: as in RavelDataModule.
        accuracy: three_tokens (the official rule: 3 greedy tokens against the label's first 3)
            or first_token; average: templates (the official mean over prompt templates within
            an attribute) or examples (as in RavelDataModule).
        out: output directory. seed: data and training seed.
    """
    ranks = distributed.detect()
    distributed.pin_device(ranks)  # before anything starts CUDA
    line_seconds()  # a bad LIT_INTERVENTIONS_PROGRESS_SECONDS: refused before any work
    check_scoring(accuracy, average, entity_templates, split)
    chosen = choose_methods(methods, Path(configs))
    data = load_ravel(ravel_dir, entity_type)  # validates the directory and the entity type
    attributes = choose_names(attributes, data.attributes, "attributes")
    if layer is not None:
        choose_layers([layer], num_layers(load_config(lm)))
    methods, out = list(method_options := _method_options(chosen, lm, layer, k, epochs)), Path(out)
    data_options = {
        "lm": lm,
        "ravel_dir": ravel_dir,
        "entity_type": entity_type,
        "split": split,
        "source": source,
        **({"entity_templates": entity_templates} if entity_templates != "all" else {}),
        "train_size": train_size,
        "eval_size": eval_size,
        "max_candidates": max_candidates,
        "accuracy": accuracy,
        "average": average,
        "seed": seed,
    }
    check_recorded(out, {"entity_templates": entity_templates}, {"entity_templates": "all"}, "a sweep")
    meta = run_meta(out, data_options, layer, k, epochs)
    cells = [(m, a) for m in methods for a in attributes]

    def plan(store) -> tuple[list[tuple[str, str]], None]:
        done = {(r["method"], r["attribute"]) for r in store.rows("summary")}
        return [cell for cell in cells if cell not in done], None

    with distributed.ShardedRun(ranks, out, meta, [CHANGES, SUMMARY], ignore=(FILE_DIGESTS,)) as run:
        todo, _ = run.start(plan)
        _run_cells(run, todo, method_options, data_options, seed, data.attributes)
        lines = run.finish(_position(cells), lambda store: summarise(out, methods, attributes))
        if ranks.is_main:  # the figures last: one not written leaves the results as they are
            write_heatmaps(out, methods, attributes, data.attributes)
        return lines


def check_scoring(accuracy: str, average: str, entity_templates: str, split: str) -> None:
    """The scoring rule, its average and the entity split's templates are known values: a
    ValueError line otherwise, before any work."""
    if accuracy not in ACCURACIES:
        raise ValueError(f"accuracy={accuracy!r}; choose one of {', '.join(ACCURACIES)}")
    if average not in AVERAGES:
        raise ValueError(f"average={average!r}; choose one of {', '.join(AVERAGES)}")
    check_entity_templates(entity_templates, split)


def run_meta(out: Path, data_options: dict, layer, k, epochs) -> dict:
    """What DIR/meta.json records of a run, and a resume must find unchanged: the data options,
    the site's settings and the sha256 of each data file of the entity type (a resume on a file
    changed in place is refused in one line naming it, `unchanged_files`)."""
    ravel_dir, entity_type = data_options["ravel_dir"], data_options["entity_type"]
    directory = Path(ravel_dir) if ravel_dir is not None else BUILTIN_RAVEL
    files = {name: directory / name for name in (pattern.format(entity_type) for pattern in FILES.values())}
    digests = unchanged_files(out / "meta.json", files)
    return {
        **data_options,
        "ravel_dir": ravel_dir or "builtin",
        "layer": layer,
        "k": k,
        "epochs": epochs,
        FILE_DIGESTS: digests,
    }


def _run_cells(run, todo, method_options: dict, data_options: dict, seed: int, all_attributes: list[str]) -> None:
    """This rank's cells of `todo` (the trained methods' first), each fitted and scored
    (`run_cell`), then its change rates and scores stored together."""
    mine = run.take(todo, cost=lambda cell: method_options[cell[0]][1])  # the trained methods' cells first (3 epochs)
    total = len(todo) if run.ranks.world_size == 1 else None  # a rank's share is known only as it goes
    with Progress(total, "RAVEL cells", "cell") as progress:  # closed on its own line, however it ends
        for method, attribute in mine:
            raise_pending()  # a signal a library swallowed stops the sweep between cells
            progress.note(f"{method} {attribute}")
            options, n_epochs = method_options[method]
            metrics = run_cell(method, attribute, options, n_epochs, data_options, seed)
            changes = [
                {"method": method, "intervened": attribute, "queried": b, "change_rate": metrics[f"test/change/{b}"]}
                for b in all_attributes
                if f"test/change/{b}" in metrics
            ]
            scores = {k: metrics[f"test/{k}"] for k in ("cause", "iso", "disentangle")}
            run.store.add(
                {"changes": changes, "summary": [{"method": method, "attribute": attribute, **scores}]}
            )  # both or neither
            progress.update()


def _position(cells: list[tuple[str, str]]):
    """A row's cell's place in `cells` (-1: none of them), to merge the ranks' rows in that order."""
    index = {cell: i for i, cell in enumerate(cells)}
    return lambda table, row: index.get((row["method"], row["attribute" if table == "summary" else "intervened"]), -1)


def summarise(out: Path, methods: list[str], attributes: list[str]) -> list[dict]:
    """Per-method averages over the attributes, written to DIR/table.csv (whole): the rows of
    summary.csv for these methods and attributes, each method's followed by its average."""
    rows = [r for r in read_rows(out / "summary.csv") if r["method"] in methods and r["attribute"] in attributes]
    lines = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        for r in mine:
            lines.append({k: (float(v) if k in ("cause", "iso", "disentangle") else v) for k, v in r.items()})
        if mine:
            average = {k: float(np.mean([float(r[k]) for r in mine])) for k in ("cause", "iso", "disentangle")}
            lines.append({"method": method, "attribute": "average", **average})
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=SUMMARY_COLUMNS)
    writer.writeheader()
    writer.writerows([r for r in lines if r["attribute"] == "average"])
    write_atomically(out / "table.csv", table.getvalue())
    return lines


def write_heatmaps(out: Path, methods: list[str], attributes: list[str], all_attributes: list[str]) -> list[Path]:
    """DIR/<method>_changes.png for each method with a change rate in DIR/changes.csv (RAVEL Fig.
    3a); every one tried, the first not written raised (`plots.FigureNotWritten`)."""
    changes = read_rows(out / "changes.csv")

    def figures():
        for method in methods:
            matrix = np.full((len(attributes), len(all_attributes)), np.nan)
            for c in changes:
                if c["method"] == method and c["intervened"] in attributes and c["queried"] in all_attributes:
                    matrix[attributes.index(c["intervened"]), all_attributes.index(c["queried"])] = float(
                        c["change_rate"]
                    )
            if not np.isnan(matrix).all():
                title = f"{method}: P(answer changes)"
                yield attribute_figure(matrix, attributes, all_attributes, title), out / f"{method}_changes.png"

    return save_figures(figures(), dpi=120)


def main(args=None) -> None:
    """`lit-interventions sweep ravel`."""
    with report_figures():
        run_cli(distributed.printed_by_rank_zero(run_ravel_sweep), __doc__, args)
