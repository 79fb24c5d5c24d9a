"""The model card (README.md) of a saved artifact, generated from its config.json: YAML front
matter (library_name, tags, base_model), then the LM, site, data, metrics, the command that
made it, and how to load it. `lit_interventions.artifacts.hub` writes it beside config.json."""

from __future__ import annotations

import json
import shlex

from huggingface_hub import ModelCard, ModelCardData

LIBRARY = "lit-interventions"
# the example texts of the "Use" section: an interchange's base and source; a steering prompt
EXAMPLE_PROMPT, EXAMPLE_SOURCE = "The author near the keys", "The authors near the keys"
STEERING_PROMPT = "Write one sentence about your day."
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
    lines += use_section(config)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _example_options(config: dict) -> tuple[str, list[str]]:
    """(generate's options, apply's keyword arguments) for the artifact's kind of edit."""
    kind = config.get("kind", "intervention")
    if kind == "dictionary":
        concept = (config.get("concepts") or ["0"])[0]
        return f"--concept {shlex.quote(concept)} --factor 1.0", [f"concept={json.dumps(concept)}", "factor=1.0"]
    if kind == "intervention" and config.get("needs_source"):
        example = _example(config)
        cli = f"--source {shlex.quote(example['source'])}"
        kwargs = ["tokenizer=tok", f"source={json.dumps(example['source'])}"]
        if example.get("span") and example.get("source_span"):
            cli += f" --span {shlex.quote(example['span'])} --source_span {shlex.quote(example['source_span'])}"
            kwargs += [
                f"positions=span_position(tok, {json.dumps(example['prompt'])}, {json.dumps(example['span'])})",
                f"source_positions=span_position(tok, {json.dumps(example['source'])}, "
                f"{json.dumps(example['source_span'])})",
            ]
        return cli, kwargs
    return "", []


def _example(config: dict) -> dict:
    """The interchange example the card shows: the one config.json records (a pair of its data,
    with the site's spans), else a generic pair read at the last tokens."""
    example = config.get("example")
    if isinstance(example, dict) and all(isinstance(example.get(k), str) for k in ("prompt", "source")):
        return example
    return {"prompt": EXAMPLE_PROMPT, "source": EXAMPLE_SOURCE}


def use_section(config: dict) -> list[str]:
    """How to use it: `lit-interventions generate` and `serve` on it, and the Python call
    (`lit_interventions.apply`), each runnable as written once REPO_OR_DIRECTORY is replaced."""
    kind, model = config.get("kind", "intervention"), config.get("model")
    lines = ["## Use", ""]
    if kind == "sae":
        return lines + [
            "```python",
            "from lit_interventions import from_pretrained",
            'sae = from_pretrained("REPO_OR_DIRECTORY")   # encode / decode a site\'s states',
            "```",
            "",
        ]
    cli, kwargs = _example_options(config)
    interchange = bool(config.get("needs_source"))
    prompt = _example(config)["prompt"] if interchange else STEERING_PROMPT
    generate = f"lit-interventions generate --artifact REPO_OR_DIRECTORY --prompt {shlex.quote(prompt)}"
    serve = [] if interchange else ["lit-interventions serve --artifact REPO_OR_DIRECTORY --port 8000"]
    names = "apply, encode_text, load_lm, load_tokenizer" + (
        ", span_position" if any("span_position" in k for k in kwargs) else ""
    )
    lines += [
        "Generate with it, beside the unsteered continuation"
        + (", or serve it (OpenAI-compatible):" if serve else ":"),
        "",
        "```bash",
        f"{generate} {cli}".rstrip(),
        *serve,
        "```",
        "",
        "```python",
        f"from lit_interventions import {names}",
        "",
        f"lm, tok = load_lm({json.dumps(model)}), load_tokenizer({json.dumps(model)})",
        f'ids = encode_text(tok, {json.dumps(prompt)})["input_ids"]',
        "with apply(",  # one argument a line, with a trailing comma: as ruff formats it
        "    lm,",
        '    "REPO_OR_DIRECTORY",',
        *(f"    {kwarg}," for kwarg in kwargs),
        ") as model:",
        "    print(tok.decode(model.generate(ids, max_new_tokens=20)[0]))",
    ]
    if kind == "dictionary":
        lines += [
            "",
            "from lit_interventions import Dictionary",
            "",
            'scores = Dictionary.from_pretrained("REPO_OR_DIRECTORY").detect(["some text"])  # (texts, concepts)',
        ]
    return [*lines, "```", ""]
