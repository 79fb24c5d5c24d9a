"""Frozen LMs larger than one device: a device map (accelerate) and 8- or 4-bit weights
(bitsandbytes).

`LoadOptions` holds what `lm.load_lm` passes to `from_pretrained` beyond the dtype:
- `device_map`: "auto", "balanced", "balanced_low_0" or "sequential" (accelerate's placement
  strategies), one device ("cpu", "cuda:1", a GPU index), or a dict {module name: device} where
  a device is a GPU index, "cpu", "disk" or a torch device string;
- `quantization`: "8bit" (LLM.int8) or "4bit" (NF4 with double quantization, computing in the
  LM's dtype), through transformers' `BitsAndBytesConfig`; it implies `device_map="auto"`;
- `max_memory`: {device: size} caps for the strategies, e.g. {0: "20GiB", "cpu": "60GiB"};
- `offload_folder`: where the weights placed on "disk" are kept.

With a device map, accelerate's hooks move each block's inputs to that block's device (and load
offloaded weights on the fly), so a block's output lives on its device. The site functions
(`sites.py`) hand an intervention its tensors on the device of the batch and put what it returns
back where the block needs it; a dispatched model is never moved (`is_dispatched`).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

import torch
from torch import nn

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies
QUANTIZATIONS = ("8bit", "4bit")
OFFLOADED = ("cpu", "disk")  # places a dict device map (or max_memory) may name besides devices
QUANT_INSTALL = "pip install 'lit-interventions[quant]'   (bitsandbytes; its CPU backend needs no CUDA)"


def _device(value, what: str):
    """A device of a device map or a max_memory key: a GPU index, "cpu", "disk" or a torch
    device string (canonical form)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(
            f"{what}={value!r}: a device is a GPU index (0, 1, ...), 'cpu', 'disk' or a device string such as 'cuda:1'"
        )
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        if int(value) < 0:
            raise ValueError(f"{what}={value!r}: a GPU index is >= 0")
        return int(value)
    if value in OFFLOADED:
        return value
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{what}={value!r} is not a device: use a GPU index (0, 1, ...), 'cpu', 'disk' or a "
            "device string such as 'cuda:1'"
        ) from None
    return value


def _size(value, what: str):
    """A max_memory size: bytes (int) or a string such as "20GiB" / "500MB"."""
    from accelerate.utils import convert_file_size_to_int

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what}={value!r}: a memory size is a number of bytes or a string such as '20GiB'")
    try:
        size = convert_file_size_to_int(value)
    except (ValueError, TypeError):
        raise ValueError(f"{what}={value!r} is not a memory size: use bytes or a string such as '20GiB'") from None
    if size <= 0:
        raise ValueError(f"{what}={value!r}: a memory size is > 0")
    return value


@dataclass(frozen=True)
class LoadOptions:
    """How to place (and quantize) a frozen LM. Validated when built, before anything loads."""

    device_map: str | int | dict | None = None
    quantization: str | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    def __post_init__(self):
        device_map = self.device_map
        if isinstance(device_map, str) and device_map not in STRATEGIES:
            try:
                device_map = _device(device_map, "device_map")
            except ValueError:
                raise ValueError(
                    f"device_map={device_map!r} is neither a placement strategy ({', '.join(STRATEGIES)}) "
                    "nor a device (0, 'cpu', 'cuda:1'); a dict {module name: device} is allowed too"
                ) from None
        elif isinstance(device_map, (int, bool)):
            device_map = _device(device_map, "device_map")
        elif isinstance(device_map, dict):
            if not device_map:
                raise ValueError("device_map={} is empty: map module names to devices, e.g. {'': 0}, or use 'auto'")
            for name in device_map:
                if not isinstance(name, str):
                    raise ValueError(f"device_map key {name!r} is not a module name (a string; '' is the whole model)")
            device_map = {name: _device(place, f"device_map[{name!r}]") for name, place in device_map.items()}
        elif device_map is not None and not isinstance(device_map, str):
            raise ValueError(
                f"device_map={device_map!r}: use None, one of {', '.join(STRATEGIES)}, a device "
                "(0, 'cpu', 'cuda:1') or a dict {module name: device}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)} or None"
            )
        if self.quantization is not None and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                f"quantization={self.quantization!r} needs bitsandbytes, which is not installed: {QUANT_INSTALL}"
            )
        if self.quantization is not None and device_map is None:
            device_map = "auto"  # bitsandbytes places the weights when it quantizes them
        max_memory = self.max_memory
        if max_memory is not None:
            if not isinstance(max_memory, dict) or not max_memory:
                raise ValueError(
                    f"max_memory={max_memory!r}: use a dict {{device: size}}, e.g. {{0: '20GiB', 'cpu': '60GiB'}}"
                )
            if not (isinstance(device_map, str) and device_map in STRATEGIES):
                raise ValueError(
                    f"max_memory is read by the placement strategies only: set device_map to one of "
                    f"{', '.join(STRATEGIES)} (not {device_map!r})"
                )
            max_memory = {
                _device(k, f"max_memory key {k!r}"): _size(v, f"max_memory[{k!r}]") for k, v in max_memory.items()
            }
        if self.offload_folder is not None:
            if not isinstance(self.offload_folder, str) or not self.offload_folder:
                raise ValueError(f"offload_folder={self.offload_folder!r} must be a directory path")
            if device_map is None:
                raise ValueError("offload_folder holds weights a device_map places on 'disk': set device_map too")
        object.__setattr__(self, "device_map", device_map)
        object.__setattr__(self, "max_memory", max_memory)

    # --- the load_lm cache is keyed by every option: a hashable, order-free string ------------

    def key(self) -> str:
        """'' for the defaults (so load_lm(x) keeps sharing its copy), else canonical JSON."""
        if self == LoadOptions():
            return ""
        pairs = lambda d: None if d is None else sorted(([k, v] for k, v in d.items()), key=str)  # noqa: E731
        return json.dumps(
            {
                "device_map": pairs(self.device_map) if isinstance(self.device_map, dict) else self.device_map,
                "device_map_is_dict": isinstance(self.device_map, dict),
                "quantization": self.quantization,
                "max_memory": pairs(self.max_memory),
                "offload_folder": self.offload_folder,
            },
            sort_keys=True,
        )

    @classmethod
    def from_key(cls, key: str) -> LoadOptions:
        if not key:
            return cls()
        data = json.loads(key)
        device_map = data["device_map"]
        if data["device_map_is_dict"]:
            device_map = {k: v for k, v in device_map}
        max_memory = None if data["max_memory"] is None else {k: v for k, v in data["max_memory"]}
        return cls(device_map, data["quantization"], max_memory, data["offload_folder"])

    def from_pretrained_kwargs(self, dtype: torch.dtype) -> dict:
        """The keyword arguments of `AutoModelForCausalLM.from_pretrained` (beyond dtype; `dtype`
        is the 4-bit compute dtype)."""
        kwargs = {}
        if self.device_map is not None:
            kwargs["device_map"] = self.device_map
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        if self.quantization is not None:
            kwargs["quantization_config"] = self.bitsandbytes_config(dtype)
        return kwargs

    def bitsandbytes_config(self, dtype: torch.dtype):
        from transformers import BitsAndBytesConfig

        places = list(self.device_map.values()) if isinstance(self.device_map, dict) else []
        places += list(self.max_memory or {})
        offloads = any(place in OFFLOADED for place in places)  # non-quantized fp32 modules on CPU / disk
        if self.quantization == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offloads)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            llm_int8_enable_fp32_cpu_offload=offloads,
        )


def check_module_names(device_map: dict, config) -> None:
    """Every module a dict device map names exists in the model of `config` (built on the meta
    device: no weights are read). transformers ignores an unknown name when the rest lands on one
    device; a typo would then place nothing where it was meant to."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    names = {name for name, _ in model.named_modules()}
    unknown = [name for name in device_map if name not in names]
    if unknown:
        top = [name for name in sorted(names) if name and name.count(".") <= 1 and not name.split(".")[-1].isdigit()]
        raise ValueError(
            f"device_map names modules this model does not have: {', '.join(map(repr, unknown[:5]))}; "
            f"its modules include {', '.join(top[:12])} (blocks: add .0, .1, ...; '' is the whole model)"
        )


# --- a loaded model -------------------------------------------------------------------------


def is_dispatched(model: nn.Module) -> bool:
    """Whether the model was placed by a device map (or quantized): it must not be moved."""
    return bool(getattr(model, "hf_device_map", None)) or bool(getattr(model, "is_quantized", False))


def execution_device(module: nn.Module) -> torch.device | None:
    """Where `module` computes: its accelerate hook's execution device (its weights may be on
    "meta", offloaded), else the device of its first parameter; None when it has neither."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:
        for inner in getattr(hook, "hooks", ()):  # a SequentialHook
            device = getattr(inner, "execution_device", None) or device
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for parameter in module.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return None


def input_device(model: nn.Module) -> torch.device:
    """The device of the model's inputs: where its embeddings compute (`model.device` is the
    first parameter's, "meta" when it is offloaded)."""
    if not is_dispatched(model):
        return model.device
    return execution_device(model.get_input_embeddings()) or torch.device("cpu")


def keep_4bit_differentiable(model: nn.Module) -> None:
    """bitsandbytes (0.50) repacks 4-bit weights for AVX512-BF16 CPUs on the first forward without
    gradients, then runs every later forward, with gradients too, through a kernel that has no
    backward: the gradient through the frozen LM, which trains the intervention, silently went to
    zero (measured on a tiny Llama: max |grad - grad of the dequantized model| 31.9, of 33.5).
    Keep the differentiable path (GPUs are unaffected)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
