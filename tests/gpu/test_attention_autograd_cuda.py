"""Autograd through the public CUDA attention: the forward kernel's saved (out, lse) feed the
backward kernels (gpu/attention_backward.py).  Gradients are within the contract's attention
"grad" tolerance of the strict fp32 reference, a sequence's dq/dk/dv are bitwise the same alone,
inside a padded batch, and packed varlen, and repeated runs give the same bits."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.reference.attention import attention_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


def _leaf(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE).requires_grad_(True)


def _grads(fn, inputs, grad_out):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, grad_out)


def _probe(sq, sk, hq, hkv, d, dtype, seed):
    q = _leaf(1, sq, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _leaf(1, sk, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _leaf(1, sk, hkv, d, dtype=dtype, seed=seed + 2)
    do = _leaf(1, sq, hq, d, dtype=dtype, seed=seed + 3).detach()
    return q, k, v, do


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (True, False))
def test_grads_within_tolerance_of_fp32_reference(dtype, d, causal):
    q, k, v, do = _probe(100, 100, 8, 2, d, dtype, seed=d)
    got = _grads(lambda *t: batchinv.attention(*t, causal=causal), (q, k, v), do)
    leaves32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = _grads(lambda *t: attention_fp32(*t, causal=causal), leaves32, do.float())
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert float(r.abs().max()) > 0, f"reference {name} is zero: the test would be vacuous"
        assert_within_tolerance(g, r, op_class="attention", kind="grad", name=name)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("position", (0, 1, 2))
def test_sequence_grads_bitwise_alone_vs_padded_batch(dtype, position):
    sq, hq, hkv, d = 77, 8, 2, 128
    q1, k1, v1, do1 = _probe(sq, sq, hq, hkv, d, dtype, seed=5)
    alone = _grads(lambda *t: batchinv.attention(*t, causal=True), (q1, k1, v1), do1)

    batch, width = 3, 130
    lens = [130, 45, 130]
    lens[position] = sq
    others = [_probe(width, width, hq, hkv, d, dtype, seed=50 + i) for i in range(batch)]
    nan_pad = float("nan")

    def stack(i_tensor):
        rows = []
        for b in range(batch):
            t = (q1, k1, v1, do1)[i_tensor] if b == position else others[b][i_tensor]
            t = t.detach()[0]
            padded = torch.full((width, *t.shape[1:]), nan_pad, dtype=dtype, device=DEVICE)
            padded[: t.shape[0]] = t
            rows.append(padded)
        return torch.stack(rows)

    q, k, v = (stack(i).requires_grad_(True) for i in range(3))
    do = torch.nan_to_num(stack(3), nan=0.0)  # the cotangent of padded rows is never read
    seqlens = torch.tensor(lens, device=DEVICE)
    dq, dk, dv = _grads(
        lambda *t: batchinv.attention(*t, causal=True, seqlens_q=seqlens, seqlens_k=seqlens),
        (q, k, v),
        do,
    )
    for name, g_batch, g_alone in zip(("dq", "dk", "dv"), (dq, dk, dv), alone, strict=True):
        assert_bitwise_equal(g_batch[position, :sq], g_alone[0], name=name)
        # Padding rows get exact zeros, never NaN from the NaN-filled storage.
        assert_bitwise_equal(g_batch[position, sq:], torch.zeros_like(g_batch[position, sq:]))


def test_varlen_grads_bitwise_equal_padded_and_repeatable():
    dtype, hq, hkv, d = torch.bfloat16, 8, 2, 64
    lens = [33, 100, 7]
    probes = [_probe(n, n, hq, hkv, d, dtype, seed=90 + n) for n in lens]
    q = torch.cat([p[0].detach()[0] for p in probes]).requires_grad_(True)
    k = torch.cat([p[1].detach()[0] for p in probes]).requires_grad_(True)
    v = torch.cat([p[2].detach()[0] for p in probes]).requires_grad_(True)
    do = torch.cat([p[3][0] for p in probes])
    cu = torch.tensor([0, 33, 133, 140], dtype=torch.int32, device=DEVICE)

    def varlen(*t):
        return batchinv.attention_varlen(*t, cu, cu, causal=True)

    first = _grads(varlen, (q, k, v), do)
    again = _grads(varlen, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
        assert_bitwise_equal(a, b, name=f"{name} run to run")
    start = 0
    for (pq, pk, pv, pdo), n in zip(probes, lens, strict=True):
        alone = _grads(lambda *t: batchinv.attention(*t, causal=True), (pq, pk, pv), pdo)
        for name, packed, single in zip(("dq", "dk", "dv"), first, alone, strict=True):
            assert_bitwise_equal(packed[start : start + n], single[0], name=f"{name} len {n}")
        start += n
