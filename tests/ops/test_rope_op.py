"""batchinv.rope on CPU: the registry, the reference path, autograd, the module, bad input."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal
from batchinv.reference import rope as reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
THETA = 1_000_000.0


def _case(dtype, tokens=(2, 5), hq=4, hk=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(*tokens, hk, d, generator=gen).to(dtype)
    positions = torch.randint(0, 1000, tokens, generator=gen)
    return q, k, positions


def test_every_backend_is_registered():
    assert registry.registered_ops()["rope"] == ("cpu", "cuda", "hip")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_forward_and_gradients_are_the_reference(dtype):
    q, k, positions = _case(dtype)
    got = batchinv.rope(q, k, positions, theta=THETA)
    assert_bitwise_equal(list(got), list(reference.rope(q, k, positions, theta=THETA)))
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward(batchinv.rope(ql, kl, positions, theta=THETA), [gq, gk])
    want = reference.rope_backward(gq, gk, positions, theta=THETA)
    assert_bitwise_equal([ql.grad, kl.grad], list(want))


def test_module_uses_qwen3_defaults():
    module = batchinv.nn.RotaryEmbedding(16)
    assert module.theta == 1_000_000.0 and module.max_position == 40960
    q, k, positions = _case(torch.float32)
    got = module(q, k, positions)
    want = reference.rope(q, k, positions, theta=THETA, head_dim=16, max_position=40960)
    assert_bitwise_equal(list(got), list(want))
    with pytest.raises(IndexError, match=r"position_ids\[0, 1\] = 40960"):
        positions[0, 1] = 40960
        module(q, k, positions)


def test_bad_input_names_the_argument():
    q, k, positions = _case(torch.float32)
    with pytest.raises(
        IndexError, match=r"position_ids\[1, 2\] = -1 is outside the valid range \[0, 100\)"
    ):
        bad = positions.clone() % 100
        bad[1, 2] = -1
        batchinv.rope(q, k, bad, theta=THETA, max_position=100)
    with pytest.raises(ValueError, match="head_dim must be even"):
        batchinv.rope(q[..., :5], k[..., :5], positions, theta=THETA)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        batchinv.rope(q, k, positions[:1], theta=THETA)
    with pytest.raises(ValueError, match="position_ids is on meta but q is on cpu"):
        batchinv.rope(q, k, positions.to("meta"), theta=THETA)
    with pytest.raises(TypeError, match="check_positions must be a bool"):
        batchinv.rope(q, k, positions, theta=THETA, check_positions=1)
    with pytest.raises(ValueError, match="max_position must be in"):
        batchinv.rope(q, k, positions, theta=THETA, max_position=2**25)


def test_inputs_are_not_mutated():
    q, k, positions = _case(torch.bfloat16)
    before = [t.clone() for t in (q, k, positions)]
    batchinv.rope(q, k, positions, theta=THETA)
    for t, b in zip((q, k, positions), before, strict=True):
        assert_bitwise_equal(t, b)
