"""Reading masks back into batchinv's attention: padded, causal and packed (block-diagonal)
masks route exactly; holes and sliding windows are refused."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.integrations.attention_masks import attention_with_mask, query_runs


def _block_causal(lengths: tuple[int, ...], pad_left: int = 0) -> torch.Tensor:
    """``[S, S]`` bool: each sequence sees its own earlier tokens; ``pad_left`` padded slots
    first, seeing nothing."""
    total = pad_left + sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    start = pad_left
    for n in lengths:
        mask[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return mask


def _qkv(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, 4, 16, generator=gen)
    k = torch.randn(1, total, 2, 16, generator=gen)
    v = torch.randn(1, total, 2, 16, generator=gen)
    return q, k, v


@pytest.mark.parametrize("pad_left", [0, 2])
def test_packed_sequences_are_each_computed_alone(pad_left):
    lengths = (4, 1, 6)
    mask = _block_causal(lengths, pad_left)
    q, k, v = _qkv(mask.shape[0])
    out = attention_with_mask(q, k, v, mask[None, None], causal=False, softmax_scale=None)
    start = pad_left
    for n in lengths:
        piece = slice(start, start + n)
        alone = batchinv.attention(q[:, piece], k[:, piece], v[:, piece], causal=True)
        assert_bitwise_equal(out[:, piece], alone)
        start += n
    assert bool((out[:, :pad_left] == 0).all())  # queries that see no key give zeros


def test_packed_runs_start_at_each_sequence():
    runs = query_runs(_block_causal((4, 1, 6))[None])
    assert runs["run_first"].tolist() == [0, 4, 5]
    assert runs["lq"].tolist() == runs["lk"].tolist() == [4, 1, 6]
    assert runs["causal"].tolist() == [True, False, True]  # one query: no causal link


@pytest.mark.parametrize(
    "make_mask",
    [
        # a sliding window of 2: neighbouring queries see overlapping intervals
        lambda: torch.ones(5, 5, dtype=torch.bool).tril().triu(-1),
        # a hole: query 3 skips key 1
        lambda: (
            torch.ones(5, 5, dtype=torch.bool)
            .tril()
            .index_put_((torch.tensor([3]), torch.tensor([1])), torch.tensor(False))
        ),
    ],
    ids=["sliding window", "hole"],
)
def test_masks_that_are_not_intervals_are_refused(make_mask):
    q, k, v = _qkv(5)
    with pytest.raises(ValueError, match="not padding / causal / packed"):
        attention_with_mask(q, k, v, make_mask()[None, None], causal=False, softmax_scale=None)
