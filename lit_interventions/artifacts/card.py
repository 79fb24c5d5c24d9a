"""The model card (README.md) of a saved artifact, generated from its config.json: YAML front
matter (library_name, tags, base_model), then the LM, site, data, metrics, the command that
made it, and how to load it. `lit_interventions.artifacts.hub` writes it beside config.json."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard, ModelCardData

LIBRARY = "lit-interventions"
# what the model card calls each kind of artifact
NOUNS = {
    "intervention": "intervention",
    "dictionary": "concept dictionary",
    "sae": "sparse autoencoder",
    "steering": "steering adapter",
}


def _site_text(site) -> str:
    if not isinstance(site, dict):
        return str(site)
    if "sites" in site:
        return "; ".join(_site_text(s) for s in site["sites"])
    component = site.get("component") or "block_output"
    where = "the residual stream" if component == "block_output" else f"the {component}"
    text = (
        f"{where} after block {site.get('layer')}"
        if component == "block_output"
        else f"{where} of block {site.get('layer')}"
    )
    return text + (f", at the last token of the `{site['region']}` region" if site.get("region") else "")


def _data_text(config: dict) -> str:
    if config.get("training_data"):
        return f"`{config['training_data']}`"
    data = config.get("data")
    if isinstance(data, dict) and data:
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in data.items() if v is not None)
    return str(data) if data else "not recorded"


def model_card(config: dict):
    """A `huggingface_hub.ModelCard` for the artifact `config` (config.json) describes: YAML front
    matter (library_name, tags, base_model) and the LM, site, data, metrics and command."""
    kind = config.get("kind", "intervention")
    method = config.get("method") or "intervention"
    model, base = config.get("model"), config.get("base_model")
    tags = [LIBRARY, "interpretability", "interventions", str(method).lower()]
    tags += ["concept-dictionary", "axbench", "steering"] if kind == "dictionary" else []
    tags += ["sparse-autoencoder"] if kind == "sae" else ["axbench", "steering"] if kind == "steering" else []
    tags += ["causalgym"] if config.get("task") else []
    data = ModelCardData(library_name=LIBRARY, tags=list(dict.fromkeys(tags)), base_model=base)
    noun = NOUNS.get(kind, "intervention")
    layer = (config.get("site") or {}).get("layer") if isinstance(config.get("site"), dict) else None
    layer = config.get("layer") if layer is None else layer
    lm = f"`{model}`" + (f" ([{base}](https://huggingface.co/{base}))" if base else "")
    rows = [
        ("language model (frozen, not included)", lm),
        ("site", _site_text(config.get("site"))),
        ("method", f"`{method}`"),
        ("data", _data_text(config)),
    ]
    if config.get("task"):
        rows.append(("task", f"`{config['task']}`"))
    if kind == "dictionary":
        rows.append(("concepts", f"{config.get('num_concepts')} × hidden size {config.get('hidden_size')}"))
    elif config.get("config"):
        rows.append(("config", f"`{json.dumps(config['config'])}`"))
    lines = [
        f"# {method} {noun} for {model}" + (f", layer {layer}" if layer is not None else ""),
        "",
        f"{'An' if noun[0] in 'aeiou' else 'A'} {noun} (`{config.get('class_path')}`) trained with lit-interventions on a frozen language "
        "model; this repository holds its tensors "
        f"(`{config.get('weights')}`) and its settings (`config.json`), never the language model.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
    ]
    metrics = config.get("metrics") or {}
    if metrics:
        lines += [
            "## Metrics",
            "",
            "| metric | value |",
            "|---|---|",
            *(f"| `{k}` | {v:.4g} |" for k, v in metrics.items()),
            "",
        ]
    if kind == "dictionary" and config.get("concepts"):
        lines += ["## Concepts", "", *(f"{i}. {c}" for i, c in enumerate(config["concepts"])), ""]
    lines += ["## Command", "", "```bash", config.get("command") or "not recorded", "```", ""]
    if config.get("training") and config.get("training") != config.get("command"):
        lines += [f"How it was trained: {config['training']}", ""]
    lines += ["## Use", "", "```python"]
    if kind == "dictionary":
        lines += [
            "from lit_interventions.artifacts.dictionary import Dictionary",
            "from lit_interventions.core.lm import load_lm",
            "",
            'd = Dictionary.from_pretrained("REPO_OR_DIRECTORY")',
            'scores = d.detect(["some text"])              # (texts, concepts)',
            "with d.steer(load_lm(d.model), d.concepts[0], factor=1.0) as lm: ...",
        ]
    else:
        lines += [
            "from lit_interventions import from_pretrained",
            f'{kind} = from_pretrained("REPO_OR_DIRECTORY")   # loaded by config.json\'s kind',
        ]
    lines += ["```", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
