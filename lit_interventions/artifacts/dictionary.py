"""The released concept dictionary (AxBench §4): rank-1 vectors for many concepts, one file.

On disk, two files with one stem:
- `NAME.safetensors`: `vectors` (concepts × d, float32) and `max_activations` (concepts,), the
  largest latent of each concept on the eval set (the unit of the steering factor);
- `NAME.json`: the card — model, layer, method, concept names, hidden size, how a latent is
  read (`latent`: "linear" h·w or "relu" ReLU(h·w)), the training data and the eval AUROC.

`save_pretrained(directory)` / `from_pretrained(directory_or_hub_id)` / `push_to_hub(repo_id)` use
the Hugging Face layout instead (`dictionary.safetensors`, the card in `config.json`, a generated
`README.md` model card; see `lit_interventions.artifacts.hub`); `load` reads both.

    d = Dictionary.load("runs/reft_r1/.../dictionary.safetensors")
    d = Dictionary.from_pretrained("checkpoints/axbench/builtin-diffmean")   # or a hub id
    scores = d.detect(["Rent a van for the weekend.", "2 + 2 = 4"])    # (2, concepts)
    with d.steer(lm, "references to rental services", factor=1.0) as model:
        out = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=1.0)

A latent is read as the card's `latent` says, which the method that trained the dictionary
declares: ReLU(h·w) for ReFT-r1 and SSV, h·w for DiffMean, PCA, LAT and the probe (the probe's
σ(h·w + b) is a monotone function of h·w, so the two rank texts alike and the AUROC is the same;
the released w of a probe is its unit-norm weight). A card without `latent` is read by its
method's name (ReLU for reft_r1 and ssv).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lit_interventions.artifacts.dictionary_files import (
    FORMAT,
    REDO,
    WEIGHTS_NAME,
    dictionary_paths,
    read_dictionary,
    write_weights,
)
from lit_interventions.artifacts.hub import (
    dictionary_config,
    local_directory,
    push_object,
    write_hub_files,
    write_run_card,
)
from lit_interventions.artifacts.shareable import shareable
from lit_interventions.core.blocks import BLOCK_OUTPUT, check_layer
from lit_interventions.core.edits import STEERING_RULE, ApplyRequest, Edit, check_site, check_width, concept_rows
from lit_interventions.core.files import write_atomically
from lit_interventions.core.forward import read_layers
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import hidden_size, load_lm, load_tokenizer, num_layers
from lit_interventions.core.surprisal import bos_prefix
from lit_interventions.interventions.additive import add_vector, steering_units

LATENTS = ("linear", "relu")  # h·w, ReLU(h·w)
_RELU_BY_NAME = ("reft_r1", "ssv")  # the latent of a card that does not say it


def latent_values(values: torch.Tensor, latent: str) -> torch.Tensor:
    """Ψ from the projections h·w: ReLU(h·w) for latent "relu", h·w itself for "linear"."""
    return torch.relu(values) if latent == "relu" else values


@dataclass
class Dictionary:
    """Concept vectors `vectors` (C, d) with names `concepts`, read at the residual stream after
    block `layer` of `model`; `max_activations` (C,) scales the steering factor. `latent` ("linear"
    or "relu"; None: by the method's name) is how a latent is read from h·w."""

    vectors: torch.Tensor
    max_activations: torch.Tensor
    concepts: list[str]
    model: str
    layer: int
    method: str
    training_data: str | None = None
    auroc: dict | None = None  # {"mean": float, "per_concept": {name: float}}
    card: dict = field(default_factory=dict)  # any further card fields (kept on save/load)
    latent: str | None = None

    edits_base_alone = True  # steering, h + α·w: no source state (`capabilities.SourceFree`)

    def __post_init__(self):
        if self.latent is None:
            self.latent = "relu" if self.method in _RELU_BY_NAME else "linear"
        if self.latent not in LATENTS:
            raise ValueError(f"latent={self.latent!r}; valid: {', '.join(LATENTS)}")
        self.vectors = torch.as_tensor(self.vectors).detach().float().cpu()
        if self.vectors.dim() != 2:
            raise ValueError(f"vectors must be (concepts, hidden_size); got shape {tuple(self.vectors.shape)}")
        if len(self.concepts) != self.vectors.shape[0]:
            raise ValueError(f"{len(self.concepts)} concept names for {self.vectors.shape[0]} vectors")
        if len(set(self.concepts)) != len(self.concepts):
            raise ValueError("concept names must be unique")
        self.max_activations = torch.as_tensor(self.max_activations).detach().float().cpu().reshape(-1)
        if self.max_activations.shape[0] != self.vectors.shape[0]:
            raise ValueError(
                f"max_activations has {self.max_activations.shape[0]} entries for {self.vectors.shape[0]} concepts"
            )
        self.concepts = [str(c) for c in self.concepts]

    @property
    def hidden_size(self) -> int:
        return self.vectors.shape[1]

    # --- files -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write `path` (.safetensors; the suffix is added if missing) and the card beside it
        (.json), each atomically (a temporary file renamed over it: a killed write leaves the old
        file or none, never half of one). NaN/inf vectors are refused. Returns the .safetensors path."""
        weights, card_path = dictionary_paths(path)
        card = shareable(self.card_dict())  # no absolute local path leaves the machine
        self._write_weights(weights)
        write_atomically(card_path, json.dumps(card, indent=2) + "\n")
        return weights

    def card_dict(self) -> dict:
        """The card `save` writes to NAME.json (and `save_pretrained` into config.json)."""
        return {
            **self.card,
            "format": FORMAT,
            "model": self.model,
            "layer": self.layer,
            "method": self.method,
            "latent": self.latent,
            "hidden_size": self.hidden_size,
            "num_concepts": len(self.concepts),
            "concepts": self.concepts,
            "training_data": self.training_data,
            "auroc": self.auroc,
        }

    def _write_weights(self, weights: Path) -> None:
        write_weights(weights, self.vectors, self.max_activations, self.concepts)

    # --- the Hugging Face layout (lit_interventions.artifacts.hub) ---------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """`directory` as a hub model repository: `dictionary.safetensors`, `config.json` (the card
        plus class path, base model, site, metrics and the command in `card["command"]`) and a
        generated `README.md` model card. Returns the directory."""
        directory = Path(directory)
        config = dictionary_config(self, WEIGHTS_NAME)
        json.dumps(config)  # not JSON-able: fails before anything is written
        self._write_weights(directory / WEIGHTS_NAME)
        write_hub_files(directory, config)
        return directory

    def save_run(self, directory: str | Path) -> Path:
        """A run's artifact: `dictionary.safetensors` and one card, config.json with the README.md
        model card (`hub.write_run_card`; dictionary.json where a foreign config.json is in the
        way). Returns the card's path."""
        directory = Path(directory)
        config = dictionary_config(self, WEIGHTS_NAME)
        json.dumps(config)  # not JSON-able: fails before anything is written
        self._write_weights(directory / WEIGHTS_NAME)
        return write_run_card(directory, config, dictionary_paths(directory / WEIGHTS_NAME)[1].name, self.card_dict())

    @classmethod
    def from_pretrained(cls, directory_or_hub_id: str | Path, **download) -> Dictionary:
        """A dictionary from a local directory (config.json, or an older dictionary.json) or a hub
        repository, downloaded with `huggingface_hub.snapshot_download` (`download`: revision,
        token, cache_dir, local_files_only)."""
        return cls.load(local_directory(directory_or_hub_id, **download))

    def push_to_hub(self, repo_id: str, **kwargs):
        """save_pretrained to a temporary directory, then upload it to `repo_id` (HfApi.upload_folder;
        kwargs: private, token, commit_message, revision, create_pr). Returns the CommitInfo."""
        return push_object(self, repo_id, **kwargs)

    @classmethod
    def load(cls, path: str | Path) -> Dictionary:
        """Read a dictionary from its .safetensors path, its .json card path or their stem. A file
        that cannot be read, or vectors holding NaN/inf, is a ValueError naming the file."""
        fields, weights, card_path = read_dictionary(path)
        try:
            return cls(**fields)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{weights} and {card_path} do not agree: {err}; {REDO}") from err

    # --- concepts and models -----------------------------------------------------------------

    def index(self, concept: str | int) -> int:
        """The row of `concept`, given by name or index."""
        if isinstance(concept, bool) or not isinstance(concept, (str, int)):
            raise ValueError(f"concept must be a name or an index; got {concept!r}")
        if isinstance(concept, int):
            if not 0 <= concept < len(self.concepts):
                raise ValueError(
                    f"concept index {concept} is out of range: this dictionary has "
                    f"{len(self.concepts)} concepts (0..{len(self.concepts) - 1})"
                )
            return concept
        if concept not in self.concepts:
            shown = ", ".join(repr(c) for c in self.concepts[:5])
            more = f" … ({len(self.concepts)} in all)" if len(self.concepts) > 5 else ""
            raise ValueError(f"concept {concept!r} is not in this dictionary; valid concepts include {shown}{more}")
        return self.concepts.index(concept)

    def latents(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every concept's latent at every token, (..., seq, C): ReLU(h·w) or h·w (the card's `latent`)."""
        return latent_values(hidden.float() @ self.vectors.to(hidden.device).T, self.latent)

    def _model(self, lm, dtype: str = "float32") -> torch.nn.Module:
        """The LM to apply the dictionary to: checked against the card (model name or hidden
        size, and layer count) before any work."""
        if isinstance(lm, str):
            if lm != self.model:
                raise ValueError(f"this dictionary was trained for model {self.model!r}, not {lm!r}")
            lm = load_lm(lm, dtype)
        trained_type, lm_type = self.card.get("model_type"), getattr(lm.config, "model_type", None)
        if trained_type and lm_type and trained_type != lm_type:
            raise ValueError(
                f"this dictionary was trained for model {self.model!r} (a {trained_type} model); "
                f"the LM given is a {lm_type} model"
            )
        size = hidden_size(lm.config)
        if size != self.hidden_size:
            name = getattr(lm.config, "_name_or_path", "") or type(lm).__name__
            raise ValueError(
                f"this dictionary was trained for model {self.model!r} (hidden size {self.hidden_size}); "
                f"the LM {name!r} has hidden size {size}"
            )
        check_layer(self.layer, num_layers(lm.config))
        return lm

    # --- detection and steering -----------------------------------------------------------------

    @torch.no_grad()
    def detect(
        self,
        texts: list[str],
        lm=None,
        tokenizer=None,
        batch_size: int = 16,
        max_length: int = 256,
        dtype: str = "float32",
    ) -> torch.Tensor:
        """Per-concept scores of each text, (N, C): the max over its tokens of each concept's
        latent (AxBench eq. 2, unnormalised). Texts are tokenized as they are (no chat template)
        after a BOS (`bos_prefix`), truncated to `max_length`. The first position (the BOS) is
        never scored: it is the attention sink, whose state is huge (smollm2: norm about 22,700
        against about 200) and would score the same for every text.

        lm: None (the card's model), the same name, or a loaded model; tokenizer: None loads the
        card model's tokenizer (pass one with a model of your own).
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings")
        model = self._model(self.model if lm is None else lm, dtype)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model)
        prefix, out = bos_prefix(tokenizer), []
        for start in range(0, len(texts), batch_size):
            batch = [prefix + text for text in texts[start : start + batch_size]]
            enc = tokenizer(
                batch,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_length,
                return_special_tokens_mask=True,
            ).to(model.device)
            hidden = read_layers(model, [self.layer], enc["input_ids"], enc["attention_mask"])[self.layer]
            scored = enc["attention_mask"].bool() & ~enc["special_tokens_mask"].bool()  # (batch, seq)
            first = enc["attention_mask"].int().argmax(1)  # the first real position (either padding side)
            scored[torch.arange(len(batch), device=scored.device), first] = False
            latents = self.latents(hidden).masked_fill(~scored[..., None], float("-inf"))  # (batch, seq, C)
            out.append(latents.amax(1).cpu())
        return torch.cat(out) if out else torch.zeros(0, len(self.concepts))

    def steering_vectors(
        self, concept: str | int | None = None, factor: float = 1.0
    ) -> dict[str, dict[int, torch.Tensor]]:
        """{concept: {layer: α·w}} for `concept` (a name or row; None: every concept), with α =
        factor × the concept's max activation (`steering_alpha`): what `steer` adds at every
        token, Φ(h_i) = h_i + α·w (the export formats' capability)."""
        rows = range(len(self.concepts)) if concept is None else [self.index(concept)]
        return {
            self.concepts[row]: {self.layer: self.steering_alpha(row, factor) * self.vectors[row].float()}
            for row in rows
        }

    def steering_alpha(self, concept: str | int, factor: float) -> float:
        """α = factor × the concept's max activation on the eval set (AxBench §3.3); 50 for a
        concept whose max activation is ≤ 0, as AxBench steers a dead row (`steering_units`)."""
        row = self.index(concept)
        peak = float(steering_units(self.max_activations)[row])
        if not torch.isfinite(torch.tensor(peak)):
            raise ValueError(
                f"concept {self.concepts[row]!r} has no max activation (the dictionary was never "
                "validated); pass alpha= directly"
            )
        return factor * peak

    def edits(self, config: dict, request: ApplyRequest, where: str = "the dictionary") -> list[Edit]:
        """What `lit_interventions.apply` does with it: Φ(h_i) = h_i + α·w_c after block `layer`,
        α = factor × the concept's max activation (`steering_alpha`), at every position unless
        the request names others; the concept and factor may differ per batch row. The same bits
        as `steer` (AxBench steering, h + α·w)."""
        card = {**config, "model": self.model}
        check_width(self.hidden_size, request.lm, card, where)
        check_site(self.layer, BLOCK_OUTPUT, request.lm, card, where)
        chosen = concept_rows(request, self.concepts, len(self.concepts), where)
        for row in chosen if isinstance(chosen, list) else [chosen]:
            self.steering_alpha(row, 1.0)  # refuses a concept never validated (no max activation)

        units = steering_units(self.max_activations).double()  # once, not at every forward

        def steer(states: torch.Tensor, rows: torch.Tensor, inputs=None) -> torch.Tensor:
            # α = factor × m_c in float64, then float32: `steer`'s α (a Python float), bit for bit
            concept = request.per_row(chosen, rows.cpu(), torch.long)
            alpha = (request.per_row(request.factor, rows.cpu(), torch.float64) * units[concept]).float()
            vectors = self.vectors.to(states.device)[concept.to(states.device)].float()
            return states + (alpha.to(states.device)[:, None] * vectors).to(states.dtype)

        return [Edit(steer, request.positions.resolved(STEERING_RULE), self.layer)]

    @contextmanager
    def steer(self, lm, concept: str | int, factor: float = 1.0, alpha: float | None = None, dtype: str = "float32"):
        """Within the block, the LM's residual stream after `layer` gets α·w_c added at every
        position (prompt and generated tokens): Φ(h_i) = h_i + α·w. α = factor × max activation
        of the concept, or `alpha` if given. Yields the (steered) model."""
        row = self.index(concept)
        model = self._model(lm, dtype)
        alpha = self.steering_alpha(row, factor) if alpha is None else float(alpha)
        vector = self.vectors[row].to(model.device)
        with residual_hook(model, self.layer, lambda hidden: add_vector(hidden, vector, alpha)):
            yield model
