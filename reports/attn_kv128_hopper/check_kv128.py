"""attn-kv128-hopper device call: the 128-key Hopper prefill kernel before the mma.sync kernels
have 128-key blocks too (so no bitwise comparison with them yet).

(a) Axis-B: out and lse within the contract's "attention" tolerance of ``attention_fp32`` (the
    reference run on clean inputs, the kernel on copies with NaN in every padded query and key
    row), bf16 / fp16, causal and not, GQA 4:1 and a group of 3, key lengths 1, 127, 128, 129,
    1023, 1024, 1025, 2500 in one batch.
(b) Axis-A, every run through the Hopper kernel: each sequence alone vs in that NaN-padded batch;
    the persistent grid forced to 1, 3 and 7 CTAs vs the default grid; varlen packing vs the
    padded batch; chunked prefill through the KV-cache storage (chunks of 100 and 128 forced
    onto the Hopper kernel) vs one prefill.
Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

import torch

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import attention as gpu
from batchinv.gpu import attention_hopper as hopper
from batchinv.reference.attention import attention_fp32
from batchinv.reference.kv_cache import KVCache

DEVICE = "cuda"
HOPPER = dict(mode="tile", warps=4, hopper=True)
LENS_K = [1, 127, 128, 129, 1023, 1024, 1025, 2500]
LENS_Q = [1, 127, 128, 129, 200, 64, 1025, 300]


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def qkv(batch, sq, sk, hq, hkv, dtype, seed):
    q = randn(batch, sq, hq, 128, dtype=dtype, seed=seed, scale=1.5)
    k = randn(batch, sk, hkv, 128, dtype=dtype, seed=seed + 1, scale=1.5)
    v = randn(batch, sk, hkv, 128, dtype=dtype, seed=seed + 2)
    return q, k, v


def nan_padding(q, k, v, lens_q, lens_k):
    q, k, v = q.clone(), k.clone(), v.clone()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        q[b, lq:] = float("nan")
        k[b, lk:] = float("nan")
        v[b, lk:] = float("nan")
    return q, k, v


def check_reference_and_batch(dtype, heads, causal):
    hq, hkv = heads
    name = f"{str(dtype)[6:]} Hq/Hkv {hq}/{hkv} {'causal' if causal else 'non-causal'}"
    sq, sk = max(LENS_Q), max(LENS_K)
    q, k, v = qkv(len(LENS_K), sq, sk, hq, hkv, dtype, seed=hq * 7 + hkv + int(causal))
    sl_q = torch.tensor(LENS_Q, device=DEVICE)
    sl_k = torch.tensor(LENS_K, device=DEVICE)
    kwargs = dict(causal=causal, seqlens_q=sl_q, seqlens_k=sl_k, return_lse=True)
    nq, nk, nv = nan_padding(q, k, v, LENS_Q, LENS_K)
    out, lse = gpu.attention(nq, nk, nv, **HOPPER, **kwargs)
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    for b, lq in enumerate(LENS_Q):
        assert not torch.isnan(out[b, :lq]).any(), f"{name}: NaN in sequence {b}"
    assert_within_tolerance(out, ref_out, op_class="attention", name=f"{name} out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name=f"{name} lse", dtype=dtype)
    print(f"PASS tolerance vs attention_fp32: {name}")
    # each sequence alone vs in the NaN-padded batch (T1-T3)
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K, strict=True)):
        alone = gpu.attention(
            q[b : b + 1, :lq].contiguous(),
            k[b : b + 1, :lk].contiguous(),
            v[b : b + 1, :lk].contiguous(),
            causal=causal,
            return_lse=True,
            **HOPPER,
        )
        assert_bitwise_equal(out[b : b + 1, :lq], alone[0], name=f"{name} out, seq {b} alone")
        assert_bitwise_equal(lse[b : b + 1, :, :lq], alone[1], name=f"{name} lse, seq {b} alone")
    print(f"PASS bitwise alone vs batch: {name}")
    # the persistent grid at 1, 3 and 7 CTAs
    for ctas in (1, 3, 7):
        with hopper.forced_ctas(ctas):
            forced = gpu.attention(nq, nk, nv, **HOPPER, **kwargs)
        assert_bitwise_equal(forced, (out, lse), name=f"{name}, {ctas} CTAs")
    print(f"PASS bitwise forced CTAs 1/3/7: {name}")
    # varlen packing (each sequence's last block brings its neighbour's keys) vs padded
    cu_q = torch.tensor([0, *torch.tensor(LENS_Q).cumsum(0).tolist()], device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(LENS_K).cumsum(0).tolist()], device=DEVICE)
    pq = torch.cat([q[b, :n] for b, n in enumerate(LENS_Q)])
    pk = torch.cat([k[b, :n] for b, n in enumerate(LENS_K)])
    pv = torch.cat([v[b, :n] for b, n in enumerate(LENS_K)])
    vout, vlse = gpu.attention_varlen(
        pq, pk, pv, cu_q, cu_k, causal=causal, return_lse=True, **HOPPER
    )
    for b, lq in enumerate(LENS_Q):
        s, e = cu_q[b].item(), cu_q[b + 1].item()
        assert_bitwise_equal(vout[s:e], out[b, :lq], name=f"{name} varlen out, seq {b}")
        assert_bitwise_equal(vlse[:, s:e], lse[b, :, :lq], name=f"{name} varlen lse, seq {b}")
    print(f"PASS bitwise varlen vs padded: {name}")


def check_chunked(dtype):
    total = 1300
    q, k, v = qkv(1, total, total, 8, 2, dtype, seed=71)
    full = gpu.attention(q, k, v, causal=True, return_lse=True, **HOPPER)
    for chunk in (100, 128):
        cache = KVCache(1, total, 2, 128, dtype=dtype, device=DEVICE)
        for s in range(0, total, chunk):
            e = min(total, s + chunk)
            out, lse = gpu.attention_with_kv_cache(
                q[:, s:e], k[:, s:e], v[:, s:e], cache, return_lse=True, **HOPPER
            )
            assert_bitwise_equal(out, full[0][:, s:e], name=f"chunk {chunk} out [{s}, {e})")
            assert_bitwise_equal(lse, full[1][:, :, s:e], name=f"chunk {chunk} lse [{s}, {e})")
    print(f"PASS bitwise chunked prefill (100, 128) vs one prefill: {str(dtype)[6:]}")


def smoke() -> None:
    """One small call first (a hang or a wrong layout shows within seconds)."""
    q, k, v = qkv(2, 300, 300, 8, 2, torch.bfloat16, seed=5)
    sl_q = torch.tensor([300, 129], device=DEVICE)
    kwargs = dict(causal=True, seqlens_q=sl_q, seqlens_k=sl_q, return_lse=True)
    out, lse = gpu.attention(q, k, v, **HOPPER, **kwargs)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="smoke out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="smoke lse", dtype=q.dtype)
    with hopper.forced_ctas(1):
        one = gpu.attention(q, k, v, **HOPPER, **kwargs)
    assert_bitwise_equal(one, (out, lse), name="smoke, 1 CTA")
    print("PASS smoke")


def main() -> int:
    print(torch.cuda.get_device_name(), "| shared bytes", hopper.shared_bytes())
    smoke()
    if "--smoke" in sys.argv:
        return 0
    for dtype in (torch.bfloat16, torch.float16):
        for heads in ((8, 2), (6, 2)):
            for causal in (True, False):
                check_reference_and_batch(dtype, heads, causal)
        check_chunked(dtype)
    print("ALL PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
