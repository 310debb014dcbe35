"""Autograd through the public CUDA attention: the forward kernel's saved (out, lse) feed the
backward kernels (gpu/attention_backward.py).  Gradients are within the contract's attention
"grad" tolerance of the strict fp32 reference, a sequence's dq/dk/dv are bitwise the same alone,
inside a padded batch, and packed varlen, and repeated runs give the same bits."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import attention_backward as gpu_attention_backward
from batchinv.host_syncs import count_host_syncs, sync_debug_mode
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


# ----------------------------------------------------------------------------- host syncs
# torch's sync debug mode flags every synchronizing call ("error" raises, "warn" warns once per
# call): the forward reads the lengths once when they are on the GPU and never when they are CPU
# tensors, and the autograd backward reuses the forward's layout without reading anything.

_VARLEN_LENS = (33, 100, 7)


def _varlen_case(lengths_device, seed=200):
    """``(q, k, v, do, cu)``: packed causal self-attention of ``_VARLEN_LENS``, ``cu`` int32."""
    hq, hkv, d, dtype = 8, 2, 64, torch.bfloat16
    total = sum(_VARLEN_LENS)
    q = _leaf(total, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _leaf(total, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _leaf(total, hkv, d, dtype=dtype, seed=seed + 2)
    do = _leaf(total, hq, d, dtype=dtype, seed=seed + 3).detach()
    cu = torch.tensor([0, 33, 133, 140], dtype=torch.int32, device=lengths_device)
    return q, k, v, do, cu


def _padded_case(lengths_device, seed=210, mask=False):
    """``(q, k, v, do, kwargs)``: a padded causal batch of 3 with ``seqlens_q/k`` (int32) on
    ``lengths_device`` and, with ``mask``, a key_padding_mask with holes."""
    batch, s, hq, hkv, d, dtype = 3, 70, 8, 2, 64, torch.bfloat16
    q = _leaf(batch, s, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _leaf(batch, s, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _leaf(batch, s, hkv, d, dtype=dtype, seed=seed + 2)
    do = _leaf(batch, s, hq, d, dtype=dtype, seed=seed + 3).detach()
    kwargs = {
        "seqlens_q": torch.tensor([70, 41, 5], dtype=torch.int32, device=lengths_device),
        "seqlens_k": torch.tensor([70, 50, 9], dtype=torch.int32, device=lengths_device),
    }
    if mask:
        keep = torch.ones(batch, s, dtype=torch.bool)
        keep[1, 3:9] = False
        keep[0, ::7] = False
        kwargs["key_padding_mask"] = keep.to(DEVICE)
    return q, k, v, do, kwargs


def _varlen_call(cu):
    return lambda *t: batchinv.attention_varlen(*t, cu, cu, causal=True)


def _padded_call(kwargs):
    return lambda *t: batchinv.attention(*t, causal=True, **kwargs)


def _case(layout, lengths_device):
    """``(fn, (q, k, v), do)`` of a varlen, padded or padded-with-mask case."""
    if layout == "varlen":
        q, k, v, do, cu = _varlen_case(lengths_device)
        return _varlen_call(cu), (q, k, v), do
    q, k, v, do, kwargs = _padded_case(lengths_device, mask=layout == "padded+mask")
    return _padded_call(kwargs), (q, k, v), do


@pytest.mark.parametrize("layout", ("varlen", "padded", "padded+mask"))
def test_autograd_backward_makes_no_host_sync(layout):
    fn, inputs, do = _case(layout, DEVICE)
    want = _grads(fn, inputs, do)  # also loads the kernels
    out = fn(*inputs)
    torch.cuda.synchronize()
    with sync_debug_mode("error"):  # raises on any synchronizing call
        got = torch.autograd.grad(out, inputs, do)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_bitwise_equal(g, w, name=name)


@pytest.mark.parametrize("layout", ("varlen", "padded", "padded+mask"))
def test_cpu_lengths_forward_and_backward_make_no_host_sync(layout):
    fn_gpu, inputs, do = _case(layout, DEVICE)
    fn_cpu, _, _ = _case(layout, "cpu")
    want = _grads(fn_gpu, inputs, do)
    want_out = fn_gpu(*inputs).detach()
    _grads(fn_cpu, inputs, do)  # loads the kernels, pins the first host buffer
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        out = fn_cpu(*inputs)
        got = torch.autograd.grad(out, inputs, do)
    assert_bitwise_equal(out.detach(), want_out, name="out, CPU vs GPU lengths")
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_bitwise_equal(g, w, name=f"{name}, CPU vs GPU lengths")


@pytest.mark.parametrize("layout", ("varlen", "padded", "padded+mask"))
def test_gpu_lengths_cost_exactly_one_sync_per_step(layout):
    fn, inputs, do = _case(layout, DEVICE)
    _grads(fn, inputs, do)
    # A process's first counted call can see one more sync (old code too; seen on an H200 in
    # a fresh process): the counts below are of a later call.
    count_host_syncs(lambda: torch.autograd.grad(fn(*inputs), inputs, do))
    out, forward_syncs = count_host_syncs(lambda: fn(*inputs))
    _, backward_syncs = count_host_syncs(lambda: torch.autograd.grad(out, inputs, do))
    assert (forward_syncs, backward_syncs) == (1, 0)
    # The counter sees syncs: without a layout to trust, the backward checks the ranges (1).
    _, public_backward_syncs = count_host_syncs(lambda: _public_backward(*inputs, do))
    assert public_backward_syncs == 1


def _public_backward(q, k, v, do):
    """``batchinv.gpu.attention_backward.backward`` on all rows as one sequence, given by the
    caller's tensors (checked: one sync)."""
    q, k, v, do = (t.detach().reshape(-1, *t.shape[-2:]) for t in (q, k, v, do))
    rows, keys = q.shape[0], k.shape[0]
    zero = torch.zeros(1, dtype=torch.int32)
    layout = gpu_attention.make_layout(zero, zero + rows, zero, zero + keys, rows, keys, DEVICE)
    out, lse = gpu_attention.forward(q, k, v, layout, True, 0.125)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    return gpu_attention_backward.backward(
        *(q, k, v, out, lse, do, start, start + rows, start.clone(), start + keys),
        *(rows, keys),
        causal=True,
        scale=0.125,
    )


@pytest.mark.parametrize("lengths_device", (DEVICE, "cpu"))
def test_editing_cu_seqlens_after_forward_leaves_the_backward_unchanged(lengths_device):
    q, k, v, do, cu = _varlen_case(lengths_device)
    want = _grads(_varlen_call(cu.clone()), (q, k, v), do)
    edited = torch.tensor([0, 60, 133, 140], dtype=torch.int32, device=lengths_device)
    other = _grads(_varlen_call(edited), (q, k, v), do)
    assert not torch.equal(other[0], want[0]), "the edit must change the gradients"
    out = _varlen_call(cu)(q, k, v)
    cu.copy_(edited)  # in place, after the forward: the layout holds its own copy
    got = torch.autograd.grad(out, (q, k, v), do)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_bitwise_equal(g, w, name=f"{name} after editing cu_seqlens")


def test_editing_seqlens_after_forward_leaves_the_backward_unchanged():
    q, k, v, do, kwargs = _padded_case(DEVICE)
    want = _grads(_padded_call({n: t.clone() for n, t in kwargs.items()}), (q, k, v), do)
    edited = {n: t.clone() for n, t in kwargs.items()}
    edited["seqlens_q"][1] = 20  # valid: drops query rows 20..40 of sequence 1
    edited["seqlens_k"][2] = 70  # valid: sequence 2 sees all its keys
    other = _grads(_padded_call(edited), (q, k, v), do)
    assert not torch.equal(other[0], want[0]), "the edit must change the gradients"
    out = _padded_call(kwargs)(q, k, v)
    for name, t in kwargs.items():
        t.copy_(edited[name])  # in place, after the forward
    got = torch.autograd.grad(out, (q, k, v), do)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_bitwise_equal(g, w, name=f"{name} after editing seqlens")
