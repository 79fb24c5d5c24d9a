"""AxBench concept dictionaries on a frozen LM: one module for all six rank-1 methods.

Every concept of the dataset is a row of one `ConceptDictionary` (concepts × d), trained in one
run; an example only updates the row of its own concept.

Trained by gradient (automatic optimization, AdamW + linear schedule; `steering_objective.py`
gives the formulas and the loss):
- `reft_r1`: Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c at every token after the chat prefix,
  loss −log p(response) + λ·Σ_{non-top-k}|latent| (AxBench eqs. 9–10), λ ramped up from 0
  (`l1_ramp`); by default (`train_on_negative: true`) each concept also trains on the negatives
  of its genre. w_c stays unit norm: the gradient component parallel to w_c is removed before
  each step and the rows are renormalised after it.
- `ssv`: Φ(h_i) = h_i + w_c at every token after the chat prefix of a positive example; loss
  −log p(response); w free norm (AxBench eqs. 6–7).

Closed form (no optimizer): `diffmean`, `pca`, `lat`, `probe`. `trainer.fit` runs one pass
over the training data, keeping the response tokens at the layer; each concept's row is then
fitted in closed form (`steering_closed_form.py`, which gives the formulas). This is a
Lightning-native fit because Lightning still owns the loop: DDP sharding of the data (the kept
tokens of all ranks are gathered before the fit), device placement, validation, logging,
checkpointing and the export callback are the same as for the trained methods, and
`python train.py fit` serves all six. The fit happens when the collected data is first needed:
at the start of validation (Lightning validates *before* `on_train_epoch_end`) or at the end of
the epoch; use `max_epochs: 1`.

Validation scores every row of the eval set for the concept it is evaluated for: token latents
Ψ(h_i) (h·w, or ReLU(h·w) for ReFT-r1 and SSV) max-pooled over every token after the chat prefix
(instruction and response, as AxBench's code; `detect_on: response` pools the response), min-max
normalised per concept, AUROC per concept (`val/auroc/<concept>`) and their mean (`val/auroc`).
The largest sequence score of each concept becomes its `max_activations` entry (the steering
unit of the released dictionary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_interventions.artifacts.dictionary import RELU_METHODS, Dictionary
from lit_interventions.callbacks.guard import NonFiniteError, likely_cause
from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.core.sites import final_logits, read_layers, residual_hook, run_body, site_layer
from lit_interventions.interventions.additive import ConceptDictionary
from lit_interventions.modules.site import FrozenLMModule
from lit_interventions.modules.steering_closed_form import (  # noqa: F401  (re-exported: the closed-form fit)
    CLOSED_FORM,
    concept_directions,
    fit_concept_direction,
    gathered_tokens,
    response_tokens,
)
from lit_interventions.modules.steering_objective import (
    intervention_mask,
    l1_term,
    steering_intervention,
    trained_rows,
)

TRAINED = ("reft_r1", "ssv")
DETECT_ON = ("content", "response")
LAT_PAIRS = ("positives", "all")
STEERING_METHODS = TRAINED + CLOSED_FORM


class SteeringModule(FrozenLMModule):
    """A concept dictionary (concepts × d) at one layer of a frozen LM, by one AxBench method.

    Args:
        lm: embedded name, .gguf file, local directory or hub id (see `lit_interventions.core.lm`).
        layer: residual stream after this block (−1: embeddings). Default: the middle layer.
        method: reft_r1, ssv (trained) or diffmean, pca, lat, probe (closed form).
        concept_names: the concept names, one per row (concept_id indexes them). None: taken from
            the data module's `.concepts` when fit/validate starts (`configure_model`). Not called
            `concepts`, which the data module uses for concept ids (Lightning merges both hparams).
        topk: k of ReFT-r1's TopK. l1: λ of ReFT-r1's L1 term.
        l1_ramp: λ grows linearly from 0, λ·step/total_steps (AxBench's code); False: constant λ.
        negative_l1: ReFT-r1 also applies the L1 term to the negative pool (see the module doc).
        train_on_negative: ReFT-r1 also trains on each concept's genre-matched negatives (the same
            TopK intervention and LM loss; AxBench's sweeps). Needs the data module's
            `genre_negatives: true`. False: positives only.
        exclude_prefix: ReFT-r1 and SSV intervene (and ReFT-r1 runs the TopK and the L1 term) only
            after the chat prefix (`content_mask`; AxBench's `exclude_bos`). False: every token.
        detect_on: the tokens detection max-pools over: "content" (every token after the chat
            prefix, instruction included: AxBench's code) or "response".
        lat_pairs: LAT's random pairs from the concept's "positives" (AxBench's code) or from
            "all" tokens (positives and the negative pool).
        probe_l2: the probe's L2 strength on the *mean* token log-loss (AxBench trains its probe
            with AdamW weight decay 1e-3); None: CausalGym's λ table by hidden size.
        lr, weight_decay: AdamW; warmup_ratio: linear warmup share, then linear decay to 0.
        dtype: the LM's dtype (float32, bfloat16, float16).
        direction_seed: initial directions (ReFT-r1) and the random pairs / solvers of the closed
            forms (not `seed`, the data module's shuffling seed).
        device_map, quantization, max_memory, offload_folder: where the frozen LM is placed, for
            one larger than a GPU (`lit_interventions.core.sharding`): e.g. device_map "auto" spreads
            it over the GPUs, quantization "4bit" loads it in NF4; the trained weights stay float32.
    """

    def __init__(
        self,
        lm: str = DEFAULT_LM,
        layer: int | None = None,
        method: str = "reft_r1",
        concept_names: list[str] | None = None,
        topk: int = 8,
        l1: float = 5e-3,
        l1_ramp: bool = True,
        negative_l1: bool = False,
        train_on_negative: bool = True,
        exclude_prefix: bool = True,
        detect_on: str = "content",
        lat_pairs: str = "positives",
        probe_l2: float | None = 1e-3,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        dtype: str = "float32",
        direction_seed: int = 0,
        device_map: str | int | dict | None = None,
        quantization: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | None = None,
    ):
        super().__init__()
        check_dtype(dtype)  # before anything is loaded
        self.check_lm_options(device_map, quantization, max_memory, offload_folder)
        if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
            raise ValueError(f"lr={lr!r} must be a finite number > 0")
        if method not in STEERING_METHODS:
            raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(STEERING_METHODS)}")
        if topk < 1:
            raise ValueError(f"topk={topk!r} must be >= 1")
        if l1 < 0:
            raise ValueError(f"l1={l1!r} must be >= 0")
        if detect_on not in DETECT_ON:
            raise ValueError(f"detect_on={detect_on!r}; valid: {', '.join(DETECT_ON)}")
        if lat_pairs not in LAT_PAIRS:
            raise ValueError(f"lat_pairs={lat_pairs!r}; valid: {', '.join(LAT_PAIRS)}")
        if probe_l2 is not None and not probe_l2 > 0:
            raise ValueError(f"probe_l2={probe_l2!r} must be > 0 or None")
        self.optimizer_args = OptimizerArgs(lr, warmup_ratio, "adamw", weight_decay)  # validates them
        config = load_config(lm)  # the config only: the layer is checked before weights load
        layer = site_layer(config, layer)
        self.save_hyperparameters()
        self.hparams.layer = layer
        self.automatic_optimization = method in TRAINED
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
            n, self._hidden_size, unit_norm=self.hparams.method != "ssv", seed=self.hparams.direction_seed
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
        """Ψ(h_i) of each row's concept at every token, (batch, seq): h·w, or ReLU(h·w) for
        ReFT-r1 and SSV."""
        scores = self.dictionary.projections(hidden, concept_id)
        return torch.relu(scores) if self.hparams.method in RELU_METHODS else scores

    # --- trained methods ----------------------------------------------------------------------

    def intervention_mask(self, batch) -> torch.Tensor:
        """Where the trained methods intervene, (batch, seq): see `steering_objective.intervention_mask`."""
        return intervention_mask(batch, self.hparams.exclude_prefix)

    def trained_rows(self, batch) -> torch.Tensor:
        """The rows that get the intervention and the LM loss, (batch,): see `steering_objective.trained_rows`."""
        return trained_rows(batch, self.hparams.method, self.hparams.train_on_negative)

    def _steered_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(−log p(response) of the trained rows under the intervention, the L1 term) for a batch."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        where = self.intervention_mask(batch)  # (batch, seq)
        trained = self.trained_rows(batch)  # (batch,)
        w = self.dictionary.weight[batch["concept_id"].clamp(min=0)]  # (batch, d); unused on untrained rows
        seen: dict[str, torch.Tensor] = {}
        intervene = steering_intervention(self.hparams.method, w, where, trained, self.hparams.topk, seen)
        targets = batch["response_mask"][:, 1:].bool() & trained[:, None]  # token t+1 is predicted at t
        if targets.any():
            with residual_hook(self.lm, self.hparams.layer, intervene, self.device):
                final = run_body(self.lm, ids, mask).last_hidden_state  # (batch, seq, d)
            logits = final_logits(self.lm, final[:, :-1][targets])  # (n_targets, vocab)
            lm_loss = F.cross_entropy(logits.float(), ids[:, 1:][targets])
        else:  # nothing to predict (the sum keeps the graph for DDP)
            lm_loss = self.dictionary.weight.sum() * 0.0
            if self.hparams.method == "reft_r1":
                intervene(self.states(batch))  # the L1 term needs only the states at the layer
        if self.hparams.method != "reft_r1":
            return lm_loss, lm_loss.detach() * 0.0
        return lm_loss, l1_term(seen, trained, where, self.dictionary.weight, self.hparams.negative_l1)

    def on_fit_start(self):
        """ReFT-r1 with `train_on_negative` needs negatives carrying their concept's id."""
        datamodule = getattr(self.trainer, "datamodule", None)
        wants = self.hparams.method == "reft_r1" and self.hparams.train_on_negative
        has = getattr(datamodule, "genre_negatives", None)
        if wants and has is False:
            raise ValueError(
                "train_on_negative=True (AxBench) needs negatives per concept: set the data module's "
                "genre_negatives: true, or set train_on_negative: false"
            )
        if self.hparams.method in CLOSED_FORM and has is True:
            raise ValueError(
                f"{self.hparams.method} is fitted against the shared negative pool: set the data module's "
                "genre_negatives: false"
            )

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            return self._collect(batch)
        lm_loss, l1 = self._steered_loss(batch)
        loss = lm_loss + self.l1_coefficient() * l1
        size = len(batch["label"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lm_loss", lm_loss, batch_size=size)
        if self.hparams.method == "reft_r1":
            self.log("train/l1", l1, batch_size=size)
        return loss

    def l1_coefficient(self) -> float:
        """λ at this step: λ·step/total_steps with `l1_ramp` (AxBench: `coeff = curr_step /
        num_training_steps`, 0 at the first step), else λ."""
        if not self.hparams.l1_ramp:
            return self.hparams.l1
        return self.hparams.l1 * self.global_step / max(1, int(self.trainer.estimated_stepping_batches))

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
        self._frozen["tokens"].append(response_tokens(self.states(batch), batch, self.hparams.method))
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
        options = {"lat": {"lat_pairs": self.hparams.lat_pairs}, "probe": {"l2": self.hparams.probe_l2}}
        method = self.hparams.method
        rows = concept_directions(
            method, hidden, labels, self.concepts, self.hparams.direction_seed, **options.get(method, {})
        )
        for c, w in rows:
            self.dictionary.weight.data[c] = w.to(self.dictionary.weight)

    def on_train_epoch_start(self):
        self._frozen["tokens"] = []

    def on_train_epoch_end(self):
        if not self.automatic_optimization:
            self.fit_closed_form()

    # --- validation and test ------------------------------------------------------------------

    def detection_mask(self, batch) -> torch.Tensor:
        """The tokens detection max-pools over, (batch, seq): see `detect_on`."""
        if self.hparams.detect_on == "response" or "content_mask" not in batch:
            return batch["response_mask"].bool()
        return batch["content_mask"].bool() & batch["attention_mask"].bool()

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
        each concept on the validation set becomes its max activation (the steering unit)."""
        seen = ~torch.isnan(result["max_score"])
        if stage == "val" and not self.trainer.sanity_checking:
            self.max_activations[seen] = result["max_score"][seen].to(self.max_activations)
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
        card = {"model_type": getattr(load_config(self.hparams.lm), "model_type", None)}
        if self.hparams.method == "reft_r1":
            card.update(topk=self.hparams.topk, l1=self.hparams.l1)
        return Dictionary(
            vectors=self.dictionary.weight.detach(),
            max_activations=self.max_activations,
            concepts=self.concepts,
            model=self.hparams.lm,
            layer=self.hparams.layer,
            method=self.hparams.method,
            training_data=training_data,
            auroc=self._frozen.get("val_auroc"),
            card=card,
        )
