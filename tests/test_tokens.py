"""The shared token helpers: the token that holds a character, and padding on either side."""

import pytest
import torch

from lit_interventions.core.tokens import pad_batch, token_covering


def test_token_covering_takes_the_token_holding_the_character():
    offsets = [(0, 0), (0, 3), (3, 4), (4, 9), (4, 9), (10, 12)]  # BOS, "The", " ", "café" as 2 byte tokens, ...
    assert token_covering(offsets, 2) == 1
    assert token_covering(offsets, 3) == 2
    assert token_covering(offsets, 8) == 4  # the last of the tokens sharing a character's offsets
    assert token_covering(offsets, 9) == 4  # an uncovered space: the token before it
    with pytest.raises(ValueError, match="No token covers character 0 of 'x'"):
        token_covering([(0, 0)], 0, "x")


def test_pad_batch_on_both_sides():
    ids, mask, shift = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert shift.tolist() == [0, 0]
    ids, mask, shift = pad_batch([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert shift.tolist() == [0, 2] and ids.dtype == torch.long
    with pytest.raises(ValueError, match="side='middle'"):
        pad_batch([[1]], 0, "middle")
