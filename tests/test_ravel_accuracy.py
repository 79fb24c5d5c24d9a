"""RAVEL's official accuracy by hand: 3 greedy tokens against the label's first 3 (prefix match,
padding a match), averaged per template within an attribute; and the intervened generation
against a token-by-token loop on a tiny model."""

import pytest
import torch
from lit_interventions.datamodules.ravel_answers import answer_hit, greedy_tokens, named_value

from lit_interventions.core.batch import CAUSE, ISO, PairBatch, Side
from lit_interventions.core.blocks import decoder_layers
from lit_interventions.interventions.featurizers import FullVectorSwap
from lit_interventions.interventions.rotation import RotatedSpaceIntervention
from lit_interventions.metrics.disentangle import Disentanglement, answer_hits
from lit_interventions.modules.generation import greedy_answers
from lit_interventions.modules.interchange import InterchangeModule

P = -100  # padding past a shorter label
GROUPS = [0, 1, 1, 2]  # the attribute of each of 4 templates
# (generated, label, kind, template): the first-token and 3-token rules disagree on rows 1, 5, 9;
# template 1 has 3 rows and template 2 one, so pooling attribute 1 and averaging its templates
# disagree.
ROWS = [
    ([5, 6, 7], [5, 6, 7], CAUSE, 0),  # right by both rules
    ([5, 6, 9], [5, 6, 7], CAUSE, 0),  # first token right, third wrong
    ([5, 8, 8], [5, P, P], CAUSE, 0),  # a one-token label: only its token counts
    ([4, 6, 7], [5, 6, 7], CAUSE, 0),  # wrong by both
    ([1, 2, 3], [1, 2, 3], ISO, 1),
    ([1, 2, 4], [1, 2, 3], ISO, 1),  # first token right, third wrong
    ([1, 2, 3], [1, 2, P], ISO, 1),
    ([2, 2, 2], [3, 3, 3], ISO, 2),
    ([7, 7, 7], [7, 7, 7], ISO, 3),
    ([7, 0, 0], [7, 1, P], ISO, 3),  # first token right, second wrong
]


def _official(rows, n):
    """`compute_metrics` (a row is right when every label token among its first n, padding
    aside, equals the generated token at its place) and `compute_disentangle_score` (the mean
    over an attribute's templates of their accuracy; Cause over the target's, Iso the mean over
    the other attributes)."""
    per_template = {}
    for generated, label, kind, template in rows:
        hit = all(t == P or t == g for g, t in zip(generated[:n], label[:n]))
        per_template.setdefault((kind, template), []).append(hit)
    per_attribute = {}
    for (kind, template), hits in per_template.items():
        per_attribute.setdefault((kind, GROUPS[template]), []).append(sum(hits) / len(hits))
    mean = {key: sum(v) / len(v) for key, v in per_attribute.items()}
    cause = [v for (kind, _), v in mean.items() if kind == CAUSE]
    iso = [v for (kind, _), v in mean.items() if kind == ISO]
    return sum(cause) / len(cause), sum(iso) / len(iso)


def _metric(rows, n, average):
    metric = Disentanglement(3, GROUPS, average)
    generated = torch.tensor([r[0] for r in rows])[:, :n]
    label = torch.tensor([r[1] for r in rows])[:, :n]
    kind = torch.tensor([r[2] for r in rows])
    group = torch.tensor([r[3] for r in rows])
    attribute = torch.tensor(GROUPS)[group]
    metric.update(generated[:4], label[:4], label[:4], attribute[:4], kind[:4], group[:4])
    metric.update(generated[4:], label[4:], label[4:], attribute[4:], kind[4:], group[4:])
    return metric.compute()


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def test_official_accuracy_equals_the_definition_by_hand():
    cause, iso = _official(ROWS, 3)
    # by hand: Cause 2/4; Iso: attribute 1 = mean(2/3, 0/1) = 1/3, attribute 2 = 1/2 -> 5/12
    assert cause == 0.5 and iso == pytest.approx(5 / 12, abs=1e-15)
    values = _metric(ROWS, 3, "templates")
    assert values["cause"].item() == _f32(cause)
    assert values["iso"].item() == _f32(iso)
    assert values["disentangle"].item() == _f32((cause + iso) / 2)
    assert values["iso_per_attribute"][1:].tolist() == [_f32(1 / 3), 0.5]


def test_the_first_token_rule_and_pooling_give_other_numbers():
    first = _metric(ROWS, 1, "templates")  # first token: Cause 3/4, Iso mean(mean(3/3, 0/1), 2/2) = 3/4
    assert (first["cause"].item(), first["iso"].item()) == (0.75, 0.75) == _official(ROWS, 1)
    pooled = _metric(ROWS, 3, "examples")  # attribute 1 pooled: 2/4
    assert (pooled["cause"].item(), pooled["iso"].item()) == (0.5, 0.5)


def test_answer_hits_and_named_values():
    generated = torch.tensor([[5, 6, 9], [5, 8, 8]])
    assert answer_hits(generated, torch.tensor([[5, 6, 7], [5, P, P]])).tolist() == [False, True]
    assert answer_hits(generated[:, 0], torch.tensor([5, 4])).tolist() == [True, False]
    with pytest.raises(ValueError, match="labels of 3 tokens against generations of 1"):
        answer_hits(generated[:, :1], torch.tensor([[5, 6, 7], [5, P, P]]))
    assert answer_hit([5, 6, 9], (5, 6)) and not answer_hit([5, 6, 9], (5, 7)) and not answer_hit([5], (5, 6))
    # the longest value the generation starts with; none: the generation itself
    assert named_value([5, 6, 9], {(5,), (5, 6), (4, 6)}) == (5, 6)
    assert named_value([3, 6, 9], {(5,), (5, 6)}) == (3, 6, 9)


def _pair_batch(tokenizer, padding_side):
    """Four pairs whose site is the second token of the base and of the source (in the prompt),
    labels 3 tokens wide."""
    texts = ["The dog is here.", "the keys to the cabinet", "The dog is", "the author of the books"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))

    def side(seqs):
        pad = [width - len(s) for s in seqs]
        if padding_side == "left":
            rows = [[0] * p + s for s, p in zip(seqs, pad)]
            mask = [[0] * p + [1] * len(s) for s, p in zip(seqs, pad)]
            shift = torch.tensor(pad)
        else:
            rows = [s + [0] * p for s, p in zip(seqs, pad)]
            mask = [[1] * len(s) + [0] * p for s, p in zip(seqs, pad)]
            shift = torch.zeros(len(seqs), dtype=torch.long)
        last = torch.tensor([len(s) - 1 for s in seqs]) + shift
        return Side(torch.tensor(rows), torch.tensor(mask), 1 + shift, last)

    answers = torch.full((4, 2, 3), 1)
    return PairBatch(
        side(ids),
        side(ids[::-1]),
        torch.zeros(4, dtype=torch.long),
        torch.tensor([CAUSE, CAUSE, ISO, ISO]),
        torch.zeros(4, dtype=torch.long),
        answers,
        torch.zeros(4, dtype=torch.long),
    ), ids


def _by_hand(module, ids, layer, n=3):
    """Each row alone, unpadded: f(s) read at the source's second token; then n forwards of the
    base extended by the tokens so far, a hook writing f*(f(b), f(s)) at the base's second token
    in every one, the argmax at the last token appended."""
    model = module.lm
    out = []
    for i, base in enumerate(ids):
        source = ids[::-1][i]
        with torch.no_grad():
            hidden = model(torch.tensor([source]), output_hidden_states=True).hidden_states[layer + 1]
        f_source = hidden[:, 1]

        def write(block, args, output):
            states = output[0] if isinstance(output, tuple) else output
            states = states.clone()
            states[:, 1] = module.intervention(states[:, 1], f_source).to(states.dtype)
            return (states, *output[1:]) if isinstance(output, tuple) else states

        tokens = list(base)
        handle = decoder_layers(model)[layer].register_forward_hook(write)
        try:
            for _ in range(n):
                with torch.no_grad():
                    logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
        finally:
            handle.remove()
        out.append(tokens[len(base) :])
    return out


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("method", ["das", "swap"])
def test_greedy_answers_equal_a_token_by_token_generation(tiny_lm_dir, tokenizer, padding_side, cache, method):
    torch.manual_seed(0)
    intervention = FullVectorSwap if method == "swap" else (lambda d: RotatedSpaceIntervention(d, k=4))
    module = InterchangeModule(lm=tiny_lm_dir("llama"), layer=0, intervention=intervention, cache=cache)
    batch, ids = _pair_batch(tokenizer, padding_side)
    got = greedy_answers(module, batch)
    assert got.shape == (4, 3)
    assert got.tolist() == _by_hand(module, ids, layer=0)
    clean = greedy_tokens(module.lm, ids, 0, 3)  # the unintervened generation differs
    assert got.tolist() != clean


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("filled", ["no", "prefix", "below"])
def test_answers_with_kept_keys_equal_a_token_by_token_generation(tiny_lm_dir, tokenizer, arch, padding_side, filled):
    """`intervened_answers` on the activation cache (the later tokens one column each, the
    prompt's keys and values kept; `filled`: the bases' columns before the site read from the
    cache, and with "below" their keys and values up to the layer too) against full forwards of
    each row alone, and its first logits against `intervened_logits`."""
    torch.manual_seed(0)
    module = InterchangeModule(
        lm=tiny_lm_dir(arch), layer=1, intervention=lambda d: RotatedSpaceIntervention(d, k=4), cache=True
    )
    batch, ids = _pair_batch(tokenizer, padding_side)
    if filled != "no":
        module.activations.fill([batch], below=filled == "below")
        assert module._prefix(batch) is not None
    kept = module.activations.keys_values_below(1, batch.base)
    assert (kept is not None) == (filled == "below")
    first, got = module.intervened_answers(batch)
    assert got.tolist() == _by_hand(module, ids, layer=1)
    torch.testing.assert_close(first, module.intervened_logits(batch), rtol=1e-5, atol=1e-5)
    assert got.tolist() == greedy_answers(module, batch).tolist()  # the prompt extended a token at a time


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_greedy_tokens_with_kept_keys_equal_full_forwards(tiny_lm_dir, tokenizer, arch):
    """The data's n-token answers (left padding, keys and values kept) against each prompt alone,
    unpadded, one full forward per token."""
    from lit_interventions.core.lm import load_lm

    model = load_lm(tiny_lm_dir(arch))
    seqs = [tokenizer(t)["input_ids"] for t in ("The dog is here.", "the keys", "The author of the books is")]
    by_hand = []
    for seq in seqs:
        tokens = list(seq)
        for _ in range(3):
            with torch.no_grad():
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        by_hand.append(tokens[len(seq) :])
    assert greedy_tokens(model, seqs, 0, 3) == by_hand
    assert greedy_tokens(model, seqs, 0, 1) == [t[:1] for t in by_hand]
