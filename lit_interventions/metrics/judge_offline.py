"""The `offline` judge backend: the judge's three 0-2 scores filled from proxies that a small,
independent reference LM computes here (default the embedded `gemma-3-270m`), never the steered
model judging itself. A proxy, not the paper's metric: AxBench's judge is GPT-4o-mini reading
the reply; these are measurements of the reply, mapped to 0, 1 or 2 by fixed cut points.

Each reply y = y_1..y_T (its tokens under the reference tokenizer, at most `max_length`) is read
after the prefix s = BOS "\\n\\n" (its own document), and after s_x = BOS x "\\n\\n" (the
instruction x, then the reply):

- fluency: the perplexity of the reply under the reference LM,
      PPL = exp(−1/T · Σ_t log p(y_t | s, y_<t));
  2 if PPL ≤ 100, 1 if PPL ≤ 300, else 0 (`FLUENCY_CUTS`).
- instruction relevance: how much more likely the reply is given the instruction, per token,
      Δ = 1/T · Σ_t [log p(y_t | s_x, y_<t) − log p(y_t | s, y_<t)]   (nats per token);
  0 if Δ < 0.12, 1 if Δ < 0.25, else 2 (`INSTRUCT_CUTS`).
- concept: an independent detector of the concept in the reference LM's representation: the
  residual stream after block `layer` (default the middle block, 9 of gemma-3-270m's 18),
  mean-pooled over the reply's tokens, h̄ = 1/T · Σ_t h_L(y_t); a logistic regression on the
  standardised h̄, P(concept | y) = σ(w·(h̄ − μ)/σ_h + b), trained on the concept's data
  (`train_data`: the concept's positives against the shared negative pool and every other
  concept's positives, classes balanced); 0 if P < 0.3, 1 if P < 0.7, else 2 (`CONCEPT_CUTS`).
  Its held-out AUROC (`latent_eval_data`: the concept's positives against its negatives, its
  hard negatives and every other concept's positives) is reported per concept (`auroc`), and a
  concept whose AUROC is below `min_auroc` (default 0.8, `MIN_AUROC`) is refused in one line.

overall = 3 / (1/c + 1/i + 1/f), 0 when any is 0 (`judge_prompts.harmonic_mean`), as the judge's.
An empty reply (no token) scores 0 on every aspect.

The cut points are constants chosen on the hand-labelled replies of
`datamodules/data/axbench/judge_calibration.json` (on-topic, off-topic, loosely related,
concept-bearing, broken, word salad and concept salad replies to four instructions, three built-in
concepts) and are frozen here. Each `JudgeScore.replies` holds the measured values.

Where the reference LM is also the steered LM, it is the unsteered copy that scores (the edit is
removed before judging), but its own style is then favoured by the fluency proxy; steer another LM
or set `lm`. The mean-pooled states of the concept data are computed once and kept under
`<judge cache>/offline/` (`judge_openai.judge_cache_dir`), keyed by the reference LM's weights,
the layer and the texts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from lit_interventions.core.blocks import decoder_layers
from lit_interventions.core.forward import final_logits, position_ids, read_layers
from lit_interventions.core.hooks import residual_hook
from lit_interventions.core.lm import load_lm, load_tokenizer, weights_record
from lit_interventions.core.sharding import input_device
from lit_interventions.datamodules.axbench_files import BUILTIN_DIR, NEGATIVE_POOL, load_concepts
from lit_interventions.metrics.judge_base import Judge, JudgeScore
from lit_interventions.metrics.judge_openai import judge_cache_dir
from lit_interventions.metrics.judge_prompts import harmonic_mean

__all__ = ["CONCEPT_CUTS", "FLUENCY_CUTS", "INSTRUCT_CUTS", "MIN_AUROC", "OfflineJudge", "rate"]

log = logging.getLogger("lit_interventions.metrics.judge")  # one logger for the judge, whichever module logs

REFERENCE_LM = "gemma-3-270m"
MIN_AUROC = 0.8  # a concept whose detector's held-out AUROC is lower is refused
CONCEPT_CUTS = (0.3, 0.7)  # P(concept | reply): < 0.3 → 0, < 0.7 → 1, else 2
INSTRUCT_CUTS = (0.12, 0.25)  # Δ nats per token: < 0.12 → 0, < 0.25 → 1, else 2
FLUENCY_CUTS = (100.0, 300.0)  # perplexity: ≤ 100 → 2, ≤ 300 → 1, else 0
SEPARATOR = "\n\n"  # between the instruction and the reply; also the reply's own prefix


def rate(value: float, cuts: tuple[float, float], lower_is_better: bool = False) -> float:
    """0, 1 or 2 by the two cut points (a ≤ b): higher values rate higher (value < a → 0, < b →
    1, else 2), or with `lower_is_better` lower ones do (value ≤ a → 2, ≤ b → 1, else 0). NaN → 0."""
    low, high = cuts
    if math.isnan(value):
        return 0.0
    if lower_is_better:
        return 2.0 if value <= low else 1.0 if value <= high else 0.0
    return 0.0 if value < low else 1.0 if value < high else 2.0


class OfflineJudge(Judge):
    """The judge's scores from proxies under an independent reference LM (see the module doc:
    formulas, cut points, reliability bar). A proxy, not the paper's GPT-4o-mini judge.

    Args:
        lm: the reference LM (default the embedded gemma-3-270m).
        layer: the block whose residual stream the concept detector reads (None: the middle one).
        concept_dir: the concepts' data, a directory in the AxBench layout (None: the built-in set).
        min_auroc: the held-out AUROC below which a concept's detector is refused.
        batch_size: replies per forward. max_length: a reply's tokens read (the rest is cut).
        cache: where the concept data's pooled states are kept ("auto": `<judge cache>/offline`; None: nowhere).
    """

    name = "offline"

    def __init__(
        self,
        lm: str = REFERENCE_LM,
        layer: int | None = None,
        concept_dir: str | None = None,
        min_auroc: float = MIN_AUROC,
        batch_size: int = 8,
        max_length: int = 256,
        cache: str | None = "auto",
    ):
        if not isinstance(min_auroc, (int, float)) or not 0.5 <= min_auroc <= 1.0:
            raise ValueError(f"min_auroc={min_auroc!r} must be a number in [0.5, 1] (0.5 is chance)")
        if not isinstance(batch_size, int) or batch_size < 1 or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"batch_size={batch_size!r}, max_length={max_length!r}: both must be integers >= 1")
        self.lm, self.concept_dir, self.min_auroc = lm, concept_dir, float(min_auroc)
        self.batch_size, self.max_length, self.layer = batch_size, max_length, layer
        self.cache = None if cache is None else (judge_cache_dir() / "offline" if cache == "auto" else Path(cache))
        self.data = load_concepts(concept_dir)  # a missing or damaged directory: refused before any LM loads
        self.model = self.tokenizer = None
        self.detectors, self.auroc = {}, {}

    # --- the reference LM ------------------------------------------------------------------------
    def check(self) -> None:
        """Load the reference LM (once) and fix the detector's layer (a layer it lacks: one line)."""
        if self.model is not None:
            return
        self.model, self.tokenizer = load_lm(self.lm), load_tokenizer(self.lm)
        blocks = len(decoder_layers(self.model))
        self.layer = blocks // 2 if self.layer is None else self.layer
        if not isinstance(self.layer, int) or not 0 <= self.layer < blocks:
            raise ValueError(f"layer={self.layer!r} is out of range: {self.lm} has {blocks} blocks (0..{blocks - 1})")

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prefix(self, instruction: str | None) -> list[int]:
        """BOS, the instruction (if any), then SEPARATOR: what the reply is read after."""
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + (self._ids(instruction) if instruction else []) + self._ids(SEPARATOR)

    def _batch(self, rows: list[tuple[list[int], list[int]]]):
        """(input_ids, attention_mask, the reply's first column per row), right-padded, on the LM's device."""
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, (prefix, reply) in enumerate(rows):
            ids[k, : len(prefix) + len(reply)] = torch.tensor(prefix + reply)
            mask[k, : len(prefix) + len(reply)] = 1
        device = input_device(self.model)
        return ids.to(device), mask.to(device), [len(p) for p, _ in rows]

    @torch.no_grad()
    def _read(self, rows: list[tuple[list[int], list[int]]], pooled: bool) -> tuple[list[float], list[np.ndarray]]:
        """Per (prefix, reply) row with T ≥ 1 reply tokens: the mean log-probability of the reply's
        tokens, 1/T · Σ_t log p(y_t | prefix, y_<t), and (with `pooled`) the mean over the reply's
        columns of the residual stream after block `layer`."""
        ids, mask, starts = self._batch(rows)
        grabbed = {}

        def grab(hidden):
            grabbed["h"] = hidden

        with residual_hook(self.model, self.layer, grab, ids.device):
            body = self.model.base_model
            hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
        means, states = [], []
        for k, (_, reply) in enumerate(rows):
            span = torch.arange(starts[k], starts[k] + len(reply), device=ids.device)
            logits = final_logits(self.model, hidden[k, span - 1]).float()  # the column before predicts
            logp = torch.log_softmax(logits, -1).gather(-1, ids[k, span, None])
            means.append(float(logp.mean()))
            if pooled:
                states.append(grabbed["h"][k, span].float().mean(0).cpu().numpy())
        return means, states

    # --- the concept detectors -------------------------------------------------------------------
    def _pooled_texts(self, texts: list[str]) -> np.ndarray:
        """(len(texts), d) mean-pooled states of each text read after BOS SEPARATOR (as a reply is),
        from the cache when it holds them; a forward that stops after block `layer`."""
        key = json.dumps({"lm": weights_record(self.lm), "layer": self.layer, "texts": texts, "sep": SEPARATOR})
        path = None if self.cache is None else self.cache / f"{hashlib.sha256(key.encode()).hexdigest()}.safetensors"
        if path is not None and path.is_file():
            try:
                return load_file(str(path))["pooled"]
            except Exception as err:  # a damaged entry: computed again
                log.warning("offline judge: cache entry %s is unreadable (%s); computing it again", path, err)
        order = sorted(range(len(texts)), key=lambda k: len(texts[k]))  # like lengths share a batch
        out = [None] * len(texts)
        for a in range(0, len(order), 32):
            chunk = order[a : a + 32]
            rows = [(self._prefix(None), self._ids(texts[k])[: self.max_length] or self._ids(" ")) for k in chunk]
            ids, mask, starts = self._batch(rows)
            hidden = read_layers(self.model, [self.layer], ids, mask)[self.layer]
            for j, k in enumerate(chunk):
                out[k] = hidden[j, starts[j] : starts[j] + len(rows[j][1])].float().mean(0).cpu().numpy()
        pooled = np.stack(out).astype(np.float32)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f".{path.name}.{os.getpid()}")
            save_file({"pooled": pooled}, str(part))
            os.replace(part, path)  # whole or absent
        return pooled

    def prepare(self, concepts: list[str]) -> None:
        """Train the detector of each concept not yet trained and measure its held-out AUROC
        (`auroc`); a concept absent from the data, or whose AUROC is below `min_auroc`, is a
        ValueError line. Loads the reference LM (`check`)."""
        wanted = [c for c in dict.fromkeys(concepts) if c not in self.detectors]
        if not wanted:
            return
        where = self.concept_dir or BUILTIN_DIR
        if missing := [c for c in wanted if c not in self.data.concepts]:
            raise ValueError(
                f"concept {missing[0]!r} is not in the offline judge's concept data {where}, whose concepts are "
                f"{', '.join(map(repr, self.data.concepts))}; give its directory as the judge's concept_dir"
            )
        self.check()
        train, evaluation = self.data.train, self.data.eval
        texts = list(dict.fromkeys([*train["output"], *evaluation["output"]]))
        index = {t: k for k, t in enumerate(texts)}
        pooled = self._pooled_texts(texts)
        train_x = pooled[[index[t] for t in train["output"]]]
        eval_x = pooled[[index[t] for t in evaluation["output"]]]
        for concept in wanted:
            c = self.data.concepts.index(concept)
            mine = (train["concept_id"] == c).to_numpy() & (train["category"] == "positive").to_numpy()
            usable = (train["category"] == "positive").to_numpy() | (train["concept_id"] == NEGATIVE_POOL).to_numpy()
            detector = make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=2000))
            detector.fit(train_x[usable], mine[usable].astype(int))
            positive = (evaluation["category"] == "positive").to_numpy()
            own = (evaluation["concept_id"] == c).to_numpy()
            scored = own | positive  # its rows, and every other concept's positives as negatives
            labels = (own & positive)[scored].astype(int)
            if labels.min() == labels.max():
                raise ValueError(f"concept {concept!r} has no held-out positives or negatives in {where}; no AUROC")
            auroc = float(roc_auc_score(labels, detector.predict_proba(eval_x[scored])[:, 1]))
            log.info("offline judge: concept %r detector held-out AUROC %.3f", concept, auroc)
            if auroc < self.min_auroc:
                raise ValueError(
                    f"concept {concept!r}: its offline detector's held-out AUROC is {auroc:.3f}, below the "
                    f"reliability bar min_auroc={self.min_auroc}; its concept scores would not mean anything"
                )
            self.detectors[concept], self.auroc[concept] = detector, auroc

    # --- scoring ---------------------------------------------------------------------------------
    def measure(self, concepts: list[str], instructions: list[str], responses: list[str]) -> list[dict]:
        """The raw proxies of each reply: {"p_concept", "relevance" (Δ), "perplexity", "tokens"}
        (None for an empty reply)."""
        self.prepare(concepts)
        replies = [self._ids(r)[: self.max_length] for r in responses]
        out = [None] * len(responses)
        live = [k for k, r in enumerate(replies) if r]
        for a in range(0, len(live), self.batch_size):
            chunk = live[a : a + self.batch_size]
            alone, states = self._read([(self._prefix(None), replies[k]) for k in chunk], pooled=True)
            given, _ = self._read([(self._prefix(instructions[k]), replies[k]) for k in chunk], pooled=False)
            for j, k in enumerate(chunk):
                p = float(self.detectors[concepts[k]].predict_proba(states[j][None])[0, 1])
                out[k] = {
                    "p_concept": p,
                    "relevance": given[j] - alone[j],
                    "perplexity": math.exp(-alone[j]),
                    "tokens": len(replies[k]),
                }
        return out

    def score(self, concepts: list[str], instructions: list[str], responses: list[str]) -> list[JudgeScore]:
        """One JudgeScore per (concept, instruction, response): each proxy rated by its cut points;
        `replies` holds the measured values."""
        if not len(concepts) == len(instructions) == len(responses):
            raise ValueError("concepts, instructions and responses must have the same length")
        results = []
        for concept, m in zip(concepts, self.measure(concepts, instructions, responses)):
            if m is None:
                results.append(
                    JudgeScore(0.0, 0.0, 0.0, 0.0, {a: "empty reply" for a in ("concept", "instruct", "fluency")})
                )
                continue
            c = rate(m["p_concept"], CONCEPT_CUTS)
            i = rate(m["relevance"], INSTRUCT_CUTS)
            f = rate(m["perplexity"], FLUENCY_CUTS, lower_is_better=True)
            replies = {
                "concept": f"P(concept)={m['p_concept']:.4f} (detector AUROC {self.auroc[concept]:.3f})",
                "instruct": f"relevance={m['relevance']:.4f} nats/token",
                "fluency": f"perplexity={m['perplexity']:.2f} over {m['tokens']} tokens",
            }
            results.append(JudgeScore(c, i, f, harmonic_mean(c, i, f), replies))
        return results
