"""Build an AxBench concept directory from a list of concept names with a generator LM
(`concepts_recipe.py`: AxBench's recipe; `concepts_generators.py`: the generators).

The output directory gets the files `axbench_files.load_concepts` reads, so every AxBench config
trains on it unchanged: `train_data.parquet` (per concept its positives; the shared negative pool,
concept id -1), `latent_eval_data.parquet` (per concept positives and negatives, each with its
concept id), `metadata.jsonl`, and `generation.json`, the record of which model wrote the data.

Every reply is kept in `generations.jsonl` as it arrives (one JSON line, flushed and synced),
keyed by the sha256 of the generator's identity, the prompt, the sampling settings and the reply's
seed, so a rerun, or a run after an interruption, generates only what is missing. The four output
files are written under temporary names and renamed into place only once all are written.
Progress is the studies' (`core.progress`): the replies done of all, with an ETA, a line every
10 s when stdout is not a terminal.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata as package_metadata
from pathlib import Path

import pandas as pd
from lit_interventions.datamodules.axbench_files import COLUMNS, NEGATIVE_POOL, ConceptData, check_counts
from lit_interventions.datamodules.concepts_recipe import (
    EMPTY_CONCEPT,
    GENRE_PROMPT,
    NEGATIVE_PROMPT,
    POSITIVE_PROMPT,
    Concept,
    Job,
    genre_jobs,
    parse_genre,
    plan_rows,
)

from lit_interventions.core.progress import Progress

CACHE = "generations.jsonl"
PROVENANCE = "generation.json"
OUTPUTS = ("train_data.parquet", "latent_eval_data.parquet", "metadata.jsonl", PROVENANCE)
ROWS = {  # stage -> (split, category)
    "pool": ("train", "negative"),
    "positive": ("train", "positive"),
    "eval_positive": ("eval", "positive"),
    "eval_negative": ("eval", "negative"),
}


def cache_key(identity: dict, prompt: str, sampling: dict, seed: int) -> str:
    """The sha256 that names one generation."""
    text = json.dumps({"generator": identity, "prompt": prompt, "sampling": sampling, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class GenerationCache:
    """Append-only JSONL of replies ({key, stage, concept, seed, reply}), one line a generation,
    flushed and synced as each is written. A torn last line (a run killed mid-write) is cut off
    when the file is opened again; an unreadable line elsewhere is skipped (its reply regenerated)."""

    def __init__(self, path: Path):
        self.path, self.replies, self.skipped, self.written = Path(path), {}, 0, 0
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
                with open(self.path, "r+b") as f:
                    f.truncate(len(data))
            for line in data.decode("utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    self.replies[record["key"]] = record["reply"]
                except (ValueError, KeyError, TypeError):
                    self.skipped += 1
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def put(self, key: str, record: dict) -> None:
        self.file.write(json.dumps({"key": key, **record}, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.replies[key] = record["reply"]
        self.written += 1

    def close(self) -> None:
        self.file.close()


def _groups(jobs: list[Job], batch_size: int) -> list[tuple[str, list[list[Job]]]]:
    """Jobs grouped by (stage, concept) in order, each group cut into batches of `batch_size`:
    fixed by the plan, so a batch is drawn the same way whatever the cache holds."""
    groups: dict[tuple[str, int], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.stage, job.concept if job.stage != "pool" else job.genre), []).append(job)
    return [(key, [g[i : i + batch_size] for i in range(0, len(g), batch_size)]) for key, g in groups.items()]


def run_jobs(jobs, generator, cache: GenerationCache, batch_size: int, names, desc: str) -> dict[Job, str]:
    """Each job's reply: from the cache, else generated a batch at a time and cached. Progress
    (`core.progress`, `desc`): the replies done of all, noting the stage and concept; a local
    generator's decoding steps are a stage below it."""
    identity, replies = generator.cache_identity(), {}
    with Progress(len(jobs), desc, "reply") as shown:
        for (stage, who), batches in _groups(jobs, batch_size):
            shown.note(f"{stage} [{who}]" if stage == "pool" else f"{stage}: {names[who]}")
            for batch in batches:
                keys = [cache_key(identity, j.prompt, generator.sampling, j.seed) for j in batch]
                if any(k not in cache.replies for k in keys):
                    drawn = generator.generate([j.prompt for j in batch], [j.seed for j in batch])
                    for job, key, reply in zip(batch, keys, drawn):
                        if key not in cache.replies:
                            record = {"stage": job.stage, "concept": job.concept, "seed": job.seed, "reply": reply}
                            cache.put(key, record)
                replies.update({job: cache.replies[key] for job, key in zip(batch, keys)})
                shown.update(len(batch))
    return replies


def clean_reply(reply: str) -> str:
    """The reply stripped of surrounding whitespace, and of quotes that wrap all of it."""
    text = (reply or "").strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def build_tables(names, genres, jobs, replies) -> tuple[pd.DataFrame, pd.DataFrame, Counter]:
    """(train, eval) rows in the AxBench columns; an empty reply is dropped and counted by concept
    (-1: the pool)."""
    rows, dropped = {"train": [], "eval": []}, Counter()
    for job in jobs:
        output = clean_reply(replies[job])
        if not output:
            dropped[job.concept] += 1
            continue
        split, category = ROWS[job.stage]
        concept = EMPTY_CONCEPT if job.concept == NEGATIVE_POOL else names[job.concept]
        rows[split].append([job.instruction, output, concept, job.genre, category, "instruction", job.concept])
    return pd.DataFrame(rows["train"], columns=COLUMNS), pd.DataFrame(rows["eval"], columns=COLUMNS), dropped


def write_outputs(out: Path, files: dict[str, object]) -> None:
    """Write every file under a temporary name beside its target, then rename them all into place;
    on any failure the temporary files are removed and the targets keep what they held."""
    temps = {}
    try:
        for name, content in files.items():
            tmp = out / f".{name}.{os.getpid()}.tmp"
            temps[name] = tmp
            if isinstance(content, pd.DataFrame):
                content.to_parquet(tmp, index=False)
            else:
                tmp.write_text(content, encoding="utf-8")
        for name, tmp in temps.items():
            os.replace(tmp, out / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


@dataclass
class Settings:
    per_concept: int = 24
    eval_per_concept: int = 12
    seed: int = 0
    batch_size: int = 8


def decide_genres(concepts: list[Concept], replies: dict[Job, str], jobs: list[Job]) -> tuple[list[str], dict]:
    """Each concept's genre: fixed by the list, else parsed from the generator's reply."""
    answered = {job.concept: replies[job] for job in jobs}
    genres = [c.genre or parse_genre(answered[i]) for i, c in enumerate(concepts)]
    return genres, answered


def _provenance(generator, settings, concepts, genres, answered, train, evaluation, dropped, sources, counts) -> str:
    def count(table: pd.DataFrame, i: int, category: str) -> int:
        return int(((table["concept_id"] == i) & (table["category"] == category)).sum())

    per_concept = [
        {
            "concept_id": i,
            "concept": concept.name,
            "genre": genre,
            "genre_from": "list" if concept.genre else "generator",
            **({"genre_reply": answered[i]} if i in answered else {}),
            "train_positive": count(train, i, "positive"),
            "eval_positive": count(evaluation, i, "positive"),
            "eval_negative": count(evaluation, i, "negative"),
            "dropped_empty": dropped.get(i, 0),
        }
        for i, (concept, genre) in enumerate(zip(concepts, genres))
    ]
    pool = train[train["concept_id"] == NEGATIVE_POOL]
    record = {
        "generator": generator.identity(),
        "sampling": generator.sampling,
        "seed": settings.seed,
        "per_concept": settings.per_concept,
        "eval_per_concept": settings.eval_per_concept,
        "batch_size": settings.batch_size,
        "package": {"name": "lit-interventions", "version": package_metadata.version("lit-interventions")},
        "recipe": "AxBench instruction data (axbench/scripts/generate.py) with our prompts; no hard negatives",
        "prompts": {"genre": GENRE_PROMPT, "positive": POSITIVE_PROMPT, "negative": NEGATIVE_PROMPT},
        "sources": sources,
        "concepts": per_concept,
        "pool": {**pool["concept_genre"].value_counts().sort_index().to_dict(), "dropped_empty": dropped.get(-1, 0)},
        "generations": counts,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def build_concepts(concepts: list[Concept], prompts: dict, out, generator, settings: Settings, sources: dict) -> dict:
    """Generate (or take from the cache) every row, check each concept has what a run needs
    (`check_counts`), write the directory; returns the provenance record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:  # temporary files of a run killed while writing its outputs
        for stale in out.glob(f".{name}.*.tmp"):
            stale.unlink(missing_ok=True)
    cache = GenerationCache(out / CACHE)
    names = [c.name for c in concepts]
    try:
        asked = genre_jobs(concepts, settings.seed)
        genres, answered = decide_genres(
            concepts, run_jobs(asked, generator, cache, settings.batch_size, names, "genre replies"), asked
        )
        for i, genre in enumerate(genres):
            chosen = "" if concepts[i].genre else " (generator)"
            print(f"concepts: {names[i]!r} is {genre}{chosen}", file=sys.stderr, flush=True)
        jobs = plan_rows(names, genres, prompts, settings.per_concept, settings.eval_per_concept, settings.seed)
        replies = run_jobs(jobs, generator, cache, settings.batch_size, names, "replies")
    finally:
        cache.close()
    train, evaluation, dropped = build_tables(names, genres, jobs, replies)
    check_counts(
        ConceptData(train, evaluation, names, genres, out / OUTPUTS[0], out / OUTPUTS[1]), list(range(len(names)))
    )
    metadata = "".join(
        json.dumps({"concept_id": i, "concept": n, "ref": "lit-interventions concepts", "concept_genres_map": {n: [g]}})
        + "\n"
        for i, (n, g) in enumerate(zip(names, genres))
    )
    total = len(asked) + len(jobs)
    counts = {"total": total, "generated": cache.written, "cached": total - cache.written}
    record = _provenance(generator, settings, concepts, genres, answered, train, evaluation, dropped, sources, counts)
    write_outputs(out, dict(zip(OUTPUTS, (train, evaluation, metadata, record))))
    return json.loads(record)
