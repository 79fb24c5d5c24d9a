"""AxBench concept dictionaries on a frozen LM: one module for every concept method.

Every concept of the dataset is a row of one `ConceptDictionary` (concepts × d), trained in one
run; an example only updates the row of its own concept. The method is an object
(`lit_interventions.interventions.concept_methods`; built by `concept_registry` from a short name,
a {class_path, init_args} config or an instance) that holds its own options and formulas; the
module asks it by capability.

Trained by gradient (`trains`: automatic optimization, AdamW + linear schedule; `reft_r1`,
`ssv`): the method gives the rows that train, Φ written at the layer and, if `L1Penalised`, the
L1 term and its weight; the module runs the forward with Φ at every token after the chat prefix
and takes −log p(response) (`steering_objective.py`). Unit-norm rows keep their norm: the
gradient component parallel to w_c is removed before each step and the rows are renormalised
after it.

Fitted in closed form (`Fitted`, no optimizer; `diffmean`, `pca`, `lat`, `probe`): `trainer.fit`
runs one pass over the training data, keeping the response tokens at the layer; the method's
`fit` then gives every concept's row (`steering_closed_form.py` keeps the tokens). This is a
Lightning-native fit because Lightning still owns the loop: DDP sharding of the data (the kept
tokens of all ranks are gathered before the fit), device placement, validation, logging,
checkpointing and the export callback are the same as for the trained methods, and
`python train.py fit` serves all six. The fit happens when the collected data is first needed:
at the start of validation (Lightning validates *before* `on_train_epoch_end`) or at the end of
the epoch; use `max_epochs: 1`.

Validation scores every row of the eval set for the concept it is evaluated for: token latents
Ψ(h_i) (the method's latent: h·w, or ReLU(h·w) for ReFT-r1 and SSV) max-pooled over every token
after the chat prefix (instruction and response, as AxBench's code; `detect_on: response` pools
the response text), never the end-of-turn token after the response (AxBench's eval texts end at
the response), min-max normalised per concept, AUROC per concept (`val/auroc/<concept>`) and their
mean (`val/auroc`).
The largest sequence score of each concept becomes its `max_activations` entry (the steering
unit of the released dictionary); a concept whose largest score is ≤ 0 (a dead ReFT-r1 row) gets
`DEAD_MAX_ACTIVATION`, as AxBench.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_interventions.artifacts.dictionary import LATENTS, Dictionary, latent_values
from lit_interventions.callbacks.guard import NonFiniteError, likely_cause
from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.core.blocks import site_layer
from lit_interventions.core.forward import final_logits, read_layers, run_body
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.interventions.additive import ConceptDictionary, steering_units
from lit_interventions.interventions.capabilities import is_trained
from lit_interventions.interventions.concept_methods import ConceptMethod, L1Penalised
from lit_interventions.interventions.concept_registry import concept_method, method_config
from lit_interventions.modules.site import FrozenLMModule
from lit_interventions.modules.steering_closed_form import (
    gathered_tokens,
    response_tokens,
)
from lit_interventions.modules.steering_objective import intervention_mask

DETECT_ON = ("content", "response")
# A concept method's options by the names of SteeringModule arguments: (method, its init_args key).
METHOD_OPTIONS = {
    "topk": ("reft_r1", "topk"),
    "l1": ("reft_r1", "l1"),
    "l1_ramp": ("reft_r1", "l1_ramp"),
    "negative_l1": ("reft_r1", "negative_l1"),
    "train_on_negative": ("reft_r1", "train_on_negative"),
    "lat_pairs": ("lat", "pairs"),
    "probe_l2": ("probe", "l2"),
}


def method_option_error(name: str, value) -> Exception:
    """The error for a concept method's option given to `SteeringModule` itself: a ValueError naming
    the method and the init_args key it belongs in (a TypeError for a name no method has)."""
    if name not in METHOD_OPTIONS:
        return TypeError(f"SteeringModule got an unexpected keyword argument {name!r}")
    method, key = METHOD_OPTIONS[name]
    path = method_config(concept_method(method))["class_path"]
    return ValueError(
        f"{name}={value!r} is an option of the {method} method, not of SteeringModule: give it in the "
        f"method's init_args (YAML: method: {{class_path: {path}, init_args: {{{key}: {value!r}}}}}; "
        f"CLI: --model.method {path} --model.method.{key} {value!r}; Python: "
        f"method={path.rpartition('.')[2]}({key}={value!r}))"
    )


class SteeringModule(FrozenLMModule):
    """A concept dictionary (concepts × d) at one layer of a frozen LM, by one concept method.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (see `lit_interventions.core.lm`).
        layer: residual stream after this block (−1: embeddings). Default: the middle layer.
        method: the concept method (`lit_interventions.interventions.concept_methods`), with its own
            options: a short name, reft_r1, ssv (trained) or diffmean, pca, lat, probe (closed form),
            built with its defaults; a {class_path, init_args} config (YAML: `method: {class_path:
            lit_interventions.interventions.concept_methods.ReFTR1Method, init_args: {topk: 8}}`);
            or an instance, e.g. `ReFTR1Method(topk=8)`.
        concept_names: the concept names, one per row (concept_id indexes them). None: taken from
            the data module's `.concepts` when fit/validate starts (`configure_model`). Not called
            `concepts`, which the data module uses for concept ids (Lightning merges both hparams).
        exclude_prefix: a trained method intervenes (and ReFT-r1 runs the TopK and the L1 term) only
            after the chat prefix (`content_mask`; AxBench's `exclude_bos`). False: every token.
        detect_on: the tokens detection max-pools over: "content" (every token after the chat
            prefix, instruction included: AxBench's code) or "response" (the response text);
            neither includes the end-of-turn token after the response.
        lr, weight_decay: AdamW of a trained method; warmup_ratio: linear warmup share, then linear
            decay to 0.
        dtype: the LM's dtype (float32, bfloat16, float16).
        direction_seed: initial directions (ReFT-r1) and the random pairs / solvers of the closed
            forms (not `seed`, the data module's shuffling seed).
        device_map, quantization, max_memory, offload_folder: where the frozen LM is placed, for
            one larger than a GPU (`lit_interventions.core.sharding`): e.g. device_map "auto" spreads
            it over the GPUs, quantization "4bit" loads it in NF4; the trained weights stay float32.
        kwargs: a method's option given here (topk, l1, l1_ramp, negative_l1, train_on_negative,
            lat_pairs, probe_l2) is a ValueError naming the method's init_args it belongs in.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        method: ConceptMethod | str = "reft_r1",
        concept_names: list[str] | None = None,
        exclude_prefix: bool = True,
        detect_on: str = "content",
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        dtype: str = "float32",
        direction_seed: int = 0,
        device_map: str | int | dict | None = None,
        quantization: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | None = None,
        **kwargs,
    ):
        super().__init__()
        if kwargs:
            raise method_option_error(*next(iter(kwargs.items())))
        check_dtype(dtype)  # before anything is loaded
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)
        if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        self.method = concept_method(method)
        if self.method.latent not in LATENTS:
            raise ValueError(f"{self.method!r} declares latent={self.method.latent!r}; valid: {', '.join(LATENTS)}")
        if detect_on not in DETECT_ON:
            raise ValueError(f"detect_on={detect_on!r}; valid: {', '.join(DETECT_ON)}")
        self.optimizer_args = OptimizerArgs(lr, warmup_ratio, "adamw", weight_decay)  # validates them
        config = load_config(lm)  # the config only: the layer is checked before weights load
        layer = site_layer(config, layer)
        self.save_hyperparameters()
        self.hparams.layer = layer
        if isinstance(method, ConceptMethod):  # a config that builds it again (checkpoints hold no objects)
            self.hparams.method = method_config(method)
        self.automatic_optimization = is_trained(self.method)
        self._hidden_size = hidden_size(config)
        self._frozen: dict[str, object] = {"tokens": []}  # the LM and collected states: not in state_dict
        self.dictionary: ConceptDictionary | None = None
        if concept_names is not None:
            self._build(list(concept_names))

    # --- set-up ------------------------------------------------------------------------------

    def _build(self, concepts: list[str]) -> None:
        if not concepts or len(set(concepts)) != len(concepts):
            raise ValueError(f"concepts must be a non-empty list of distinct names; got {concepts!r}")
        self.hparams.concept_names = [str(c) for c in concepts]
        n = len(concepts)
        self.dictionary = ConceptDictionary(
            n,
            self._hidden_size,
            unit_norm=self.method.unit_norm,
            seed=self.hparams.direction_seed,
            fill=self.method.init,
        )
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
        return latent_values(self.dictionary.projections(hidden, concept_id), self.method.latent)

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
        where = self.intervention_mask(batch)  # (batch, seq)
        trained = self.trained_rows(batch)  # (batch,)
        w = self.dictionary.weight[batch["concept_id"].clamp(min=0)]  # (batch, d); unused on untrained rows
        seen: dict[str, torch.Tensor] = {}
        intervene = self.method.intervention(w, where, trained, seen)
        penalised = isinstance(self.method, L1Penalised)
        targets = batch["response_mask"][:, 1:].bool() & trained[:, None]  # token t+1 is predicted at t
        if targets.any():
            with residual_hook(self.lm, self.hparams.layer, intervene, self.device):
                final = run_body(self.lm, ids, mask).last_hidden_state  # (batch, seq, d)
            logits = final_logits(self.lm, final[:, :-1][targets])  # (n_targets, vocab)
            lm_loss = F.cross_entropy(logits.float(), ids[:, 1:][targets])
        else:  # nothing to predict (the sum keeps the graph for DDP)
            lm_loss = self.dictionary.weight.sum() * 0.0
            if penalised:
                intervene(self.states(batch))  # the L1 term needs only the states at the layer
        if not penalised:
            return lm_loss, lm_loss.detach() * 0.0
        return lm_loss, self.method.l1_term(seen, trained, where, self.dictionary.weight)

    def on_fit_start(self):
        """The method refuses a data module that does not suit it (ReFT-r1 with `train_on_negative`
        needs negatives carrying their concept's id; a closed form fits against the shared pool)."""
        self.method.check_data(getattr(getattr(self.trainer, "datamodule", None), "genre_negatives", None))

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            return self._collect(batch)
        lm_loss, l1 = self._steered_loss(batch)
        loss = lm_loss + self.l1_coefficient() * l1
        size = len(batch["label"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lm_loss", lm_loss, batch_size=size)
        if isinstance(self.method, L1Penalised):
            self.log("train/l1", l1, batch_size=size)
        return loss

    def l1_coefficient(self) -> float:
        """λ at this step, as the method weighs its L1 term (0 for a method without one)."""
        if not isinstance(self.method, L1Penalised):
            return 0.0
        return self.method.l1_coefficient(self.global_step, self.trainer.estimated_stepping_batches)

    def on_before_optimizer_step(self, optimizer):
        self.dictionary.remove_parallel_grad()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.automatic_optimization:
            self.dictionary.renormalise()

    def configure_optimizers(self):
        if not self.automatic_optimization:
            return None
        return self.optimizer_args.lightning(self.dictionary.parameters(), self.trainer.estimated_stepping_batches)

    # --- closed-form methods --------------------------------------------------------------------

    @torch.no_grad()
    def _collect(self, batch) -> None:
        """Keep the response tokens of this batch: positives with their concept, negatives as −1."""
        self._frozen["tokens"].append(response_tokens(self.states(batch), batch, self.method.name))
        self._frozen["pending"] = True

    @torch.no_grad()
    def fit_closed_form(self) -> None:
        """Fit every concept's row from the tokens collected so far (all processes)."""
        if not self._frozen.pop("pending", False):
            return
        hidden, labels = gathered_tokens(self._frozen["tokens"], self._hidden_size, self.device)
        bad = ~torch.isfinite(hidden).all(-1)
        if bad.any():
            raise NonFiniteError(
                f"the LM's residual stream at layer {self.hparams.layer} is NaN/inf at {int(bad.sum())} "
                f"of {len(hidden)} training tokens; likely cause: {likely_cause(self.trainer, self)}. "
                "Nothing was fitted or exported."
            )
        rows = self.method.fit(hidden, labels, self.concepts, seed=self.hparams.direction_seed)
        if tuple(rows.shape) != tuple(self.dictionary.weight.shape):
            raise ValueError(
                f"{self.method!r}.fit gave rows of shape {tuple(rows.shape)}; expected {tuple(self.dictionary.weight.shape)}"
            )
        self.dictionary.weight.data.copy_(rows.to(self.dictionary.weight))

    def on_train_epoch_start(self):
        self._frozen["tokens"] = []

    def on_train_epoch_end(self):
        if not self.automatic_optimization:
            self.fit_closed_form()

    # --- validation and test ------------------------------------------------------------------

    def detection_mask(self, batch) -> torch.Tensor:
        """The tokens detection max-pools over, (batch, seq): see `detect_on`. The end-of-turn
        token the data appends after a response (`response_mask` beyond `output_mask`) is left
        out of both, as AxBench's eval inputs stop at the response text."""
        text = batch.get("output_mask", batch["response_mask"]).bool()
        if self.hparams.detect_on == "response" or "content_mask" not in batch:
            return text
        end_of_turn = batch["response_mask"].bool() & ~text
        return batch["content_mask"].bool() & batch["attention_mask"].bool() & ~end_of_turn

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
        card = {"model_type": getattr(load_config(self.hparams.lm), "model_type", None), **self.method.card()}
        return Dictionary(
            vectors=self.dictionary.weight.detach(),
            max_activations=self.max_activations,
            concepts=self.concepts,
            model=self.hparams.lm,
            layer=self.hparams.layer,
            method=self.method.name,
            latent=self.method.latent,
            training_data=training_data,
            auroc=self._frozen.get("val_auroc"),
            card=card,
        )
