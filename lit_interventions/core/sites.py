"""Where to intervene: read and write the residual stream of any decoder-only HF causal LM, the
output of a block's attention or MLP, one or several attention heads (their output before the
output projection, or their query, key or value), or the MLP's hidden units.

A site is (layer, component, token position per example); see `Site`. Layers follow pyvene's
`block_output`:
- `layer = l` for 0 <= l < L is the residual stream after decoder block l;
- `layer = -1` is the embedding output, i.e. the residual stream before block 0.

Decoder blocks, their attention and MLP modules and the projections inside them are found
generically (`decoder_layers`, `component_module`, `parts.site_tap`), not from a
per-architecture table, so GPT-NeoX, GPT-2, Llama, Gemma 2, Gemma 3 and OPT all work. Positions
are per example, shape (batch,).

A model spread over devices by a device map (`sharding.py`) computes each block on its own
device: the hooks hand `on_hidden` (the intervention) its tensor on the device of the inputs and
put what it returns back on the block's device, and the returned states and logits are on the
device of the inputs.

This module defines `Site`; the work is done in `blocks.py` (finding blocks and components,
checking layers and heads), `parts.py` (the projections and heads inside them), `hooks.py` (hooks
at a site), `forward.py` (running the body, reading layers, logits at positions) and `stacked.py`
(rows at several layers in one forward); import each name from its own module.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_interventions.core.blocks import (
    BLOCK_OUTPUT,
    COMPONENTS,
    POSITIONS,
    check_head,
    check_layer_component,
    one_of,
    site_width,
)


@dataclass(frozen=True)
class Site:
    """Where an intervention reads and writes: a layer, a component of it and a token position.

    Components (`PYVENE_NAMES`: pyvene's name of each):
    - `block_output`: the residual stream after decoder block `layer` (layer -1: the embeddings);
    - `block_input`: the residual stream entering block `layer` (block_output of layer - 1);
    - `attention_output`: the output of block `layer`'s attention module, what it adds to the
      residual stream (Gemma: before its post-attention norm, like pyvene);
    - `mlp_output`: the output of block `layer`'s MLP module (Gemma: before its post-MLP norm;
      OPT, whose MLP is inline: the output of fc2);
    - `attention_head`: the output of the heads `head` before the attention's output projection
      (pyvene's head_attention_value_output), head_dim × len(head) features;
    - `query`, `key`, `value`: the heads `head` of the q, k or v projection's output (pyvene's
      head_query_output, ...); key and value count the key/value heads of grouped-query attention;
    - `mlp_neuron`: the MLP's hidden units, the input of its down projection.

    `head`: one head index, or a list of them, for the head components only; their states are
    concatenated in the order given, (batch, head_dim × len(head)).

    Positions, recorded and validated here (the data gives the token indices):
    - `region`: the last token of the template region `region` (None: the task's label variable);
    - `last`: the last non-pad token;
    - `response`: every response token (steering).
    """

    layer: int
    component: str = BLOCK_OUTPUT
    position: str = "region"
    region: str | None = None
    head: int | tuple[int, ...] | None = None

    def __post_init__(self):
        one_of("component", self.component, COMPONENTS)
        one_of("position", self.position, POSITIONS)
        if self.region is not None and self.position != "region":
            raise ValueError(f"region={self.region!r} is only read with position='region', not {self.position!r}.")
        check_head(self.component, self.head)
        if isinstance(self.head, list):  # a list from a config: hashable, like the rest of the site
            object.__setattr__(self, "head", tuple(self.head))

    def check(self, n_layers: int, config=None) -> None:
        """A ValueError unless a model of `n_layers` has this site's layer and component, and,
        given the model's `config`, its heads."""
        check_layer_component(self.layer, self.component, n_layers)
        check_head(self.component, self.head, config)

    def width(self, config) -> int:
        """d, the size of the state at this site in a model of `config` (`site_width`)."""
        return site_width(config, self.component, self.head)
