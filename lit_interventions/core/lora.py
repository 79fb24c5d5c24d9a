"""A LoRA adapter applied to an LM with hooks (`lit_interventions.apply`): peft's LoRA forward,
W₀x + (α/r)·B A x, on the modules the adapter names, removed again when the block ends (the LM is
never modified in place). The request's factor scales the edit as for any artifact
(`lit_interventions.core.edits.scaled`): W₀x + factor·(α/r)·B A x, exactly peft's output at
factor 1."""

from __future__ import annotations

import torch

from lit_interventions.core.edits import STEERING_RULE, ApplyRequest, Edit, lm_name, scaled


def lora_edits(tensors: dict[str, torch.Tensor], scale: float, request: ApplyRequest, config: dict, where: str):
    """One edit per adapted module of peft's state dict (`...<module>.lora_A.weight` and
    `lora_B.weight`): its output + scale·B A x, with x the module's input (peft's LoRA forward
    without dropout), scaled by the request's factor (`scaled`)."""
    modules = dict(request.lm.named_modules())
    edits = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        name = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        down, up = tensors[key], tensors[key.replace("lora_A", "lora_B")]
        module = modules.get(name)
        if (
            getattr(module, "in_features", None) != down.shape[1]
            or getattr(module, "out_features", None) != up.shape[0]
        ):
            shape = f"{down.shape[1]} -> {up.shape[0]}"
            has = (
                "no such module"
                if module is None
                else f"{getattr(module, 'in_features', '?')} -> {getattr(module, 'out_features', '?')}"
            )
            raise ValueError(
                f"{where} was trained on {config.get('model')!r} ({name}: {shape}); the LM given, "
                f"{lm_name(request.lm)!r}, has {has}"
            )

        def lora(states, rows, inputs, down=down, up=up):
            edited = states + scale * (inputs.to(down.dtype) @ down.to(inputs.device).T) @ up.to(inputs.device).T
            return scaled(states, edited, request.per_row(request.factor, rows))

        edits.append(Edit(lora, request.positions.resolved(STEERING_RULE), module=name))
    return edits
