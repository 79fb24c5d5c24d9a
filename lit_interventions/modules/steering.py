"""AxBench concept dictionaries on a frozen LM: one module for all six rank-1 methods.

Every concept of the dataset is a row of one `ConceptDictionary` (concepts × d), trained in one
run; an example only updates the row of its own concept.

Trained by gradient (automatic optimization, AdamW + linear schedule):
- `reft_r1`: Φ(h_i) = h_i + mean(TopK(ReLU(h·w_c)))·w_c at every token after the chat prefix
  (`content_mask`: BOS, the template's system turn and user header get no intervention and never
  enter the TopK; AxBench's `exclude_bos`), loss −log p(response) + λ·Σ_{non-top-k}|latent|
  (AxBench eqs. 9–10). The L1 term is a per-sequence mean over the same tokens (AxBench's code;
  λ is on that scale), λ ramped up linearly from 0 over training (`l1_ramp`, AxBench's code).
  By default (`train_on_negative: true`, AxBench's sweeps) each concept also trains on the
  negatives of its genre — the same intervention with its own w_c, the same LM loss — which
  needs the data module's `genre_negatives: true` (the negatives then carry concept ids);
  `train_on_negative: false` is positives only. `exclude_prefix: false` intervenes on every
  token. With `negative_l1: true` pool negatives (concept_id −1) get the L1 term on *every*
  concept's latents at all their tokens, pushing latents towards 0 off-concept; on smollm2 that
  killed 5 of 10 rows (ReLU(h·w) = 0 on every token, so no gradient again), hence off.
  w_c stays unit norm: the gradient component parallel to w_c is removed before each step and
  the rows are renormalised after it.
- `ssv`: Φ(h_i) = h_i + w_c at every token after the chat prefix of a positive example; loss
  −log p(response); w free norm (AxBench eqs. 6–7; its sweeps: no negatives).

Closed form (no optimizer): `diffmean`, `pca`, `lat`, `probe`. `trainer.fit` runs one pass
over the training data; each step reads the residual stream at the layer (the LM is frozen) and
keeps the response tokens: a positive's tokens for its concept (token_labels), the negatives'
tokens as the shared pool H⁻. Each concept's row is then fitted with scikit-learn
(`lit_interventions.interventions.directions`): DiffMean mean(H⁺_c) − mean(H⁻); PCA top PC of
H⁺_c; LAT top PC of normalised differences of random pairs of H⁺_c (AxBench's code; `lat_pairs:
all` draws them from H⁺_c ∪ H⁻); probe a logistic regression of token labels on H⁺_c ∪ H⁻
(sklearn SAGA, L2 `probe_l2` on the mean log-loss, the weight decay of AxBench's trained probe). All unit norm, oriented so that
H⁺_c projects higher than H⁻. This is a Lightning-native fit because Lightning still owns the
loop: DDP sharding of the data (the kept tokens of all ranks are gathered before the fit),
device placement, validation, logging, checkpointing and the export callback are the same as for
the trained methods, and `python train.py fit` serves all six. The fit happens when the collected
data is first needed: at the start of validation (Lightning validates *before*
`on_train_epoch_end`) or at the end of the epoch; use `max_epochs: 1`.

Validation scores every row of the eval set for the concept it is evaluated for: token latents
Ψ(h_i) (h·w, or ReLU(h·w) for ReFT-r1 and SSV) max-pooled over every token after the chat prefix
(instruction and response, as AxBench's code; `detect_on: response` pools the response), min-max
normalised per concept, AUROC per concept (`val/auroc/<concept>`) and their mean (`val/auroc`).
The largest sequence score of each concept becomes its `max_activations` entry (the steering
unit of the released dictionary).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lit_interventions.artifacts.dictionary import RELU_METHODS, Dictionary
from lit_interventions.callbacks.guard import NonFiniteError, likely_cause
from lit_interventions.callbacks.metrics import AUROCCallback
from lit_interventions.core.lm import DEFAULT_LM, check_dtype, hidden_size, load_config
from lit_interventions.core.optim import OptimizerArgs
from lit_interventions.core.sites import final_logits, read_layers, residual_hook, run_body, site_layer
from lit_interventions.interventions.additive import (
    ConceptDictionary,
    masked_token_mean,
    non_topk_l1,
    reft_r1_intervention,
)
from lit_interventions.interventions.directions import METHODS as DIRECTIONS
from lit_interventions.interventions.directions import LATDirection, PCADirection
from lit_interventions.modules.site import FrozenLMModule

TRAINED = ("reft_r1", "ssv")
DETECT_ON = ("content", "response")
LAT_PAIRS = ("positives", "all")
CLOSED_FORM = ("diffmean", "pca", "lat", "probe")
STEERING_METHODS = TRAINED + CLOSED_FORM


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a (n, ...) tensor of every process along dim 0 (sizes may differ)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    from torchmetrics.utilities.distributed import gather_all_tensors

    return torch.cat(gather_all_tensors(tensor))


def fit_concept_direction(
    method: str, positives: torch.Tensor, negatives: torch.Tensor, seed: int = 0, **kwargs
) -> torch.Tensor:
    """One concept's unit direction from its positive tokens H⁺_c (n⁺, d) and the negative pool
    H⁻ (n⁻, d), oriented so that mean(H⁺_c)·w ≥ mean(H⁻)·w. float32 (d,)."""
    if method not in CLOSED_FORM:
        raise ValueError(f"unknown closed-form method {method!r}; valid: {', '.join(CLOSED_FORM)}")
    lat_pairs = kwargs.pop("lat_pairs", "positives")
    if method == "pca" or (method == "lat" and lat_pairs == "positives"):
        # PCA: the top PC of the positives alone; LAT: of normalised differences of random pairs of
        # the positives (AxBench's code); oriented by the negatives
        estimator = PCADirection(random_state=seed) if method == "pca" else LATDirection(random_state=seed)
        w = estimator.fit(positives.float()).direction_
        return w if w @ (positives.float().mean(0) - negatives.float().mean(0)) >= 0 else -w
    if method == "probe" and kwargs.get("l2") is not None:  # λ on the mean log-loss -> sklearn's sum scale
        kwargs["strength"] = kwargs.pop("l2") * (len(positives) + len(negatives))
    kwargs.pop("l2", None)
    X = torch.cat([positives, negatives]).float()
    y = np.r_[np.ones(len(positives)), np.zeros(len(negatives))]
    seeded = {"random_state": seed} if "random_state" in DIRECTIONS[method]().get_params() else {}
    return DIRECTIONS[method](**seeded, **kwargs).fit(X, y).direction_


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
        """Where the trained methods intervene, run the TopK and sum the L1 term, (batch, seq): every
        token after the chat prefix (AxBench's `exclude_bos`, `intervention_positions: all`), or
        every real token with `exclude_prefix: false`."""
        if self.hparams.exclude_prefix:
            if "content_mask" not in batch:
                raise ValueError(
                    "exclude_prefix=True needs the batch's content_mask (AxBenchDataModule); "
                    "pass exclude_prefix=False to intervene on every token"
                )
            return batch["content_mask"].bool() & batch["attention_mask"].bool()
        return batch["attention_mask"].bool()

    def trained_rows(self, batch) -> torch.Tensor:
        """The rows that get the intervention and the LM loss, (batch,): a concept's positives and,
        with `train_on_negative` (ReFT-r1), its genre-matched negatives."""
        own = batch["concept_id"] >= 0
        if self.hparams.method == "reft_r1" and self.hparams.train_on_negative:
            return own
        return own & (batch["label"] == 1)

    def _steered_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(−log p(response) of the trained rows under the intervention, the L1 term) for a batch."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        where = self.intervention_mask(batch)  # (batch, seq)
        trained = self.trained_rows(batch)  # (batch,)
        w = self.dictionary.weight[batch["concept_id"].clamp(min=0)]  # (batch, d); unused on untrained rows
        seen: dict[str, torch.Tensor] = {}

        def intervene(hidden):  # (batch, seq, d) -> the same, at the layer
            if self.hparams.method == "ssv":
                steered = hidden + w.to(hidden.dtype)[:, None, :]
            else:
                steered, seen["latents"], seen["chosen"] = reft_r1_intervention(hidden, w, where, self.hparams.topk)
                seen["hidden"] = hidden
            return torch.where(trained[:, None, None] & where[:, :, None], steered, hidden)

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
        return lm_loss, self._l1(seen, trained, where)

    def _l1(self, seen: dict, trained: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over the batch of each row's L1 term: a trained row's non-top-k latents of its
        concept; a pool negative's latents of every concept at all tokens (if negative_l1)."""
        per_row = torch.where(
            trained, non_topk_l1(seen["latents"], seen["chosen"], mask), torch.zeros_like(seen["latents"][:, 0])
        )
        negative = ~trained
        if self.hparams.negative_l1 and negative.any():
            every = torch.relu(seen["hidden"][negative].float() @ self.dictionary.weight.T)  # (neg, seq, C)
            extra = torch.zeros_like(per_row)
            extra[negative] = masked_token_mean(every, mask[negative]).sum(-1)
            per_row = per_row + extra
        return per_row.mean()

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
        hidden = self.states(batch)
        response = batch["response_mask"].bool()
        positive = response & (batch["token_labels"] >= 0)
        negative = response & (batch["label"] == 0)[:, None]
        if ((batch["label"] == 0) & (batch["concept_id"] >= 0)).any():
            raise ValueError(
                f"{self.hparams.method} is fitted against the shared negative pool (concept_id -1); "
                "these negatives carry concept ids: set the data module's genre_negatives: false"
            )
        keep = positive | negative
        self._frozen["tokens"].append(
            (
                hidden[keep].float().cpu(),
                batch["token_labels"][keep]
                .where(positive[keep], torch.full_like(batch["token_labels"][keep], -1))
                .cpu(),
            )
        )
        self._frozen["pending"] = True

    @torch.no_grad()
    def fit_closed_form(self) -> None:
        """Fit every concept's row from the tokens collected so far (all processes)."""
        if not self._frozen.pop("pending", False):
            return
        pieces = self._frozen["tokens"]
        hidden = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, self._hidden_size)
        labels = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
        hidden = _gather(hidden.to(self.device)).cpu()
        labels = _gather(labels.to(self.device)).cpu()
        bad = ~torch.isfinite(hidden).all(-1)
        if bad.any():
            raise NonFiniteError(
                f"the LM's residual stream at layer {self.hparams.layer} is NaN/inf at {int(bad.sum())} "
                f"of {len(hidden)} training tokens; likely cause: {likely_cause(self.trainer, self)}. "
                "Nothing was fitted or exported."
            )
        negatives = hidden[labels == -1]
        if len(negatives) == 0:
            raise ValueError("the training data has no negative tokens: the closed-form methods need negatives")
        for c, name in enumerate(self.concepts):
            positives = hidden[labels == c]
            if len(positives) < 2:
                raise ValueError(
                    f"concept {name!r} has {len(positives)} positive response token(s) in the "
                    "training data; at least 2 are needed"
                )
            options = {"lat": {"lat_pairs": self.hparams.lat_pairs}, "probe": {"l2": self.hparams.probe_l2}}
            w = fit_concept_direction(
                self.hparams.method,
                positives,
                negatives,
                seed=self.hparams.direction_seed,
                **options.get(self.hparams.method, {}),
            )
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
