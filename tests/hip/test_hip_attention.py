"""CPU checks of attention's HIP entries (no AMD GPU exists for this project: docs/amd.md).

The registry is made to answer "hip" for CPU tensors, so ``batchinv.attention``,
``attention_varlen`` and ``attention_with_kv_cache`` run their HIP host code for real (the
CUDA entry points' validation, layouts and KV-cache append, with the portable ``run``), and
each launch of ``attn_portable_*`` and ``attn_bwd_portable_*`` is handed to a CPU emulation of
the kernel's definition (plain fp32 softmax per row, and the backward's delta, dK/dV and dQ
formulas, on the canonical layout).  That checks the launch geometry, the strides, the
argument order and the layout the kernels would read against the strict reference and its
autograd, not the kernels' bits (tests/gpu/test_portable_cuda.py runs the kernels).
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_within_tolerance
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import attention_backward_portable as portable_backward
from batchinv.gpu import attention_portable as portable
from batchinv.kv_cache import KVCache
from batchinv.reference import attention as reference

DTYPE = torch.bfloat16
D = 64
LOG2E = 1.4426950408889634
STAGES = ("delta", "dkdv", "dq")  # the backward's launches, in order


@pytest.fixture
def emulated(monkeypatch):
    """HIP dispatch for CPU tensors; every ``attn_portable_*`` launch is emulated on the CPU."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(registry, "backend_of", lambda device: "hip")
    layouts = {}
    real_make_layout = gpu_attention.make_layout

    def make_layout(*args, **kwargs):
        layout = real_make_layout(*args, **kwargs)
        layouts[layout.pointers] = layout
        return layout

    def cuda_only(*args, **kwargs):
        raise AssertionError("attention asked for a CUDA-only path on HIP")

    monkeypatch.setattr(gpu_attention, "make_layout", make_layout)
    for name in ("forward", "uses_hopper", "multiprocessors", "tensor_map_2d", "_capability"):
        monkeypatch.setattr(gpu_attention, name, cuda_only)
    launches = []

    def launch(kernel, device, grid, block, args, **options):
        launches.append((kernel, grid, block))
        q, k, v, out, lse, *pointers = args[:9]
        strides = args[9:17]
        tq, hq, hkv, d, causal, scale_log2 = args[17:]
        layout = layouts[tuple(pointers)]
        assert block == (128,) and grid == (layout.max_q_len, hq, layout.batch)
        assert (out.stride(0), out.stride(1)) == strides[6:8]
        _emulate(q, k, v, out, lse, layout, strides, hq // hkv, bool(causal), scale_log2)

    def backward_launch(kernel, device, grid, block, args, **options):
        launches.append((kernel, grid, block))
        q, k, v, out, dout, lse, delta, *rest = args
        pointers, (dq, dk, dv), sizes = rest[:4], rest[4:7], rest[7:]
        tq, hq, hkv, d, causal, scale = sizes
        layout = layouts[tuple(pointers)]
        assert block == (128,) and tq == q.shape[0] and (hq, d) == q.shape[1:]
        assert hkv == k.shape[1] and all(t.is_contiguous() for t in (q, k, v, out, dout, lse))
        stage = kernel[1].split("_")[3]
        geometry = {
            "delta": (-(-layout.max_q_len // 128), hq, layout.batch),
            "dkdv": (layout.max_k_len, hkv, layout.batch),
            "dq": (layout.max_q_len, hq, layout.batch),
        }
        assert grid == geometry[stage], (stage, grid)
        _emulate_backward(
            stage, q, k, v, out, dout, lse, delta, layout, (dq, dk, dv), causal, scale
        )

    for module in (portable, portable_backward):
        monkeypatch.setattr(module, "kernel_for", lambda module, kernel, device: (module, kernel))
    monkeypatch.setattr(portable, "launch", launch)
    monkeypatch.setattr(portable_backward, "launch", backward_launch)
    return launches


def _rows(t: torch.Tensor, row_stride: int, head_stride: int) -> torch.Tensor:
    """The kernel's view of ``t``: ``[rows, heads, d]`` at the strides it was given."""
    return torch.as_strided(t, t.shape, (row_stride, head_stride, 1), t.storage_offset())


def _emulate(q, k, v, out, lse, layout, strides, group, causal, scale_log2):
    q = _rows(q, *strides[0:2]).float()
    k = _rows(k, *strides[2:4]).float()
    v = _rows(v, *strides[4:6]).float()
    scale = scale_log2 / LOG2E
    for b in range(layout.batch):
        q_start, q_len = int(layout.q_start[b]), int(layout.q_len[b])
        k_start, k_len = int(layout.k_start[b]), int(layout.k_len[b])
        for i in range(q_len):
            visible = max(0, min(k_len, k_len - q_len + i + 1)) if causal else k_len
            row = q_start + i
            for h in range(q.shape[1]):
                keys = slice(k_start, k_start + visible)
                s = (k[keys, h // group] @ q[row, h]) * scale
                if visible == 0:
                    out[row, h] = 0
                    lse[h, row] = float("-inf")
                    continue
                p = torch.softmax(s, 0)
                out[row, h] = (p @ v[keys, h // group]).to(out.dtype)
                lse[h, row] = torch.logsumexp(s, 0)


def _emulate_backward(stage, q, k, v, out, dout, lse, delta, layout, grads, causal, scale):
    """One stage of the portable backward by its definition, per sequence and head in fp32."""
    dq, dk, dv = grads
    group = q.shape[1] // k.shape[1]
    for b in range(layout.batch):
        q_start, q_len = int(layout.q_start[b]), int(layout.q_len[b])
        k_start, k_len = int(layout.k_start[b]), int(layout.k_len[b])
        rows, keys = slice(q_start, q_start + q_len), slice(k_start, k_start + k_len)
        if stage == "delta":
            delta[:, rows] = (dout[rows].float() * out[rows].float()).sum(-1).t()
            continue
        positions = torch.arange(q_len)[:, None] + (k_len - q_len)
        visible = torch.arange(k_len)[None, :] <= positions if causal else torch.ones(q_len, k_len)
        grad_k = torch.zeros(k_len, k.shape[1], k.shape[2])
        grad_v = torch.zeros_like(grad_k)
        for h in range(q.shape[1]):
            kv = h // group
            qh, gh = q[rows, h].float(), dout[rows, h].float()
            kh, vh = k[keys, kv].float(), v[keys, kv].float()
            row_lse = lse[h, rows][:, None]
            p = torch.where(visible.bool(), torch.exp(qh @ kh.t() * scale - row_lse), 0.0)
            ds = p * (gh @ vh.t() - delta[h, rows][:, None])
            if stage == "dq":
                dq[rows, h] = (ds @ kh * scale).to(dq.dtype)
            else:
                grad_v[:, kv] += p.t() @ gh
                grad_k[:, kv] += ds.t() @ qh * scale
        if stage == "dkdv":
            dk[keys], dv[keys] = grad_k.to(dk.dtype), grad_v.to(dv.dtype)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def test_attention_entries_are_the_portable_ones():
    device = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.version, "hip", "6.2")
        assert registry.lookup("attention", device) is portable.attention
        assert registry.lookup("attention_varlen", device) is portable.attention_varlen
        assert (
            registry.lookup("attention_with_kv_cache", device) is portable.attention_with_kv_cache
        )


@pytest.mark.parametrize("causal", (False, True))
def test_padded_attention_matches_the_reference(emulated, causal):
    q = _randn(3, 5, 4, D, seed=1)
    k = _randn(3, 7, 2, D, seed=2)
    v = _randn(3, 7, 2, D, seed=3)
    seqlens_q = torch.tensor([5, 2, 0])
    seqlens_k = torch.tensor([7, 4, 3])
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 2] = False
    options = {
        "causal": causal,
        "seqlens_q": seqlens_q,
        "seqlens_k": seqlens_k,
        "key_padding_mask": mask,
        "return_lse": True,
    }
    out, lse = batchinv.attention(q, k, v, **options)
    ref_out, ref_lse = reference.attention_fp32(q, k, v, **options)
    assert [kernel for kernel, *_ in emulated] == [("attention_portable", "attn_portable_bf16")]
    assert_within_tolerance(out, ref_out, op="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op="attention", name="lse")


def test_varlen_attention_matches_the_reference(emulated):
    cu_q = torch.tensor([0, 3, 4, 9])
    cu_k = torch.tensor([0, 6, 7, 12])
    q = _randn(9, 4, D, seed=4)
    k = _randn(12, 1, D, seed=5)
    v = _randn(12, 1, D, seed=6)
    out, lse = batchinv.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    ref_out, ref_lse = reference.attention_varlen_fp32(
        q, k, v, cu_q, cu_k, causal=True, return_lse=True
    )
    assert_within_tolerance(out, ref_out, op="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op="attention", name="lse")


def test_kv_cache_attention_matches_attention_on_the_cached_keys(emulated):
    cache = KVCache(2, 16, 2, D, dtype=DTYPE)
    prompt_k, prompt_v = _randn(2, 5, 2, D, seed=7), _randn(2, 5, 2, D, seed=8)
    q = _randn(2, 1, 4, D, seed=9)
    k_new, v_new = _randn(2, 1, 2, D, seed=10), _randn(2, 1, 2, D, seed=11)
    cache.append(prompt_k, prompt_v)
    out = batchinv.attention_with_kv_cache(q, k_new, v_new, cache)
    keys = torch.cat([prompt_k, k_new], 1)
    values = torch.cat([prompt_v, v_new], 1)
    ref = reference.attention_fp32(q, keys, values, causal=True)
    assert_within_tolerance(out, ref, op="attention", name="decode")
    assert cache.lengths.tolist() == [6, 6]


def _grads(fn, leaves, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def _backward_stages(launches):
    return [kernel for (module, kernel), *_ in launches if module == "attention_backward_portable"]


@pytest.mark.parametrize("causal", (False, True))
def test_padded_attention_gradients_match_the_reference(emulated, causal):
    q = _randn(3, 5, 4, D, seed=16)
    k = _randn(3, 7, 2, D, seed=17)
    v = _randn(3, 7, 2, D, seed=18)
    grad_out = _randn(3, 5, 4, D, seed=19)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 2] = False
    options = {
        "causal": causal,
        "seqlens_q": torch.tensor([5, 2, 0]),
        "seqlens_k": torch.tensor([7, 4, 3]),
        "key_padding_mask": mask,
    }
    got = _grads(lambda *t: batchinv.attention(*t, **options), (q, k, v), grad_out)
    expected = _grads(
        lambda *t: reference.attention_fp32(*t, **options),
        [t.float() for t in (q, k, v)],
        grad_out.float(),
    )
    assert _backward_stages(emulated) == [f"attn_bwd_portable_{s}_bf16" for s in STAGES]
    for name, g, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == DTYPE and float(want.abs().max()) > 0, name
        assert_within_tolerance(g, want, op="attention", kind="grad", name=name)


def test_varlen_attention_gradients_match_the_reference(emulated):
    cu_q = torch.tensor([0, 3, 4, 9])
    cu_k = torch.tensor([0, 6, 7, 12])
    q = _randn(9, 4, D, seed=20)
    k = _randn(12, 1, D, seed=21)
    v = _randn(12, 1, D, seed=22)
    grad_out = _randn(9, 4, D, seed=23)
    got = _grads(
        lambda *t: batchinv.attention_varlen(*t, cu_q, cu_k, causal=True), (q, k, v), grad_out
    )
    expected = _grads(
        lambda *t: reference.attention_varlen_fp32(*t, cu_q, cu_k, causal=True),
        [t.float() for t in (q, k, v)],
        grad_out.float(),
    )
    assert _backward_stages(emulated) == [f"attn_bwd_portable_{s}_bf16" for s in STAGES]
    for name, g, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert_within_tolerance(g, want, op="attention", kind="grad", name=name)


def test_saved_backward_entries_give_the_eager_gradients(emulated):
    """The custom ops' backward on HIP (the registry's ``<op>.saved_backward``) from the saved
    ``(out, lse)``, against eager autograd (the same emulated stages, so equal)."""
    device = torch.device("cpu")
    assert registry.lookup("attention.saved_backward", device) is portable.attention_saved_backward
    varlen_entry = registry.lookup("attention_varlen.saved_backward", device)
    assert varlen_entry is portable.attention_varlen_saved_backward
    q, k, v = _randn(2, 5, 4, D, seed=24), _randn(2, 6, 2, D, seed=25), _randn(2, 6, 2, D, seed=26)
    grad_out = _randn(2, 5, 4, D, seed=27)
    options = {
        "causal": True,
        "softmax_scale": None,
        "seqlens_q": torch.tensor([5, 3]),
        "seqlens_k": torch.tensor([6, 6]),
        "key_padding_mask": None,
    }
    eager = _grads(lambda *t: batchinv.attention(*t, **options), (q, k, v), grad_out)
    with torch.no_grad():
        out, lse = batchinv.attention(q, k, v, **options, return_lse=True)
    saved = portable.attention_saved_backward(grad_out, q, k, v, out, lse, **options)
    for name, a, b in zip(("dq", "dk", "dv"), saved, eager, strict=True):
        assert torch.equal(a, b), name

    cu_q, cu_k = torch.tensor([0, 3, 8]), torch.tensor([0, 4, 9])
    q, k, v = q.reshape(10, 4, D)[:8], k.reshape(12, 2, D)[:9], v.reshape(12, 2, D)[:9]
    grad_out = grad_out.reshape(10, 4, D)[:8]
    options = {"causal": False, "softmax_scale": 0.1}
    eager = _grads(
        lambda *t: batchinv.attention_varlen(*t, cu_q, cu_k, **options), (q, k, v), grad_out
    )
    with torch.no_grad():
        out, lse = batchinv.attention_varlen(q, k, v, cu_q, cu_k, **options, return_lse=True)
    saved = portable.attention_varlen_saved_backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options
    )
    for name, a, b in zip(("dq", "dk", "dv"), saved, eager, strict=True):
        assert torch.equal(a, b), name


def test_kv_cache_attention_refuses_gradients(emulated):
    cache = KVCache(1, 8, 2, D, dtype=DTYPE)
    q = _randn(1, 1, 4, D, seed=28).requires_grad_(True)
    k_new, v_new = _randn(1, 1, 2, D, seed=29), _randn(1, 1, 2, D, seed=30)
    with pytest.raises(RuntimeError, match="inference-only"):
        batchinv.attention_with_kv_cache(q, k_new, v_new, cache)
    assert emulated == [] and cache.lengths.tolist() == [0]


def test_bad_input_errors_as_on_cuda(emulated):
    q, k = _randn(1, 3, 2, 48, seed=14), _randn(1, 3, 2, 48, seed=15)
    with pytest.raises(ValueError, match="head dim d=48"):
        batchinv.attention(q, k, k, seqlens_q=torch.tensor([3]))
    q, k = q.float()[..., :32], k.float()[..., :32]
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        batchinv.attention(q, k, k, seqlens_q=torch.tensor([3]))
