"""A LoRA run as a PEFT adapter directory.

    lit-interventions export --artifact LORA_RUN_DIR --to peft --out DIR
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)
    vllm serve BASE --enable-lora --lora-modules concept=DIR

`adapter_config.json` is written by peft's own `LoraConfig.save_pretrained` (the adapter's config
as the run trained it, with `base_model_name_or_path` set to the LM's hub id when known and
`inference_mode` true, as `PeftModel.save_pretrained` saves it); `adapter_model.safetensors`
holds `get_peft_model_state_dict`'s tensors under the names peft saves them, with peft's
`{"format": "pt"}` metadata.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from safetensors.torch import save

from lit_interventions.artifacts.hub import base_model
from lit_interventions.core.files import check_finite, write_atomically
from lit_interventions.export.layout import PEFT_CONFIG, PEFT_WEIGHTS
from lit_interventions.export.request import ExportRequest


def write_peft(adapter, request: ExportRequest) -> list[Path]:
    """`request.out` as a PEFT adapter directory, from `adapter.peft_adapter()`: (its LoraConfig,
    its state dict as `get_peft_model_state_dict` gives it)."""
    config, tensors = request.call(adapter, "peft_adapter")
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base_model(request.model) or request.model
    config.inference_mode = True
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    check_finite(tensors, request.directory, "export")
    with tempfile.TemporaryDirectory(prefix="lit-interventions-peft-") as tmp:
        config.save_pretrained(tmp)
        text = (Path(tmp) / PEFT_CONFIG).read_text(encoding="utf-8")
    request.out.mkdir(parents=True, exist_ok=True)
    weights = write_atomically(request.out / PEFT_WEIGHTS, save(tensors, metadata={"format": "pt"}))
    return [weights, write_atomically(request.out / PEFT_CONFIG, text)]
