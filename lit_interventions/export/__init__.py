"""A trained artifact written in a format another tool reads: `lit-interventions export`.

    lit-interventions export --artifact PATH_OR_HUB_ID --to FORMAT --out DIR [--concept C] [--factor F]

Each format (`formats.FORMATS`) is defined by a capability, a method the loaded artifact provides;
an artifact without it is refused in one line naming its class and the formats it supports:

    format               capability                 writes                                        module
    peft                 peft_adapter()             adapter_config.json + adapter_model.safetensors  peft_adapter.py
    gguf-control-vector  steering_vectors()         one llama.cpp control vector (.gguf) a concept  control_vector.py
    pyvene               to_pyvene() or             an IntervenableModel.save directory             pyvene_format.py
                         steering_vectors()         (one per concept)
    lm-eval              steering_vectors()         lm-evaluation-harness's steering .pt a concept  lm_eval_steering.py

`formats` holds the table and `export_artifact`, `request` what one export is asked for, `layout`
the files each format writes (an output directory may hold only those), `cli` the command.
docs/export.md says what each tool does with the files. This package is imported by the command
and by pyvene, which imports `pyvene_interventions` when it loads a LoReFT export.
"""
