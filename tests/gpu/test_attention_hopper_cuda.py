"""The Hopper (sm_90a) tile kernel ``kernels_cu/attention_hopper.cu`` (128-key blocks, head dims
64 and 128): bitwise equal (out AND lse) to the mma.sync tile and split kernels and to the
chunked-prefill / decode paths, on odd lengths, block and split edges, GQA 4:1 and 8:1, MHA,
groups of 3 and 5 (tiles with padding rows), causal offsets, fully masked rows, NaN padding
past ``k_len``; within the contract's tolerance of the fp32 reference.

GPU tests skip (with the reason) where CUDA, an sm_90 device or the sm_90a image is absent.
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import attention as gpu
from batchinv.gpu import attention_hopper as hopper
from batchinv.kv_cache import KVCache
from batchinv.reference.attention import attention_fp32

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
# (Hq, Hkv): GQA 4:1, GQA 8:1, MHA, a group of 3 (128-row tiles: 42 queries x 3 heads, 2
# padding rows) and a group of 5 (25 queries x 5 heads, 3 padding rows)
HEADS = ((8, 2), (16, 2), (4, 4), (6, 2), (10, 2))
SPLIT, BLOCK = gpu.SPLIT_KEYS, gpu.BLOCK_KEYS  # the contract's split (2048 keys) and block
LONG_CONTEXT = 2 * SPLIT + 452  # three splits
D = (64, 128)  # head dims the kernel serves (one kernel body, D / 64 column halves)
with_d = pytest.mark.parametrize("d", D)


def _hopper_missing() -> str | None:
    """Why the Hopper kernel cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    from batchinv.runtime import native

    if "90a" not in native().build_info()["cuda_archs"]:
        return "the native module was built without an sm_90a image"
    return None


_MISSING = _hopper_missing()
cuda = pytest.mark.cuda
needs_hopper = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _qkv(batch, sq, sk, hq, hkv, dtype, seed, d=128):
    q = _randn(batch, sq, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 2)
    return q, k, v


def _nan_padding(q, k, v, seqlens_q, seqlens_k):
    """Copies with NaN in every padded query and key/value row (never to be read)."""
    q, k, v = q.clone(), k.clone(), v.clone()
    for b, (lq, lk) in enumerate(zip(seqlens_q.tolist(), seqlens_k.tolist(), strict=True)):
        q[b, lq:] = float("nan")
        k[b, lk:] = float("nan")
        v[b, lk:] = float("nan")
    return q, k, v


# ----------------------------------------------------------------------------- host logic (CPU)


def test_shared_memory_fits_hopper():
    # d = 128: Q 32 KB + two 32 KB stages of K and of V + the 64 KB running state; d = 64: Q
    # 16 KB + two 16 KB stages + the 32 KB running state.  Both fit the 227 KB an sm_90 CTA may
    # take, and only the alignment slack and the mbarriers come on top of the tiles.
    kb = 1024
    assert hopper.shared_bytes(128) == hopper.shared_bytes()
    assert hopper.STAGES == 2
    for d in (128, 64):
        tiles = 2 * 64 * d * 2 + 2 * hopper.STAGES * 128 * d * 2 + d // 2 * 256 * 4
        assert tiles <= hopper.shared_bytes(d) <= tiles + 2 * kb
        assert hopper.shared_bytes(d) <= 227 * kb
    assert hopper.shared_bytes(128) >= (32 + 4 * 32 + 64) * kb
    assert hopper.shared_bytes(64) >= (16 + 4 * 16 + 32) * kb


def test_shared_bytes_rejects_other_head_dims():
    with pytest.raises(ValueError, match="head_dim"):
        hopper.shared_bytes(96)


def test_kernel_names():
    assert hopper.kernel_name(torch.bfloat16, 128) == "attn_hopper_fwd_bf16_d128"
    assert hopper.kernel_name(torch.float16, 128) == "attn_hopper_fwd_f16_d128"
    assert hopper.kernel_name(torch.bfloat16, 64) == "attn_hopper_fwd_bf16_d64"
    assert hopper.kernel_name(torch.float16, 64) == "attn_hopper_fwd_f16_d64"


def test_applies_needs_a_served_head_dim():
    # A head dim the kernel is not built for is refused before the device is looked at.
    t = torch.zeros(8, 2, 96, dtype=torch.bfloat16)
    assert not hopper.applies(t, t, t)
    assert hopper.HEAD_DIMS == set(gpu.HEAD_DIMS) == {64, 128}


def test_block_is_the_contracts_block():
    # The kernel's TMA boxes and shared-memory stages hold one block of the contract's size.
    assert hopper.BLOCK_KEYS == gpu.BLOCK_KEYS == 128


@with_d
def test_tma_rows_needs_contiguous_heads(d):
    assert hopper._tma_rows(torch.zeros(8, 2, d, dtype=torch.bfloat16))
    wide = torch.zeros(8, 2, 2 * d, dtype=torch.bfloat16)[..., :d]  # head stride 2d
    assert not hopper._tma_rows(wide)
    assert not hopper._tma_rows(torch.zeros(0, 2, d, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- bitwise vs mma.sync


def _hopper_equal_to_mma_sync(q, k, v, what, **kwargs):
    """The Hopper tile kernel's ``(out, lse)``, asserted bitwise equal to the mma.sync tile
    kernel's on the same call."""
    new = gpu.attention(q, k, v, mode="tile", warps=4, hopper=True, **kwargs)
    old = gpu.attention(q, k, v, mode="tile", warps=4, hopper=False, **kwargs)
    assert_bitwise_equal(new, old, name=f"hopper vs mma.sync {what}")
    return new


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_hopper_equals_mma_sync_tile_and_split(dtype, heads, causal, d):
    hq, hkv = heads
    # Split merges (LONG_CONTEXT keys), a partial last block (1100, 70), causal offsets (queries at
    # the end of longer contexts), queries before the first key (130 queries, 70 keys: the
    # first 60 rows are fully masked when causal), a sequence with no key, NaN padding.
    seqlens_q = torch.tensor([37, 5, 130, 20], device=DEVICE)
    seqlens_k = torch.tensor([LONG_CONTEXT, 1100, 70, 0], device=DEVICE)
    q, k, v = _qkv(4, 130, LONG_CONTEXT, hq, hkv, dtype, seed=hq * 7 + hkv, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    new = _hopper_equal_to_mma_sync(q, k, v, "tile", **kwargs)
    split = gpu.attention(q, k, v, mode="split", warps=4, **kwargs)
    assert_bitwise_equal(new, split, name="hopper vs mma.sync split")
    assert not torch.isnan(new[0]).any(), "NaN padding leaked into the output"


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_split_edges_equal_mma_sync(dtype, causal, d):
    # The kernel runs a block that starts a split as its own copy of the pipeline step: contexts
    # ending exactly on a split (SPLIT, 2 * SPLIT), one 128-key block past it (SPLIT + BLOCK: the
    # block that starts the second split is the last), one key past it and one key short.
    edges = [SPLIT, SPLIT + BLOCK, 2 * SPLIT, SPLIT + 1, SPLIT - 1]
    seqlens_k = torch.tensor(edges, device=DEVICE)
    seqlens_q = torch.tensor([200, 70, 129, 1, 64], device=DEVICE)
    q, k, v = _qkv(5, 200, 2 * SPLIT, 8, 2, dtype, seed=31, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    _hopper_equal_to_mma_sync(q, k, v, "tile at split edges", **kwargs)


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_block_edges_equal_mma_sync(dtype, causal, d):
    # Contexts around the 128-key block edges (1, 127, 128, 129 keys; 2 and 3 blocks, one key
    # past 3), one key short of a block past a split and two blocks past it, causal tiles of 32
    # query positions that end inside a block and on its edges, a sequence with no query.
    past = [SPLIT + BLOCK - 1, SPLIT + 2 * BLOCK]
    seqlens_k = torch.tensor([1, 127, 128, 129, 256, 384, 385, *past, 300], device=DEVICE)
    seqlens_q = torch.tensor([1, 127, 20, 129, 200, 100, 193, 200, 150, 0], device=DEVICE)
    q, k, v = _qkv(10, 200, past[1], 8, 2, dtype, seed=53, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    new = _hopper_equal_to_mma_sync(q, k, v, "tile at block edges", **kwargs)
    assert not torch.isnan(new[0]).any(), "NaN padding leaked into the output"


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_split_loop_edges_equal_mma_sync(dtype, causal, d):
    # The kernel runs one inner loop per split and the last block as a step of its own: block
    # counts one short of, on and one past the split edges (15, 16, 31, 32, 33, 48 blocks of
    # 128 keys and one key more), a split that holds only the last block (SPLIT + 1 keys: block
    # 16 starts the second split and is the last), and 1 block.
    s = SPLIT
    lens = [s - BLOCK, s, s + 1, 2 * s - BLOCK, 2 * s, 2 * s + BLOCK, 3 * s, 3 * s + 1, BLOCK]
    seqlens_k = torch.tensor(lens, device=DEVICE)
    seqlens_q = torch.tensor([40, 33, 1, 64, 100, 3, 90, 31, 64], device=DEVICE)
    q, k, v = _qkv(9, 100, 3 * s + 1, 8, 2, dtype, seed=67, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    new = _hopper_equal_to_mma_sync(q, k, v, "tile at the split-loop edges", **kwargs)
    assert not torch.isnan(new[0]).any(), "NaN padding leaked into the output"


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@with_d
def test_causal_ends_around_a_split_edge_equal_mma_sync(dtype, d):
    # Causal tiles (32 query positions at GQA 4:1) whose last block lies on both sides of the
    # first split edge (SPLIT + 16 and SPLIT + 76 keys, 96 queries: tiles ending in the blocks
    # just before and just after the edge), a tile whose rows see no key (50 queries over 20
    # keys), a tile past q_len.
    seqlens_k = torch.tensor([SPLIT + 16, SPLIT + 76, 20, 1], device=DEVICE)
    seqlens_q = torch.tensor([96, 96, 50, 1], device=DEVICE)
    q, k, v = _qkv(4, 96, SPLIT + 76, 8, 2, dtype, seed=71, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=True, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    new = _hopper_equal_to_mma_sync(q, k, v, "tile, causal ends around a split", **kwargs)
    assert not torch.isnan(new[0]).any(), "NaN padding leaked into the output"


@cuda
@needs_hopper
@pytest.mark.parametrize("ctas", (1, 3, 7))
@with_d
def test_persistent_grid_any_cta_count_equals_mma_sync(ctas, d):
    # The persistent grid: with few CTAs each takes many work items from the queue, its K/V ring
    # and barrier phases running on across items of every kind (split merges, partial last
    # blocks, boundary blocks zeroed by the producer, tiles past q_len, a sequence with no key,
    # causal rows before the first key), and the next item's Q copied during the current one.
    seqlens_q = torch.tensor([37, 0, 130, 20, 64, 1], device=DEVICE)
    seqlens_k = torch.tensor([LONG_CONTEXT, 70, 70, 0, 1088, 129], device=DEVICE)
    for dtype in DTYPES:
        q, k, v = _qkv(6, 130, LONG_CONTEXT, 6, 2, dtype, seed=101, d=d)
        q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
        for causal in (True, False):
            kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
            with hopper.forced_ctas(ctas):
                new = _hopper_equal_to_mma_sync(q, k, v, f"{ctas} CTAs, {dtype}", **kwargs)
            assert not torch.isnan(new[0]).any(), "NaN padding leaked into the output"


@cuda
@needs_hopper
@with_d
def test_persistent_queue_in_a_cuda_graph_equals_eager(d):
    # The queue's counter is zeroed by a memset captured with the kernel, so every replay starts
    # at item 0; a counter left at its end would skip every item (the +0/-inf fill would stay).
    batch, s, hq, hkv = 3, 700, 8, 2
    q, k, v = (
        t.reshape(batch * s, t.shape[2], d)
        for t in _qkv(batch, s, s, hq, hkv, torch.bfloat16, seed=211, d=d)
    )
    starts, lens = torch.arange(batch) * s, torch.full((batch,), s)
    layout = gpu.make_layout(starts, lens, starts, lens, s, s, device=DEVICE)
    scale = gpu.scale_of(None, d)
    run = dict(mode="tile", warps=4, hopper=True)
    with hopper.forced_ctas(5):  # many items per CTA: the queue decides who computes what
        graph, captured = capture_graph(lambda: gpu.forward(q, k, v, layout, True, scale, **run))
    for step in range(3):
        gen = torch.Generator(device=DEVICE).manual_seed(212 + step)
        q.copy_(torch.randn(q.shape, device=DEVICE, generator=gen))  # new queries, same buffer
        graph.replay()
        torch.cuda.synchronize()
        want = gpu.forward(q, k, v, layout, True, scale, mode="tile", warps=4, hopper=False)
        assert_bitwise_equal(captured, want, name=f"replay {step}")


def test_forced_ctas_rejects_bad_counts():
    with pytest.raises(ValueError, match="count"):
        with hopper.forced_ctas(0):
            pass
    with pytest.raises(TypeError, match="count"):
        with hopper.forced_ctas(2.0):
            pass


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@with_d
def test_wide_score_range_equals_mma_sync(dtype, d):
    # softmax_scale = 1: many P below 2^-126, flushed to +0 by exp2_ftz in both kernels.
    q, k, v = _qkv(2, 300, 1500, 8, 2, dtype, seed=41, d=d)
    kwargs = dict(causal=True, softmax_scale=1.0, return_lse=True)
    _hopper_equal_to_mma_sync(q, k, v, "softmax_scale=1", **kwargs)


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@with_d
def test_varlen_packing_equals_padded(dtype, d):
    # Packed rows: the last block of a sequence brings the next sequence's keys into shared
    # memory; they must not count.
    lens = [300, 65, 1, 1030]
    q, k, v = _qkv(len(lens), max(lens), max(lens), 8, 2, dtype, seed=51, d=d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    pq = torch.cat([q[b, :n] for b, n in enumerate(lens)])
    pk = torch.cat([k[b, :n] for b, n in enumerate(lens)])
    pv = torch.cat([v[b, :n] for b, n in enumerate(lens)])
    out, lse = batchinv.attention_varlen(pq, pk, pv, cu, cu, causal=True, return_lse=True)
    for b, n in enumerate(lens):
        one = gpu.attention(
            q[b : b + 1, :n],
            k[b : b + 1, :n],
            v[b : b + 1, :n],
            causal=True,
            return_lse=True,
            mode="tile",
            warps=4,
            hopper=False,
        )
        s, e = cu[b].item(), cu[b + 1].item()
        assert_bitwise_equal(out[s:e], one[0][0], name=f"varlen out, sequence {b}")
        assert_bitwise_equal(lse[:, s:e], one[1][0], name=f"varlen lse, sequence {b}")


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@with_d
def test_row_bits_independent_of_batch_and_padding(dtype, d):
    seqlens_q = torch.tensor([200, 17, 129], device=DEVICE)
    seqlens_k = torch.tensor([1300, 17, 640], device=DEVICE)
    q, k, v = _qkv(3, 200, 1300, 16, 2, dtype, seed=61, d=d)
    q, k, v = _nan_padding(q, k, v, seqlens_q, seqlens_k)
    kwargs = dict(causal=True, return_lse=True)
    out, lse = batchinv.attention(q, k, v, seqlens_q=seqlens_q, seqlens_k=seqlens_k, **kwargs)
    for b in range(3):
        lq, lk = seqlens_q[b].item(), seqlens_k[b].item()
        alone = batchinv.attention(
            q[b : b + 1, :lq].contiguous(),
            k[b : b + 1, :lk].contiguous(),
            v[b : b + 1, :lk].contiguous(),
            **kwargs,
        )
        assert_bitwise_equal(out[b : b + 1, :lq], alone[0], name=f"out, sequence {b}")
        assert_bitwise_equal(lse[b : b + 1, :, :lq], alone[1], name=f"lse, sequence {b}")


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@with_d
def test_chunked_prefill_and_decode_equal_hopper_prefill(dtype, d):
    # The prefill runs the Hopper kernel.  Chunks of 100 and 128 forced onto the Hopper kernel
    # read the cache storage in place (unwritten slots hold NaN: the last block of every chunk
    # brings some into shared memory); the same chunks in auto mode (split launches) and
    # token-by-token decode (one-warp mma.sync kernels) must reproduce the same rows.  Auto mode
    # takes split launches for the chunks whose rows see more than one split.
    total = SPLIT + 252
    q, k, v = _qkv(1, total, total, 8, 2, dtype, seed=71, d=d)
    full = gpu.attention(q, k, v, causal=True, return_lse=True, mode="tile", warps=4, hopper=True)
    forced = dict(mode="tile", warps=4, hopper=True)
    for chunk, tuning in ((100, forced), (128, forced), (100, {}), (1, {})):
        starts = [0, *range(total - 20, total)] if chunk == 1 else list(range(0, total, chunk))
        cache = KVCache(1, total, 2, d, dtype=dtype, device=DEVICE)
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else total
            # gpu.attention_with_kv_cache takes the tuning keywords; batchinv's does not.
            run = gpu.attention_with_kv_cache if tuning else batchinv.attention_with_kv_cache
            out, lse = run(q[:, s:e], k[:, s:e], v[:, s:e], cache, return_lse=True, **tuning)
            name = f"chunk {chunk} {tuning or 'auto'}"
            assert_bitwise_equal(out, full[0][:, s:e], name=f"{name}, out [{s}, {e})")
            assert_bitwise_equal(lse, full[1][:, :, s:e], name=f"{name}, lse [{s}, {e})")


def _finalize_rows(values: torch.Tensor, l: torch.Tensor):
    """The tile kernel's division of each row of 32 values by its l (finalize_row), and
    finalize_out element by element, from the test kernel attn_hopper_finalize_check."""
    from batchinv.runtime import kernel_for, launch

    rows = l.numel()
    values, l = values.contiguous().to(DEVICE), l.contiguous().to(DEVICE)
    out_row = torch.empty_like(values)
    out_ref = torch.empty_like(values)
    device = values.device
    kernel = kernel_for("attention_hopper", "attn_hopper_finalize_check", device)
    launch(
        kernel,
        device,
        grid=(-(-rows // 128),),
        block=(128,),
        args=(values, l, out_row, out_ref, rows),
    )
    return out_row, out_ref


@cuda
@needs_hopper
def test_finalize_division_equals_ieee_division():
    # finalize_row divides by one reciprocal per row where l and the row's values are in range
    # and runs finalize_out (IEEE division) otherwise; both must give the same bits.  Rows of
    # every exponent pair (values 2^-70 .. 2^70, l 2^-40 .. 2^40: inside and past the range's
    # edges) with random mantissas and signs, random rows in the plain range, and rows with one
    # special value (+-0, subnormal, tiny, huge, inf, NaN) or a special l (0, subnormal, inf,
    # NaN, negative).
    gen = torch.Generator().manual_seed(7)
    ev = torch.arange(-70, 71, dtype=torch.float32)
    el = torch.arange(-40, 41, dtype=torch.float32)
    pairs_v, pairs_l = torch.meshgrid(ev, el, indexing="ij")
    reps = 4
    exp_v = pairs_v.flatten().repeat_interleave(reps)
    exp_l = pairs_l.flatten().repeat_interleave(reps)
    rows = exp_v.numel()
    mant_v = 1 + torch.rand(rows, 32, generator=gen)
    sign = torch.where(torch.rand(rows, 32, generator=gen) < 0.5, -1.0, 1.0)
    values = [sign * mant_v * torch.exp2(exp_v)[:, None]]
    ls = [(1 + torch.rand(rows, generator=gen)) * torch.exp2(exp_l)]
    # The attention range: l >= 1 (a sum whose largest term is 1), |acc| <= l * max |v|.
    n = 1 << 16
    l_att = 1 + torch.rand(n, generator=gen) * 4096
    ls.append(l_att)
    values.append(torch.randn(n, 32, generator=gen) * l_att[:, None])
    specials = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-45, 1e-30, 3e-20, 1e25, float("inf"), float("-inf"), float("nan")]
    )
    spec_v = torch.randn(len(specials) * 64, 32, generator=gen)
    spec_v[torch.arange(spec_v.shape[0]), torch.arange(spec_v.shape[0]) % 32] = specials.repeat(64)
    values.append(spec_v)
    ls.append(1 + torch.rand(spec_v.shape[0], generator=gen) * 100)
    l_special = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("nan"), -3.0, 2.0**32, 2.0**33])
    values.append(torch.randn(len(l_special), 32, generator=gen))
    ls.append(l_special)
    zero_rows = torch.zeros(2, 32)
    zero_rows[1] = -0.0
    values.append(zero_rows)
    ls.append(torch.tensor([5.0, 5.0]))
    out_row, out_ref = _finalize_rows(torch.cat(values), torch.cat(ls))
    assert_bitwise_equal(out_row, out_ref, name="finalize_row vs finalize_out")
    # The comparison covers both paths: plain rows, and rows outside the plain range.
    assert torch.isnan(out_ref).any() and (out_ref == 0).any() and torch.isinf(out_ref).any()


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_extreme_values_equal_mma_sync(dtype, causal, d):
    # V columns of zeros, tiny and huge values and an inf key, and a head scaled down to tiny
    # values: outputs (and the threads' rows) on both sides of finalize's plain-division range.
    big, tiny = (1e30, 1e-30) if dtype == torch.bfloat16 else (6e4, 6e-8)
    seqlens_q = torch.tensor([300, 77, 64], device=DEVICE)
    seqlens_k = torch.tensor([1100, 1025, 300], device=DEVICE)
    q, k, v = _qkv(3, 300, 1100, 12, 4, dtype, seed=97, d=d)
    v[:, :, :, 0] = 0
    v[:, :, :, 9] = tiny
    v[:, :, :, 18] = big
    v[1, 50, :, 27] = float("inf")
    v[2, :, 1, :] *= tiny
    for scale in (None, 1.0):
        kwargs = dict(
            causal=causal,
            seqlens_q=seqlens_q,
            seqlens_k=seqlens_k,
            return_lse=True,
            softmax_scale=scale,
        )
        _hopper_equal_to_mma_sync(q, k, v, f"extreme values, softmax_scale={scale}", **kwargs)


# ----------------------------------------------------------------------------- Axis-B, errors


@cuda
@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@with_d
def test_within_tolerance_of_fp32_reference(dtype, causal, d):
    seqlens_q = torch.tensor([150, 33], device=DEVICE)
    seqlens_k = torch.tensor([1200, 99], device=DEVICE)
    q, k, v = _qkv(2, 150, 1200, 8, 2, dtype, seed=81, d=d)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    out, lse = gpu.attention(q, k, v, mode="tile", warps=4, hopper=True, **kwargs)
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


@cuda
@needs_hopper
@with_d
def test_fully_masked_rows_give_zero_and_minus_inf(d):
    q, k, v = _qkv(2, 100, 40, 8, 2, torch.bfloat16, seed=91, d=d)
    seqlens_k = torch.tensor([40, 0], device=DEVICE)
    out, lse = gpu.attention(
        q,
        k,
        v,
        causal=True,
        seqlens_k=seqlens_k,
        return_lse=True,
        mode="tile",
        warps=4,
        hopper=True,
    )
    # causal, 100 queries over 40 keys: queries 0..59 see nothing; sequence 1 has no key.
    masked_out = torch.cat([out[0, :60].flatten(), out[1].flatten()])
    assert torch.equal(masked_out.view(torch.int16), torch.zeros_like(masked_out).view(torch.int16))
    masked_lse = torch.cat([lse[0, :, :60].flatten(), lse[1].flatten()])
    assert torch.all(masked_lse == float("-inf"))
    assert torch.isfinite(lse[0, :, 60:]).all()


@cuda
@needs_hopper
@with_d
def test_hopper_true_where_it_does_not_apply_is_a_clear_error(d):
    # K/V heads not contiguous within a row (head stride 2d): no TMA map of the rows.
    q = _randn(1, 8, 8, d, dtype=torch.bfloat16, seed=1)
    k = _randn(1, 8, 2, 2 * d, dtype=torch.bfloat16, seed=2)[..., :d]
    assert not hopper._tma_rows(k.reshape(8, 2, d))
    with pytest.raises(ValueError, match="hopper=True"):
        gpu.attention(q, k, k, mode="tile", warps=4, hopper=True)
    # The same call runs the mma.sync tile kernel where hopper is left to choose.
    gpu.attention(q, k, k, mode="tile", warps=4)
    q, k, v = _qkv(1, 8, 8, 8, 2, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="hopper=True"):
        gpu.attention(q, k, v, mode="split", hopper=True)
