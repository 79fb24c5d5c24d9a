"""AxBench concept dictionaries on a frozen LM: one module for every concept method.

Every concept of the dataset is a row of one `ConceptDictionary` (concepts × d), trained in one
run; an example only updates the row of its own concept. The method is a name of the one method
registry (`interventions.registry`: `diffmean`, `pca`, `lat`, `probe`, `lda`, `kmeans`, `random`,
`reft_r1`, `ssv`), a {class_path, init_args} config or an instance, and the module asks it by
capability.

Trained by gradient (a trained concept dictionary, a subclass of `ConceptDictionary`: automatic
optimization, AdamW + linear schedule; `reft_r1`, `ssv`): the method is the dictionary itself, an
intervention whose rows are allocated once the concepts are known. It gives the rows that train
(`trained_rows`) and Φ as its `forward` with no factor, called through `intervene` at the layer on
those rows at every token after the chat prefix; the module takes −log p(response)
(`steering_objective.py`), plus, for a `Penalised` one (ReFT-r1), `penalty_weight`·`penalty()`,
the weight set by `anneal(step, total)` before each step (`Annealed`). Unit-norm rows keep their
norm: the gradient component parallel to w_c is removed before each step and the rows are
renormalised after it.

With a preference `objective` (RePS; `method: reps` brings it), the rows train on preference
batches instead: each example's concept and original responses, steered at drawn factors or
nulled out, against the unsteered LM (`steering_objective.PreferenceObjective`); the LM's original
responses are generated first where the data has none.

Fitted in closed form (a direction estimator: `fit(X, y)` setting `direction_`, the classes of
`interventions.directions` or a user's own; no optimizer): `trainer.fit` runs one pass over the
training data, keeping the response tokens at the layer; the estimator is then fitted once per
concept (`steering_closed_form.py`): a supervised one on H⁺_c ∪ H⁻ (y = 1 for the concept's
positive tokens, 0 for the shared negative pool), an unsupervised one (`_supervised = False`) on
H⁺_c alone, oriented so that mean(H⁺_c)·w ≥ mean(H⁻)·w (`unsupervised_on="all"`: on H⁺_c ∪ H⁻).
This is a Lightning-native fit because Lightning still owns the loop: DDP sharding of the data (the kept
tokens of all ranks are gathered before the fit), device placement, validation, logging,
checkpointing and the export callback are the same as for the trained methods, and
`python train.py fit` serves all of them. The fit happens when the collected data is first needed:
at the start of validation (Lightning validates *before* `on_train_epoch_end`) or at the end of
the epoch; use `max_epochs: 1`.

Validation scores every row of the eval set for the concept it is evaluated for: token latents
Ψ(h_i) (the method's latent: h·w for a direction estimator, ReLU(h·w) for ReFT-r1 and SSV)
max-pooled over every token after the chat prefix (instruction and response, as AxBench's code;
`detect_on: response` pools the response text), never the end-of-turn token after the response
(AxBench's eval texts end at the response), min-max normalised per concept, AUROC per concept
(`val/auroc/<concept>`) and their mean (`val/auroc`).
The largest sequence score of each concept becomes its `max_activations` entry (the steering
unit of the released dictionary); a concept whose largest score is ≤ 0 (a dead ReFT-r1 row) gets
`DEAD_MAX_ACTIVATION`, as AxBench.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.base import BaseEstimator
from torch import nn

from lit_interventions.artifacts.dictionary import LATENTS, Dictionary, latent_values
from lit_interventions.callbacks.guard import NonFiniteError, likely_cause
from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.core.blocks import site_layer
from lit_interventions.core.forward import final_logits, read_layers, run_body
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.interventions.additive import ConceptDictionary, steering_units
from lit_interventions.interventions.base import class_path, import_class
from lit_interventions.interventions.capabilities import Annealed, Penalised, intervene, is_trained
from lit_interventions.interventions.registry import MethodSpec, method_spec, registered_methods
from lit_interventions.metrics.detection import detection_mask
from lit_interventions.metrics.judge_local import generate_replies
from lit_interventions.modules.site import FrozenLMModule
from lit_interventions.modules.steering_closed_form import (
    UNSUPERVISED_ON,
    fit_concept_rows,
    gathered_tokens,
    response_tokens,
)
from lit_interventions.modules.steering_objective import (
    PreferenceObjective,
    intervention_mask,
    null_or_add,
    response_logps,
)

DETECT_ON = ("content", "response")
_CONCEPT_METHODS = "lit_interventions.interventions.concept_methods"
# The class paths that the run configs and checkpoints of AxBench runs name (`train.py validate
# --config RUN/config.yaml`), none of them imported: the registered method each stands for, with
# the init_args it defaults to (AxBench's probe options). LATMethod's `pairs` is SteeringModule's
# `unsupervised_on`.
RUN_CONFIG_METHODS = {
    f"{_CONCEPT_METHODS}.DiffMeanMethod": ("diffmean", {}),
    f"{_CONCEPT_METHODS}.PCAMethod": ("pca", {}),
    f"{_CONCEPT_METHODS}.LATMethod": ("lat", {}),
    f"{_CONCEPT_METHODS}.ProbeMethod": ("probe", {"l2": 1e-3, "bias": False}),
    f"{_CONCEPT_METHODS}.ReFTR1Method": ("reft_r1", {}),
    f"{_CONCEPT_METHODS}.SSVMethod": ("ssv", {}),
}


def init_args(method: Any) -> dict:
    """A method's init args, each read from the attribute of its name (scikit-learn's convention)."""
    params = inspect.signature(type(method).__init__).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: getattr(method, p.name) for p in params if p.kind in kinds and hasattr(method, p.name)}


def _steering_class(cls: Any) -> bool:
    """Whether `SteeringModule` takes instances of `cls`: a trained concept dictionary (a subclass
    of `ConceptDictionary`, whose `forward` with no factor is its training form Φ), or a direction
    estimator (`fit`, not an `nn.Module`, which would be an interchange fitted on a site)."""
    if not isinstance(cls, type):
        return False
    if issubclass(cls, ConceptDictionary):
        return cls is not ConceptDictionary  # the plain dictionary holds fitted rows: no training form
    return callable(getattr(cls, "fit", None)) and not issubclass(cls, nn.Module) and not getattr(cls, "trains", False)


def steering_methods() -> list[str]:
    """The registered names `SteeringModule` takes (each class imported to ask it)."""
    names = []
    for name in registered_methods():
        try:
            cls = import_class(method_spec(name).class_path)
        except ValueError:  # a registered class that cannot be imported here
            continue
        if _steering_class(cls):
            names.append(name)
    return names


def registered_name(method: Any) -> str | None:
    """The first registered name whose class is the class of `method`, if any."""
    path = class_path(method)
    return next((name for name in registered_methods() if method_spec(name).class_path == path), None)


def method_option_error(option: str, value: Any, method: Any = None) -> Exception:
    """The error for a method's option given to `SteeringModule` itself: a ValueError naming the
    registered method whose class takes it (`option`, or `<name>_<key>` such as probe_l2) and the
    init_args key it belongs in, the method given preferred; a TypeError for an option no method has."""
    names = steering_methods()
    if isinstance(method, str) and method in names:
        names.remove(method)
        names.insert(0, method)
    for name in names:
        path = method_spec(name).class_path
        params = set(inspect.signature(import_class(path)).parameters)
        key = option if option in params else option.removeprefix(f"{name}_") if option.startswith(f"{name}_") else None
        if key in params:
            return ValueError(
                f"{option}={value!r} is an option of the {name} method, not of SteeringModule: give it in the "
                f"method's init_args (YAML: method: {{class_path: {path}, init_args: {{{key}: {value!r}}}}}; "
                f"CLI: --model.method {path} --model.method.{key} {value!r}; Python: "
                f"method={path.rpartition('.')[2]}({key}={value!r}))"
            )
    return TypeError(f"SteeringModule got an unexpected keyword argument {option!r}")


def method_of_config(method: str | dict) -> tuple[MethodSpec, str | None, dict]:
    """(the spec a name or {class_path, init_args} config builds, the registered name it was given
    by or None, SteeringModule options it sets). A name is a registered one or a class path; a
    class path of `RUN_CONFIG_METHODS` stands for its registered estimator."""
    if isinstance(method, str):
        if method in registered_methods():
            spec = method_spec(method)
            return spec, method, {"objective": spec.objective} if spec.objective else {}
        if "." not in method:
            raise ValueError(
                f"unknown method {method!r}; valid methods: {', '.join(steering_methods())}, a class path or "
                "a {class_path, init_args} config"
            )
        method = {"class_path": method}
    if "class_path" not in method or set(method) - {"class_path", "init_args"}:
        raise ValueError(f"a method config is {{class_path, init_args}}; got keys {sorted(method)}")
    path, given = method["class_path"], method.get("init_args") or {}
    if not isinstance(given, dict):
        raise ValueError(f"method {path!r}: init_args={given!r} must be a mapping")
    if path not in RUN_CONFIG_METHODS:
        return MethodSpec(path.rpartition(".")[2] or path, path, dict(given)), None, {}
    name, defaults = RUN_CONFIG_METHODS[path]
    args = {**defaults, **given}
    options = {"unsupervised_on": args.pop("pairs")} if "pairs" in args else {}
    spec = method_spec(name)
    return MethodSpec(name, spec.class_path, {**spec.init_args, **args}), name, options


def current_method_config(method: dict) -> tuple[dict, dict]:
    """(the {class_path, init_args} of the registered method an older run's config stands for,
    SteeringModule options it sets) for a class path of `RUN_CONFIG_METHODS`; any other config as
    it is, with no options. What a run config's YAML is read as (`cli.lightning`), so the parser
    never tries to import a class path of `RUN_CONFIG_METHODS` (none of them exists)."""
    if method.get("class_path") not in RUN_CONFIG_METHODS:
        return method, {}
    spec, _, options = method_of_config(method)
    return {"class_path": spec.class_path, "init_args": dict(spec.init_args)}, options


def build_method(method: Any, hidden: int, seed: int) -> tuple[Any, str, dict]:
    """(the built method, the name its dictionary card carries, SteeringModule options its config
    sets) of a registered name, a class path, a {class_path, init_args} config or an instance. A
    trained concept dictionary is built with no rows (given as an instance, it is used itself); a
    direction estimator is a copy whose `random_state` (where it has one) is `seed`. The card's
    name: the registered name it was given by, else its class's registered name, else its `name`
    attribute, else its class name."""
    name, options = None, {}
    if isinstance(method, (str, dict)):
        spec, name, options = method_of_config(method)
        cls = import_class(spec.class_path)
        if not _steering_class(cls):
            raise ValueError(_not_a_steering_method(cls))
        try:  # a trained dictionary's rows wait for the concepts (`ConceptDictionary.allocate`)
            built = cls(**spec.init_args) if issubclass(cls, ConceptDictionary) else spec.build(hidden, seed)
        except TypeError as err:
            raise ValueError(f"method {spec.class_path!r}: bad init_args {sorted(spec.init_args)}: {err}") from err
    elif _steering_class(type(method)):
        built = method if is_trained(method) else copy.deepcopy(method)
    else:
        raise ValueError(_not_a_steering_method(type(method)))
    if not is_trained(built) and "random_state" in init_args(built):
        built.random_state = seed
    own = getattr(built, "name", None)
    name = name or registered_name(built) or (own if isinstance(own, str) and own else type(built).__name__)
    return built, name, options


def preference_objective(objective: PreferenceObjective | dict | None) -> PreferenceObjective | None:
    """The preference objective of an instance or a {class_path, init_args} config (None: none);
    the class must be `PreferenceObjective` or a subclass."""
    if objective is None or isinstance(objective, PreferenceObjective):
        return objective
    if not isinstance(objective, dict) or "class_path" not in objective or set(objective) - {"class_path", "init_args"}:
        raise ValueError(f"objective={objective!r}: a PreferenceObjective or its {{class_path, init_args}} config")
    cls = import_class(objective["class_path"])
    if not (isinstance(cls, type) and issubclass(cls, PreferenceObjective)):
        raise ValueError(f"objective: {objective['class_path']!r} is not a PreferenceObjective")
    return cls(**(objective.get("init_args") or {}))


def _not_a_steering_method(cls: type) -> str:
    return (
        f"{getattr(cls, '__name__', cls)!r} is neither a direction estimator (fit(X, y) setting direction_, not an "
        f"nn.Module) nor a trained concept dictionary (a subclass of ConceptDictionary); registered methods "
        f"SteeringModule takes: {', '.join(steering_methods())}"
    )


class SteeringModule(FrozenLMModule):
    """A concept dictionary (concepts × d) at one layer of a frozen LM, by one concept method.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (see `lit_interventions.core.lm`).
        layer: residual stream after this block (−1: embeddings). Default: the middle layer.
        method: the concept method, with its own options: a registered name (`interventions.registry`:
            reft_r1, ssv trained; diffmean, pca, lat, probe, lda, kmeans, random direction
            estimators, fitted per concept), built with its registered init_args; a class path or a
            {class_path, init_args} config (YAML: `method: {class_path:
            lit_interventions.interventions.directions.ProbeDirection, init_args: {l2: 0.001, bias:
            false}}`); or an instance, e.g. `ReFTR1Dictionary(topk=8)`, whose rows are allocated
            here once the concepts are known. A direction estimator's
            `random_state` is `direction_seed`. `probe` is `ProbeDirection`'s defaults (a bias,
            CausalGym's λ table); AxBench's probe is `{l2: 0.001, bias: false}` (configs/probe.yaml).
        concept_names: the concept names, one per row (concept_id indexes them). None: taken from
            the data module's `.concepts` when fit/validate starts (`configure_model`). Not called
            `concepts`, which the data module uses for concept ids (Lightning merges both hparams).
        exclude_prefix: a trained method intervenes (and ReFT-r1 runs the TopK and the L1 term) only
            after the chat prefix (`content_mask`; AxBench's `exclude_bos`). False: every token.
        detect_on: the tokens detection max-pools over: "content" (every token after the chat
            prefix, instruction included: AxBench's code) or "response" (the response text);
            neither includes the end-of-turn token after the response.
        unsupervised_on: the tokens an unsupervised direction estimator (pca, lat, kmeans, random)
            is fitted on: "positives", H⁺_c (AxBench's code; H⁻ only orients it), or "all", H⁺_c ∪ H⁻.
        lr, weight_decay: AdamW of a trained method; warmup_ratio: linear warmup share, then linear
            decay to 0.
        dtype: the LM's dtype (float32, bfloat16, float16).
        direction_seed: initial directions (ReFT-r1) and the `random_state` of a direction
            estimator (random pairs, solvers) (not `seed`, the data module's shuffling seed).
        objective: None, the LM objective above; or RePS's preference objective (a
            `PreferenceObjective` or its {class_path, init_args}; the registered `reps` brings its
            own) for a trained dictionary, on a data module with `preference: true`
            (`steering_objective.py`).
        device_map, quantization, max_memory, offload_folder: where the frozen LM is placed, for
            one larger than a GPU (`lit_interventions.core.sharding`): e.g. device_map "auto" spreads
            it over the GPUs, quantization "4bit" loads it in NF4; the trained weights stay float32.
        kwargs: a method's option given here (e.g. topk, l1, train_on_negative, probe_l2) is a
            ValueError naming the registered method and the init_args key it belongs in.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        method: ConceptDictionary | BaseEstimator | str | dict = "reft_r1",
        concept_names: list[str] | None = None,
        exclude_prefix: bool = True,
        detect_on: str = "content",
        unsupervised_on: str = "positives",
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        dtype: str = "float32",
        direction_seed: int = 0,
        objective: PreferenceObjective | dict | None = None,
        device_map: str | int | dict | None = None,
        quantization: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | None = None,
        **kwargs,
    ):
        super().__init__()
        if kwargs:
            raise method_option_error(*next(iter(kwargs.items())), method)
        check_dtype(dtype)  # before anything is loaded
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)
        if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        if detect_on not in DETECT_ON:
            raise ValueError(f"detect_on={detect_on!r}; valid: {', '.join(DETECT_ON)}")
        if unsupervised_on not in UNSUPERVISED_ON:
            raise ValueError(f"unsupervised_on={unsupervised_on!r}; valid: {', '.join(UNSUPERVISED_ON)}")
        self.optimizer_args = OptimizerArgs(lr, warmup_ratio, "adamw", weight_decay)  # validates them
        config = load_config(lm)  # the config only: the layer is checked before weights load
        layer = site_layer(config, layer)
        self._hidden_size = hidden_size(config)
        built, self.method_name, options = build_method(method, self._hidden_size, direction_seed)
        self._frozen: dict[str, object] = {"tokens": [], "method": built}  # not in state_dict
        self._trains = is_trained(built)
        self.unsupervised_on = options.get("unsupervised_on", unsupervised_on)
        if self.latent not in LATENTS:
            raise ValueError(f"{self.method!r} declares latent={self.latent!r}; valid: {', '.join(LATENTS)}")
        self.objective = preference_objective(options.get("objective") if objective is None else objective)
        if self.objective is not None and not self._trains:
            raise ValueError(
                f"objective: the preference objective (RePS) trains a concept dictionary; {self.method_name} is "
                "fitted in closed form (use method: ssv or reps)"
            )
        if self.objective is not None and self.method_name != "reps":  # the card names the objective too
            self.method_name = "reps" if self.method_name == "ssv" else f"reps_{self.method_name}"
        given = isinstance(method, (str, dict))
        self.save_hyperparameters(ignore=["objective"] if given else ["method", "objective"])
        self.hparams.objective = None if self.objective is None else self.objective.config()
        self.hparams.layer = layer
        if not given:  # a config that builds it again (checkpoints hold no objects)
            self.hparams.method = {"class_path": class_path(self.method), "init_args": init_args(self.method)}
        self.automatic_optimization = self._trains
        self.dictionary: ConceptDictionary | None = None
        if concept_names is not None:
            self._build(list(concept_names))

    @property
    def method(self) -> ConceptDictionary | Any:
        """The concept method: a trained concept dictionary (once its rows are allocated, the
        module's `dictionary` itself) or a direction estimator."""
        return self._frozen["method"]

    @property
    def latent(self) -> str:
        """How a latent is read from h·w: the trained dictionary's `latent`, "linear" for a direction."""
        return self.method.latent if self._trains else "linear"

    @property
    def unit_norm(self) -> bool:
        """Whether the rows stay unit norm: the trained dictionary's `unit_norm`; a direction always is."""
        return self.method.unit_norm if self._trains else True

    # --- set-up ------------------------------------------------------------------------------

    def _build(self, concepts: list[str]) -> None:
        if not concepts or len(set(concepts)) != len(concepts):
            raise ValueError(f"concepts must be a non-empty list of distinct names; got {concepts!r}")
        self.hparams.concept_names = [str(c) for c in concepts]
        n, seed = len(concepts), self.hparams.direction_seed
        if self._trains:  # the method's own rows, trained
            self.dictionary = self.method.allocate(n, self._hidden_size, seed)
        else:  # the rows the direction estimator fits
            self.dictionary = ConceptDictionary(n, self._hidden_size, unit_norm=True, seed=seed)
        self.register_buffer("max_activations", torch.full((n,), float("nan")))

    def configure_model(self) -> None:
        """Concept names from the data module when none were given (called after its setup)."""
        if self.dictionary is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            concepts = getattr(datamodule, "concepts", None)
            if not concepts:
                raise ValueError(
                    "SteeringModule needs concept names: pass concept_names=[...] or use a data module "
                    "with a .concepts list"
                )
            self._build(list(concepts))

    @property
    def concepts(self) -> list[str]:
        return list(self.hparams.concept_names or [])

    # --- detection ----------------------------------------------------------------------------

    def states(self, batch) -> torch.Tensor:
        """The frozen LM's residual stream at the layer, (batch, seq, d)."""
        layer = self.hparams.layer
        return read_layers(self.lm, [layer], batch["input_ids"], batch["attention_mask"])[layer]

    def token_scores(self, hidden: torch.Tensor, concept_id: torch.Tensor) -> torch.Tensor:
        """Ψ(h_i) of each row's concept at every token, (batch, seq): the method's latent, h·w or
        ReLU(h·w)."""
        return latent_values(self.dictionary.projections(hidden, concept_id), self.latent)

    # --- trained methods ----------------------------------------------------------------------

    def intervention_mask(self, batch) -> torch.Tensor:
        """Where the trained methods intervene, (batch, seq): see `steering_objective.intervention_mask`."""
        return intervention_mask(batch, self.hparams.exclude_prefix)

    def trained_rows(self, batch) -> torch.Tensor:
        """The rows that get the intervention and the LM loss, (batch,): the method's `trained_rows`."""
        return self.method.trained_rows(batch)

    def _steered_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(−log p(response) of the trained rows under the intervention, the L1 term) for a batch."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        trained = self.trained_rows(batch)  # (batch,)
        context = {"concept_id": batch["concept_id"], "where": self.intervention_mask(batch), "rows": trained}

        def edit(hidden):  # Φ at the layer, (batch, seq, d): the dictionary's training form
            return intervene(self.dictionary, hidden, **context)

        penalised = isinstance(self.dictionary, Penalised)
        targets = batch["response_mask"][:, 1:].bool() & trained[:, None]  # token t+1 is predicted at t
        if targets.any():
            with residual_hook(self.lm, self.hparams.layer, edit, self.device):
                final = run_body(self.lm, ids, mask).last_hidden_state  # (batch, seq, d)
            logits = final_logits(self.lm, final[:, :-1][targets])  # (n_targets, vocab)
            lm_loss = F.cross_entropy(logits.float(), ids[:, 1:][targets])
        else:  # nothing to predict (the sum keeps the graph for DDP)
            lm_loss = self.dictionary.weight.sum() * 0.0
            if penalised:
                edit(self.states(batch))  # the L1 term needs only the states at the layer
        if not penalised:
            return lm_loss, lm_loss.detach() * 0.0
        return lm_loss, self.dictionary.penalty()

    def _preference_loss(self, batch) -> tuple[torch.Tensor, dict]:
        """RePS's loss of a preference batch (`PreferenceObjective.loss`): each policy sequence
        steered by its row's vector at its factor, h + α·w_c (α = 0: the null-out edit), at the
        tokens of `intervention_mask`; the reference is the LM without the edit."""
        ids, mask, targets = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        where, concept_id = self.intervention_mask(batch), batch["concept_id"]

        def reference() -> torch.Tensor:
            return response_logps(self.lm, ids, mask, targets)

        def policy(rows: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
            rows = rows.to(ids.device)
            w = self.dictionary.rows(concept_id[rows])  # (n, d)

            def edit(hidden):
                return null_or_add(hidden, w, factors, where[rows])

            with residual_hook(self.lm, self.hparams.layer, edit, self.device):
                return response_logps(self.lm, ids[rows], mask[rows], targets[rows])

        return self.objective.loss(batch, policy, reference, self._frozen["draws"])

    def _prepare_preference(self, datamodule) -> None:
        """RePS's data: a data module with `preference: true`, whose training instructions get the
        LM's greedy original responses where the data holds none; the factors' random draws."""
        if not getattr(datamodule, "preference", False):
            raise ValueError(
                "objective: the preference objective (RePS) trains on preference examples; set the data "
                "module's preference: true (AxBenchDataModule)"
            )
        missing = datamodule.missing_originals()
        if missing:
            steps = self.objective.max_new_tokens
            self.print(f"generating the LM's original responses to {len(missing)} instructions ({steps} tokens)")
            texts = datamodule.prompt_texts(missing)
            replies = generate_replies(self.lm, datamodule.tokenizer, texts, steps, batch_size=16)
            datamodule.set_original_responses(dict(zip(missing, replies)))
        self._frozen["draws"] = torch.Generator().manual_seed(self.hparams.direction_seed)

    def on_fit_start(self):
        """The method refuses a data module that does not suit it (ReFT-r1 with `train_on_negative`
        needs negatives carrying their concept's id); a direction is fitted against the shared pool."""
        if self.objective is not None:
            return
        genre_negatives = getattr(getattr(self.trainer, "datamodule", None), "genre_negatives", None)
        if self._trains:
            self.method.check_data(genre_negatives)
        elif genre_negatives is True:
            raise ValueError(
                f"{self.method_name} is fitted against the shared negative pool: set the data module's "
                "genre_negatives: false"
            )

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            return self._collect(batch)
        if self.objective is not None:
            loss, metrics = self._preference_loss(batch)
            size = int(batch["pairs"])
            self.log("train/loss", loss, prog_bar=True, batch_size=size)
            self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=size)
            return loss
        if isinstance(self.dictionary, Annealed):  # ReFT-r1's λ_t = λ·step/total
            self.dictionary.anneal(self.global_step, self.trainer.estimated_stepping_batches)
        lm_loss, l1 = self._steered_loss(batch)
        penalised = isinstance(self.dictionary, Penalised)
        loss = lm_loss + (self.dictionary.penalty_weight if penalised else 0.0) * l1
        size = len(batch["label"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lm_loss", lm_loss, batch_size=size)
        if penalised:
            self.log("train/l1", l1, batch_size=size)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.dictionary.remove_parallel_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.automatic_optimization:
            self.dictionary.renormalise()

    def configure_optimizers(self):
        """AdamW + linear schedule for a trained method. The preference objective first prepares
        its data (`_prepare_preference`), the LM on its device: the schedule's length reads the
        train loader, which needs the original responses."""
        if not self.automatic_optimization:
            return None
        if self.objective is not None and "draws" not in self._frozen:
            self._prepare_preference(getattr(self.trainer, "datamodule", None))
        return self.optimizer_args.lightning(self.dictionary.parameters(), self.trainer.estimated_stepping_batches)

    # --- closed-form methods --------------------------------------------------------------------

    @torch.no_grad()
    def _collect(self, batch) -> None:
        """Keep the response tokens of this batch: positives with their concept, negatives as −1."""
        self._frozen["tokens"].append(response_tokens(self.states(batch), batch, self.method_name))
        self._frozen["pending"] = True

    @torch.no_grad()
    def fit_closed_form(self) -> None:
        """Fit every concept's row from the tokens collected so far (all processes), saying so in
        one line (rank 0): the method, its positive tokens and concepts, its negative tokens."""
        if not self._frozen.pop("pending", False):
            return
        hidden, labels = gathered_tokens(self._frozen["tokens"], self._hidden_size, self.device)
        self.print(
            f"fitting {self.method_name} in closed form on {int((labels >= 0).sum())} response tokens of "
            f"{len(self.concepts)} concepts and {int((labels == -1).sum())} negative tokens"
        )
        bad = ~torch.isfinite(hidden).all(-1)
        if bad.any():
            raise NonFiniteError(
                f"the LM's residual stream at layer {self.hparams.layer} is NaN/inf at {int(bad.sum())} "
                f"of {len(hidden)} training tokens; likely cause: {likely_cause(self.trainer, self)}. "
                "Nothing was fitted or exported."
            )
        rows = fit_concept_rows(self.method, hidden, labels, self.concepts, self.unsupervised_on)
        if tuple(rows.shape) != tuple(self.dictionary.weight.shape):
            raise ValueError(
                f"{type(self.method).__name__} gave directions of shape {tuple(rows.shape[1:])}; expected "
                f"({self.dictionary.weight.shape[1]},), the hidden size"
            )
        self.dictionary.weight.data.copy_(rows.to(self.dictionary.weight))

    def on_train_epoch_start(self):
        self._frozen["tokens"] = []

    def on_train_epoch_end(self):
        if not self.automatic_optimization:
            self.fit_closed_form()

    # --- validation and test ------------------------------------------------------------------

    def detection_mask(self, batch) -> torch.Tensor:
        """The tokens detection max-pools over, (batch, seq), at this module's `detect_on`
        (`metrics.detection.detection_mask`)."""
        return detection_mask(batch, self.hparams.detect_on)

    def _evaluate(self, batch) -> dict:
        """The standard output the `AUROCCallback` reads: Ψ(h_i) of each row's concept, (batch, seq),
        and the tokens it max-pools over (`detect_on`: every token after the chat prefix, as
        AxBench's code, or the response only)."""
        scores = self.token_scores(self.states(batch), batch["concept_id"])
        return {"token_scores": scores, "pool_mask": self.detection_mask(batch)}

    def on_validation_epoch_start(self):
        if not self.automatic_optimization:
            self.fit_closed_form()

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch)

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch)

    def configure_callbacks(self):
        """Detection is scored by the AxBench AUROC callback unless the Trainer already has one."""
        present = {type(callback) for callback in self.trainer.callbacks}
        return [] if AUROCCallback in present else [AUROCCallback()]

    def record_detection(self, stage: str, result: dict) -> None:
        """Called by the `AUROCCallback` with its computed result: the largest sequence score of
        each concept on the validation set becomes its max activation (the steering unit), see
        `steering_units`."""
        seen = ~torch.isnan(result["max_score"])
        if stage == "val" and not self.trainer.sanity_checking:
            self.max_activations[seen] = steering_units(result["max_score"][seen]).to(self.max_activations)
        auroc = {
            "mean": float(result["auroc"]),
            "per_concept": {n: float(v) for n, v in zip(self.concepts, result["auroc_per_concept"])},
        }
        if stage == "test":
            self._frozen["test_auroc"] = auroc
        elif not self.trainer.sanity_checking:
            self._frozen["val_auroc"] = auroc

    # --- export -------------------------------------------------------------------------------

    def to_dictionary(self, training_data: str | None = None) -> Dictionary:
        """The released dictionary: rows, names, max activations, last validation AUROC."""
        own = self.method.card() if self._trains else {}
        card = {"model_type": getattr(load_config(self.hparams.lm), "model_type", None), **own}
        return Dictionary(
            vectors=self.dictionary.weight.detach(),
            max_activations=self.max_activations,
            concepts=self.concepts,
            model=self.hparams.lm,
            layer=self.hparams.layer,
            method=self.method_name,
            latent=self.latent,
            training_data=training_data,
            auroc=self._frozen.get("val_auroc"),
            card=card,
        )
