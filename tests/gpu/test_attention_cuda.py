"""The CUDA attention forward: within the contract's tolerance of the strict fp32 reference,
bitwise invariant (out AND lse) to batch, row position, neighbours, padding, chunked prefill,
decode, varlen packing and prefix reuse; both execution modes and both tile heights give the
same bits; clear errors for what the kernels do not take.

Tests without the ``cuda`` mark check the host-side layout logic and run anywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from _streams import capture_graph, run_interleaved_on_streams
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import attention as gpu
from batchinv.kv_cache import KVCache
from batchinv.reference.attention import attention_fp32, attention_varlen_fp32

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
HEADS = ((8, 2), (2, 2))  # (Hq, Hkv): GQA 4:1 (Qwen3's 32/8 scaled down) and MHA
SPLIT = gpu.SPLIT_KEYS  # the contract's split (2048 keys)
LONG_CONTEXT = 2 * SPLIT + 452  # three splits: split merges are exercised
CHUNK_SIZES = (1, 7, 64, 100)

cuda = pytest.mark.cuda


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _qkv(batch, sq, sk, hq, hkv, d, dtype, seed=0):
    q = _randn(batch, sq, hq, d, dtype=dtype, seed=seed, scale=1.5)
    k = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 1, scale=1.5)
    v = _randn(batch, sk, hkv, d, dtype=dtype, seed=seed + 2)
    return q, k, v


# ----------------------------------------------------------------------------- host logic (CPU)


def test_packed_heads_divide_the_group():
    assert gpu.packed_heads(32, 8) == 4
    assert gpu.packed_heads(8, 8) == 1
    assert gpu.packed_heads(64, 2) == 16  # group 32: at most 16 heads per tile
    assert gpu.packed_heads(24, 1) == 12
    assert gpu.packed_heads(34, 1) == 2  # group 34 = 2 * 17


def test_shared_bytes_fit_the_sm80_limit():
    for d in gpu.HEAD_DIMS:
        for warps in gpu.WARP_CHOICES:
            for split in (False, True):
                assert gpu.shared_bytes(d, warps, split) <= 163 * 1024
    # One K and one V buffer (128 keys x 128 dense swizzled columns), the Q tile (136-element
    # rows), then the running state (64 rows x 128 fp32); two such CTAs fit an sm_90 SM (228 KB).
    assert gpu.shared_bytes(128, 4, False) == 2 * 128 * 128 * 2 + 64 * 136 * 2 + 64 * 128 * 4
    assert 2 * (gpu.shared_bytes(128, 4, False) + 1024) <= 228 * 1024
    assert gpu.shared_bytes(128, 1, True) == 2 * 128 * 128 * 2 + 16 * 136 * 2


def test_make_layout_is_int32_and_keeps_bounds():
    lay = gpu.make_layout(
        torch.tensor([0, 5]), torch.tensor([5, 3]), torch.tensor([0, 9]), torch.tensor([9, 4]), 5, 9
    )
    assert all(t.dtype == torch.int32 for t in (lay.q_start, lay.q_len, lay.k_start, lay.k_len))
    assert (lay.batch, lay.max_q_len, lay.max_k_len) == (2, 5, 9)


def test_choose_rejects_unknown_mode_and_warps():
    lay = gpu.make_layout(*(torch.zeros(1, dtype=torch.int32),) * 4, 1, 1)
    with pytest.raises(ValueError, match="mode"):
        gpu.choose(lay, 8, 2, torch.device("cpu"), "fast", None)
    with pytest.raises(ValueError, match="warps"):
        gpu.choose(lay, 8, 2, torch.device("cpu"), "tile", 2)


def test_as_rows_copies_only_misaligned_layouts():
    t = torch.zeros(4, 2, 64)
    assert gpu.as_rows(t) is t
    odd = torch.zeros(4, 2, 66)[..., :64]  # head stride 66: not 16-byte aligned for bf16 rows
    assert gpu.as_rows(odd).is_contiguous()
    # A contiguous tensor at an 8-byte base (contiguous() alone would return it unchanged).
    flat = torch.arange(4 * 2 * 64 + 4, dtype=torch.float32).to(torch.bfloat16)
    shifted = flat[4:].view(4, 2, 64)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 8
    rows = gpu.as_rows(shifted)
    assert rows.data_ptr() % 16 == 0 and rows.is_contiguous()
    assert_bitwise_equal(rows, shifted)


def test_scale_is_rounded_to_fp32_once():
    assert gpu.scale_of(None, 128) == float(torch.tensor(128**-0.5, dtype=torch.float32))
    assert gpu.scale_of(0.1, 64) == float(torch.tensor(0.1, dtype=torch.float32))


@pytest.mark.parametrize("scale", (0.0, -0.0, -0.125, 1e-50))
def test_scale_must_be_positive_after_rounding(scale):
    # The kernels scale each block's max of the raw scores once (kernels_cu/attention.cu): the
    # max of the scaled scores only for a scale > 0.  1e-50 rounds to fp32 +0.
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        gpu.scale_of(scale, 128)


# ----------------------------------------------------------------------------- Axis-B


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", (True, False))
def test_padded_within_tolerance_of_fp32_reference(dtype, d, heads, causal):
    hq, hkv = heads
    q, k, v = _qkv(3, 77, 150, hq, hkv, d, dtype, seed=d + hq)
    seqlens_q = torch.tensor([77, 40, 1], device=DEVICE)
    seqlens_k = torch.tensor([150, 91, 64], device=DEVICE)
    kwargs = dict(causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k, return_lse=True)
    out, lse = batchinv.attention(q, k, v, **kwargs)
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_long_context_decode_within_tolerance(dtype, d):
    q, k, v = _qkv(2, 3, LONG_CONTEXT, 8, 2, d, dtype, seed=11)
    for mode in ("tile", "split"):
        out, lse = gpu.attention(q, k, v, causal=True, return_lse=True, mode=mode)
        ref_out, ref_lse = attention_fp32(q, k, v, causal=True, return_lse=True)
        assert_within_tolerance(out, ref_out, op_class="attention", name=f"out ({mode})")
        assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_within_tolerance_and_softmax_scale(dtype):
    cu_q = torch.tensor([0, 5, 5, 70], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 131, 200], device=DEVICE, dtype=torch.int32)
    q = _randn(70, 8, 128, dtype=dtype, seed=3)
    k = _randn(200, 2, 128, dtype=dtype, seed=4)
    v = _randn(200, 2, 128, dtype=dtype, seed=5)
    kwargs = dict(causal=True, softmax_scale=0.05, return_lse=True)
    out, lse = batchinv.attention_varlen(q, k, v, cu_q, cu_k, **kwargs)
    ref_out, ref_lse = attention_varlen_fp32(q, k, v, cu_q, cu_k, **kwargs)
    assert_within_tolerance(out, ref_out, op_class="attention", name="out")
    assert_within_tolerance(lse, ref_lse, op_class="attention", name="lse", dtype=dtype)


# ----------------------------------------------------------------------------- modes and tiles


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", (True, False))
def test_modes_and_tile_heights_give_the_same_bits(dtype, d, causal):
    # 3 sequences of different lengths, queries at the end of long contexts: split merges,
    # empty splits and blocks for some rows of a tile, and partial blocks.
    q, k, v = _qkv(3, 37, LONG_CONTEXT, 8, 2, d, dtype, seed=21)
    kwargs = dict(
        causal=causal,
        seqlens_q=torch.tensor([37, 5, 20], device=DEVICE),
        seqlens_k=torch.tensor([LONG_CONTEXT, 1100, SPLIT + 1], device=DEVICE),
        return_lse=True,
    )
    base = gpu.attention(q, k, v, mode="tile", warps=4, **kwargs)
    for mode, warps, stages, coop in (
        ("tile", 1, 1, False),
        ("split", 4, 1, False),
        ("split", 1, 1, False),
        *(("split", 1, s, True) for s in gpu.COOP_STAGES),
    ):
        got = gpu.attention(q, k, v, mode=mode, warps=warps, stages=stages, coop=coop, **kwargs)
        name = f"{mode}/{warps} warps/{stages} stages/coop {coop} vs tile/4 warps"
        assert_bitwise_equal(got, base, name=name)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_score_range_same_bits_in_every_mode(dtype):
    # Scores spanning far more than 126 in the log2 domain: many P elements fall below 2^-126
    # (flushed to +0 in every mode, see the kernel header); the result stays within tolerance.
    q, k, v = _qkv(2, 40, LONG_CONTEXT, 8, 2, 128, dtype, seed=31)
    kwargs = dict(causal=True, softmax_scale=1.0, return_lse=True)
    base = gpu.attention(q, k, v, mode="tile", warps=4, **kwargs)
    ref_out, ref_lse = attention_fp32(q, k, v, **kwargs)
    assert_within_tolerance(base[0], ref_out, op_class="attention", name="out")
    assert_within_tolerance(base[1], ref_lse, op_class="attention", name="lse", dtype=dtype)
    for mode, warps, stages, coop in (
        ("tile", 1, 1, False),
        ("split", 4, 1, False),
        ("split", 1, 1, False),
        ("split", 1, 1, True),
        ("split", 1, 3, True),
    ):
        got = gpu.attention(q, k, v, mode=mode, warps=warps, stages=stages, coop=coop, **kwargs)
        assert_bitwise_equal(got, base, name=f"{mode}/{warps} warps/{stages} stages/coop {coop}")


# Decode contexts around multiples of 64 keys, block (128) and split (SPLIT) boundaries, three
# splits (2 * SPLIT + 1), and (Hq, Hkv) groups whose packed rows fill a quarter, half and all of
# a 16-row tile.  1023-1025 are block edges inside a split.
BLOCK_EDGES = (1, 63, 65, 127, 128, 129, 255, 256, 257)
DECODE_CONTEXTS = (*BLOCK_EDGES, 1023, 1024, 1025, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 1)
DECODE_HEADS = ((8, 2), (8, 1), (16, 1))


def _decode_case(dtype, d, lens, seed=60, heads=(8, 2)):
    """``(q, q_new [B, 1], k, v, k_lens)`` with ``heads = (Hq, Hkv)``: sequence b's decode query
    is its row ``lens[b] - 1`` (row 0 for an empty one); NaN past each length."""
    hq, hkv = heads
    batch, ctx = len(lens), max(lens)
    q, k, v = _qkv(batch, ctx, ctx, hq, hkv, d, dtype, seed=seed + d)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    q_new = torch.stack([q[b, max(n, 1) - 1] for b, n in enumerate(lens)])[:, None]
    return q, q_new, k, v, torch.tensor(lens, device=DEVICE)


def _prefill_answers(q, k, v, lens):
    """``{b: (out, lse)}``: sequence b's one-shot tile-mode prefill (empty sequences left out),
    whose last row is what its decode row must equal."""
    return {
        b: gpu.attention(
            q[b : b + 1, :n],
            k[b : b + 1, :n],
            v[b : b + 1, :n],
            causal=True,
            return_lse=True,
            mode="tile",
            warps=4,
        )
        for b, n in enumerate(lens)
        if n > 0
    }


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", DECODE_HEADS)
def test_decode_kernels_equal_prefill_at_block_and_split_boundaries(dtype, d, heads):
    # One decode batch (odd size, NaN past every k_len) through each split kernel and pipeline
    # depth; every row must equal the last row of its sequence's one-shot prefill (tile mode).
    lens = DECODE_CONTEXTS[::2] if QUICK else DECODE_CONTEXTS
    q, q_new, k, v, k_lens = _decode_case(dtype, d, lens, seed=40 + heads[0], heads=heads)
    want = _prefill_answers(q, k, v, lens)
    variants = [(s, True) for s in gpu.COOP_STAGES] + [(gpu.TILE_STAGES, False)]
    for stages, coop in variants:
        kw = dict(mode="split", warps=1, stages=stages, coop=coop)
        out, lse = gpu.attention(q_new, k, v, causal=True, seqlens_k=k_lens, return_lse=True, **kw)
        for b, n in enumerate(lens):
            name = f"{stages} stages, coop {coop}, context {n}"
            assert_bitwise_equal(out[b : b + 1], want[b][0][:, -1:], name=f"out, {name}")
            assert_bitwise_equal(lse[b : b + 1], want[b][1][:, :, -1:], name=f"lse, {name}")
    alone = gpu.attention(
        q_new[-1:], k[-1:, : lens[-1]], v[-1:, : lens[-1]], causal=True, return_lse=True
    )
    last = want[len(lens) - 1]
    assert_bitwise_equal(alone, (last[0][:, -1:], last[1][:, :, -1:]), name="B=1")


def test_coop_shared_bytes_fit_the_sm90_limit():
    for d in gpu.HEAD_DIMS:
        for stages in gpu.COOP_STAGES:
            assert gpu.coop_shared_bytes(d, stages) <= 227 * 1024
    # K and V of one 128-key block (dense swizzled rows), then the Q tile / fp32 S tile.
    assert gpu.coop_shared_bytes(128, 1) == 2 * 128 * 128 * 2 + 16 * 132 * 4
    assert gpu.coop_shared_bytes(64, 2) == 2 * 2 * 128 * 64 * 2 + 16 * 132 * 4


@cuda
def test_coop_needs_a_one_warp_split_launch_and_a_known_depth():
    q, k, v = _qkv(1, 1, 1100, 8, 2, 64, torch.bfloat16, seed=41)
    with pytest.raises(ValueError, match="coop"):
        gpu.attention(q, k, v, mode="tile", warps=1, coop=True)
    with pytest.raises(ValueError, match="stages"):
        gpu.attention(q, k, v, mode="split", warps=1, coop=True, stages=4)
    with pytest.raises(ValueError, match="stages must be 1 without coop for 1-warp tiles"):
        gpu.attention(q, k, v, mode="split", warps=1, coop=False, stages=2)
    with pytest.raises(ValueError, match="stages must be 1 without coop for 4-warp tiles"):
        gpu.attention(q, k, v, mode="split", warps=4, stages=2)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_kernels_repeat_bitwise_with_an_empty_context(dtype, d):
    # The cooperative kernel at every K/V pipeline depth against the one-warp split kernel,
    # twice each: context 0 (every split CTA returns at once and the combine writes +0 / -inf
    # into an unfilled output), 1 key, block and split boundaries, 5 splits, NaN past every
    # length.
    lens = [0, 1, 63, 127, 129, 1023, 1024, 1025, SPLIT - 1, SPLIT, SPLIT + 1, 4 * SPLIT + 1]
    q, k, v = _qkv(len(lens), 1, max(lens), 8, 2, d, dtype, seed=50 + d)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    kw = dict(
        causal=True, seqlens_k=torch.tensor(lens, device=DEVICE), return_lse=True, mode="split"
    )
    want = gpu.attention(q, k, v, warps=1, coop=False, **kw)
    assert bool((want[0][0] == 0).all()) and not bool(torch.signbit(want[0][0].float()).any())
    assert bool((want[1][0] == float("-inf")).all())
    for stages in gpu.COOP_STAGES:
        for run in range(2):
            got = gpu.attention(q, k, v, warps=1, coop=True, stages=stages, **kw)
            assert_bitwise_equal(got, want, name=f"coop, {stages} stages, run {run}")


def _require_coop_tma():
    k = torch.zeros(64, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    if not gpu.coop_tma_applies(k, k):
        pytest.skip("the cooperative kernel copies K/V by TMA on sm_90a devices only")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", ((8, 2), (32, 4), (4, 4)))
def test_coop_tma_copies_equal_cp_async_and_prefill(dtype, d, heads):
    # The cooperative kernel with TMA K/V copies (swizzled stages, rows past k_len zeroed after
    # the copy: here NaN inside the tensor, and past its end for the last sequence) at every
    # ring depth: each decode row equals the last row of its sequence's one-shot prefill and the
    # cp.async kernel's row, bitwise; an empty sequence gives +0 / -inf; B=1 alone too.  GQA 4:1,
    # 8:1 and MHA; odd batch; block and split boundaries.
    _require_coop_tma()
    hq = heads[0]
    lens = (
        [1, 65, 129, 0, SPLIT, SPLIT + 1, 2 * SPLIT + 1]
        if QUICK
        else [1, 63, 65, 127, 128, 129, 0, 1023, 1025, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 1]
    )
    batch = len(lens)
    q, q_new, k, v, k_lens = _decode_case(dtype, d, lens, seed=80 + hq, heads=heads)
    want = _prefill_answers(q, k, v, lens)
    zero_out = torch.zeros((1, 1, hq, d), dtype=dtype, device=DEVICE)
    minus_inf = torch.full((1, hq, 1), float("-inf"), device=DEVICE)
    kw = dict(causal=True, seqlens_k=k_lens, return_lse=True, mode="split", warps=1, coop=True)
    for stages in gpu.COOP_STAGES:
        got = {t: gpu.attention(q_new, k, v, stages=stages, tma=t, **kw) for t in (True, False)}
        assert_bitwise_equal(got[True], got[False], name=f"tma vs cp.async, {stages} stages")
        for b, n in enumerate(lens):
            name = f"tma, {stages} stages, context {n}"
            row = (want[b][0][:, -1:], want[b][1][:, :, -1:]) if n else (zero_out, minus_inf)
            assert_bitwise_equal(got[True][0][b : b + 1], row[0], name=f"out, {name}")
            assert_bitwise_equal(got[True][1][b : b + 1], row[1], name=f"lse, {name}")
        alone = gpu.attention(
            q_new[-1:],
            k[-1:, : lens[-1]],
            v[-1:, : lens[-1]],
            causal=True,
            return_lse=True,
            stages=stages,
            tma=True,
        )
        last = (want[batch - 1][0][:, -1:], want[batch - 1][1][:, :, -1:])
        assert_bitwise_equal(alone, last, name=f"B=1, tma, {stages} stages")


@cuda
def test_coop_tma_option_is_checked():
    q, k, v = _qkv(1, 1, 1100, 8, 2, 64, torch.bfloat16, seed=44)
    with pytest.raises(TypeError, match="tma must be a bool or None, got int"):
        gpu.attention(q, k, v, causal=True, mode="split", warps=1, tma=1)
    with pytest.raises(ValueError, match="tma=True needs the cooperative split kernel"):
        gpu.attention(q, k, v, causal=True, mode="tile", warps=1, tma=True)
    strided = torch.cat([k, k], dim=-1)[..., :64]  # rows whose heads are not contiguous
    assert not gpu.coop_tma_applies(strided.view(-1, 2, 64), strided.view(-1, 2, 64))
    with pytest.raises(ValueError, match="tma=True needs an sm_90a device"):
        gpu.attention(q, strided, strided, causal=True, mode="split", warps=1, tma=True)
    # Where TMA does not apply the default is the cp.async kernel: the same bits as tma=False.
    kw = dict(causal=True, mode="split", warps=1, return_lse=True)
    assert_bitwise_equal(
        gpu.attention(q, strided, strided, **kw),
        gpu.attention(q, strided, strided, tma=False, **kw),
        name="strided K/V, default vs cp.async",
    )


def test_coop_tma_shared_bytes_fit_the_ctas_per_sm():
    for d in gpu.HEAD_DIMS:
        # The kernels' launch bounds: 2, 1 and 1 CTAs per SM at ring depths 1, 2 and 3.
        for stages, ctas in ((1, 2), (2, 1), (3, 1)):
            assert ctas * (gpu.coop_tma_shared_bytes(d, stages) + 1024) <= 228 * 1024
    assert gpu.coop_tma_shared_bytes(128, 1) == 2 * 128 * 128 * 2 + 16 * 132 * 4 + 8 + 1024


def test_pdl_argument_is_checked_before_the_device():
    with pytest.raises(TypeError, match="pdl must be a bool or None, got int"):
        gpu.combine_uses_pdl(torch.device(DEVICE), pdl=1)
    assert gpu.combine_uses_pdl(torch.device(DEVICE), pdl=False) is False


def _require_pdl():
    if not gpu.combine_uses_pdl(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch runs where the sm_90a kernels run (sm_90)")


def _poison_free_memory():
    """Leaves NaN in the caching allocator's free blocks, so a combine that read a workspace
    before the split kernel wrote it would output NaN instead of the right bits."""
    junk = torch.full((16 << 20,), float("nan"), device=DEVICE)
    small = [torch.full((n,), float("nan"), device=DEVICE) for n in (1 << 12, 1 << 16, 1 << 18)]
    del junk, small


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_with_pdl_equals_prefill_and_the_ordinary_launch(dtype, d):
    # Every split kernel with its combine launched programmatically (PDL) and ordinarily, into
    # poisoned memory: each row equals the last row of its sequence's one-shot prefill.
    _require_pdl()
    lens = [1, 63, 129, 1025, SPLIT, SPLIT + 1, 2 * SPLIT + 1]
    q, q_new, k, v, k_lens = _decode_case(dtype, d, lens)
    want = _prefill_answers(q, k, v, lens)
    variants = [(s, True) for s in gpu.COOP_STAGES] + [(gpu.TILE_STAGES, False)]
    for stages, coop in variants:
        got = {}
        for pdl in (True, False, True):
            _poison_free_memory()
            kw = dict(mode="split", warps=1, stages=stages, coop=coop, pdl=pdl)
            out, lse = gpu.attention(
                q_new, k, v, causal=True, seqlens_k=k_lens, return_lse=True, **kw
            )
            name = f"{stages} stages, coop {coop}, pdl {pdl}"
            for b, n in enumerate(lens):
                row = (want[b][0][:, -1:], want[b][1][:, :, -1:])
                assert_bitwise_equal(out[b : b + 1], row[0], name=f"out, {name}, context {n}")
                assert_bitwise_equal(lse[b : b + 1], row[1], name=f"lse, {name}, context {n}")
            if pdl in got:
                assert_bitwise_equal((out, lse), got[pdl], name=f"repeat, {name}")
            got[pdl] = (out, lse)
        assert_bitwise_equal(got[True], got[False], name=f"pdl on vs off, {stages}, {coop}")
    # The default decode path (mode auto) uses PDL here and gives the same bits.
    auto = gpu.attention(q_new, k, v, causal=True, seqlens_k=k_lens, return_lse=True)
    assert_bitwise_equal(auto, got[False], name="auto")


def _big_decode(seed):
    """``((q, k, v) rows, layout)`` of a Qwen3-shaped decode batch (64 sequences, GQA 32/8,
    d = 128, bf16): split CTAs for several waves, so the combine's CTAs start while split CTAs
    still run.  NaN past each length."""
    lens = [4097, 3000, 1025, 2048, 4000, 64, 3500, 1] * 8
    batch, ctx = len(lens), max(lens)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, 32, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, ctx, 8, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, ctx, 8, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    layout = gpu.make_layout(
        torch.arange(batch, device=DEVICE),
        torch.ones(batch, device=DEVICE),
        torch.arange(batch, device=DEVICE) * ctx,
        torch.tensor(lens, device=DEVICE),
        1,
        ctx,
    )
    return (q, k.view(-1, 8, 128), v.view(-1, 8, 128)), layout


@cuda
def test_decode_with_pdl_on_two_streams_equals_the_ordinary_launch():
    _require_pdl()
    cases = [_big_decode(seed) for seed in (70, 71)]
    scale = gpu.scale_of(None, 128)
    want = [gpu.forward(*rows, layout, True, scale, pdl=False) for rows, layout in cases]
    got = run_interleaved_on_streams(
        [
            lambda rows=rows, layout=layout: gpu.forward(*rows, layout, True, scale, pdl=True)
            for rows, layout in cases
        ],
        rounds=4,
    )
    for i in range(2):
        for run, result in enumerate(got[i]):
            assert_bitwise_equal(result, want[i], name=f"stream {i}, run {run}")


@cuda
def test_decode_with_pdl_in_a_cuda_graph_equals_the_ordinary_launch():
    _require_pdl()
    (q, k, v), layout = _big_decode(80)
    scale = gpu.scale_of(None, 128)
    graph, captured = capture_graph(lambda: gpu.forward(q, k, v, layout, True, scale, pdl=True))
    for step in range(2):
        gen = torch.Generator(device=DEVICE).manual_seed(81 + step)
        q.copy_(torch.randn(q.shape, device=DEVICE, generator=gen))  # new queries, captured buffer
        _poison_free_memory()
        graph.replay()
        torch.cuda.synchronize()
        want = gpu.forward(q, k, v, layout, True, scale, pdl=False)
        assert_bitwise_equal(captured, want, name=f"replay {step}")


@cuda
def test_pdl_true_is_an_error_where_the_sm90a_kernels_do_not_run():
    if gpu.combine_uses_pdl(torch.device(DEVICE)):
        pytest.skip("checks a device without the sm_90a kernels")
    _, q_new, k, v, k_lens = _decode_case(torch.bfloat16, 64, [1100, 5])
    with pytest.raises(ValueError, match="pdl=True needs an sm_90 device"):
        gpu.attention(q_new, k, v, causal=True, seqlens_k=k_lens, mode="split", pdl=True)
    # Elsewhere the default is an ordinary launch: the same bits as pdl=False.
    assert_bitwise_equal(
        gpu.attention(q_new, k, v, causal=True, seqlens_k=k_lens, mode="split"),
        gpu.attention(q_new, k, v, causal=True, seqlens_k=k_lens, mode="split", pdl=False),
    )


# ----------------------------------------------------------------------------- Axis-A, T1-T4, T6


def _alone(q, k, v, b, lq, lk, **kwargs):
    """Sequence ``b`` computed alone (its own padded batch of 1, trimmed to its lengths)."""
    return batchinv.attention(
        q[b : b + 1, :lq].contiguous(),
        k[b : b + 1, :lk].contiguous(),
        v[b : b + 1, :lk].contiguous(),
        return_lse=True,
        **kwargs,
    )


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
def test_row_bits_independent_of_batch_position_neighbours_and_padding(dtype, d, heads):
    hq, hkv = heads
    sq, sk = 70, 140
    lq, lk = 45, 133  # the sequence under test
    for batch in (1, 3, 8):  # T1 (odd sizes) and T2 (it sits last)
        q, k, v = _qkv(batch, sq, sk, hq, hkv, d, dtype, seed=batch)
        b = batch - 1
        q[b, lq:] = float("nan")  # T4: padding is NaN, never read
        k[b, lk:] = float("nan")
        v[b, lk:] = float("nan")
        lens_q = torch.randint(1, sq + 1, (batch,), generator=torch.Generator().manual_seed(batch))
        lens_k = torch.randint(1, sk + 1, (batch,), generator=torch.Generator().manual_seed(7))
        lens_q[b], lens_k[b] = lq, lk
        out, lse = batchinv.attention(
            q,
            k,
            v,
            causal=True,
            seqlens_q=lens_q.to(DEVICE),
            seqlens_k=lens_k.to(DEVICE),
            return_lse=True,
        )
        alone_out, alone_lse = _alone(q, k, v, b, lq, lk, causal=True)
        assert_bitwise_equal(out[b : b + 1, :lq], alone_out, name=f"out, batch {batch}")
        assert_bitwise_equal(lse[b : b + 1, :, :lq], alone_lse, name=f"lse, batch {batch}")
        assert bool((out[b, lq:] == 0).all()) and bool((lse[b, :, lq:] == float("-inf")).all())
        if batch > 1:  # T3: other content in the neighbours
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[0] = _randn(sq, hq, d, dtype=dtype, seed=99)
            k2[0] = _randn(sk, hkv, d, dtype=dtype, seed=98)
            out2, lse2 = batchinv.attention(
                q2,
                k2,
                v2,
                causal=True,
                seqlens_q=lens_q.to(DEVICE),
                seqlens_k=lens_k.to(DEVICE),
                return_lse=True,
            )
            assert_bitwise_equal(out2[b, :lq], out[b, :lq], name="out, neighbours changed")
            assert_bitwise_equal(lse2[b, :, :lq], lse[b, :, :lq], name="lse, neighbours changed")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_key_padding_mask_equals_compacted_keys(dtype):
    q, k, v = _qkv(2, 30, 150, 8, 2, 128, dtype, seed=5)
    mask = (torch.rand(2, 150, generator=torch.Generator().manual_seed(1)) > 0.3).to(DEVICE)
    k[~mask] = float("nan")
    v[~mask] = float("nan")
    out, lse = batchinv.attention(q, k, v, causal=True, key_padding_mask=mask, return_lse=True)
    for b in range(2):
        kept = mask[b].nonzero().squeeze(1)
        alone = batchinv.attention(
            q[b : b + 1], k[b : b + 1, kept], v[b : b + 1, kept], causal=True, return_lse=True
        )
        assert_bitwise_equal((out[b : b + 1], lse[b : b + 1]), alone, name=f"sequence {b}")
    ref_out = attention_fp32(q, k, v, causal=True, key_padding_mask=mask)
    assert_within_tolerance(out, ref_out, op_class="attention", name="masked out")


@cuda
def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _qkv(2, 40, 20, 8, 2, 64, torch.bfloat16, seed=8)
    # causal with more queries than keys: the first 20 rows see no key; sequence 1 has none.
    out, lse = batchinv.attention(
        q, k, v, causal=True, seqlens_k=torch.tensor([20, 0], device=DEVICE), return_lse=True
    )
    assert bool((out[0, :20] == 0).all()) and bool((lse[0, :, :20] == float("-inf")).all())
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())
    assert not bool(torch.signbit(out[0, :20].float()).any())  # +0, not -0
    ref = attention_fp32(q, k, v, causal=True, seqlens_k=torch.tensor([20, 0], device=DEVICE))
    assert_within_tolerance(out, ref, op_class="attention", name="out")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_equals_padded(dtype):
    lens_q, lens_k = [33, 1, 64], [130, 65, 64]
    q, k, v = _qkv(3, 64, 130, 8, 2, 128, dtype, seed=9)
    padded = batchinv.attention(
        q,
        k,
        v,
        causal=True,
        seqlens_q=torch.tensor(lens_q, device=DEVICE),
        seqlens_k=torch.tensor(lens_k, device=DEVICE),
        return_lse=True,
    )
    qp = torch.cat([q[b, : lens_q[b]] for b in range(3)])
    kp = torch.cat([k[b, : lens_k[b]] for b in range(3)])
    vp = torch.cat([v[b, : lens_k[b]] for b in range(3)])
    cu_q = torch.tensor([0, 33, 34, 98], device=DEVICE)
    cu_k = torch.tensor([0, 130, 195, 259], device=DEVICE)
    out, lse = batchinv.attention_varlen(qp, kp, vp, cu_q, cu_k, causal=True, return_lse=True)
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert_bitwise_equal(out[rows], padded[0][b, : lens_q[b]], name=f"out {b}")
        assert_bitwise_equal(lse[:, rows], padded[1][b, :, : lens_q[b]], name=f"lse {b}")


@cuda
def test_strided_inputs_equal_contiguous():
    q, k, v = _qkv(2, 50, 90, 8, 2, 64, torch.float16, seed=10)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, d] view of [B, H, S, d]
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    got = batchinv.attention(qt, kt, v, causal=True, return_lse=True)
    want = batchinv.attention(q, k, v, causal=True, return_lse=True)
    assert_bitwise_equal(got, want, name="transposed vs contiguous")
    # padded rows and heads: strides the kernel reads directly (no copy)
    qw = torch.zeros(2, 50, 8, 72, dtype=q.dtype, device=DEVICE)
    kw = torch.zeros(2, 90, 2, 80, dtype=q.dtype, device=DEVICE)
    qw[..., :64], kw[..., :64] = q, k
    got = batchinv.attention(qw[..., :64], kw[..., :64], v, causal=True, return_lse=True)
    assert_bitwise_equal(got, want, name="row/head strided vs contiguous")


# ----------------------------------------------------------------------------- T5, T7: KV cache


def _prefill(q, k, v):
    return batchinv.attention(q, k, v, causal=True, return_lse=True)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_chunked_prefill_and_decode_equal_one_prefill(dtype, d):
    total = SPLIT + 252 if QUICK else LONG_CONTEXT  # past one split, or three
    q, k, v = _qkv(1, total, total, 8, 2, d, dtype, seed=12)
    full_out, full_lse = _prefill(q, k, v)
    for chunk in CHUNK_SIZES:
        # chunk 1 decodes the last 40 tokens one by one, after one big chunk.
        starts = [0, *range(total - 40, total)] if chunk == 1 else list(range(0, total, chunk))
        cache = KVCache(1, total, 2, d, dtype=dtype, device=DEVICE)
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else total
            out, lse = batchinv.attention_with_kv_cache(
                q[:, s:e], k[:, s:e], v[:, s:e], cache, return_lse=True
            )
            assert_bitwise_equal(out, full_out[:, s:e], name=f"chunk {chunk}, out [{s}, {e})")
            assert_bitwise_equal(lse, full_lse[:, :, s:e], name=f"chunk {chunk}, lse [{s}, {e})")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_one_equals_batch_eight(dtype):
    # With the new key: contexts past the first split, ending on it and one key into the second.
    d, lens = 128, [SPLIT + 52, 5, 1024, 1025, 64, SPLIT, 3, SPLIT - 1]
    ctx = max(lens) + 1
    q, k, v = _qkv(8, ctx, ctx, 8, 2, d, dtype, seed=13)
    big = KVCache(8, ctx, 2, d, dtype=dtype, device=DEVICE)
    for b, n in enumerate(lens):
        big.append(k[b : b + 1, :n], v[b : b + 1, :n], torch.tensor([b], device=DEVICE))
    q_new = torch.stack([q[b, lens[b]] for b in range(8)])[:, None]
    k_new = torch.stack([k[b, lens[b]] for b in range(8)])[:, None]
    v_new = torch.stack([v[b, lens[b]] for b in range(8)])[:, None]
    out8, lse8 = batchinv.attention_with_kv_cache(q_new, k_new, v_new, big, return_lse=True)
    for b in (0, 3, 7):
        one = KVCache(1, ctx, 2, d, dtype=dtype, device=DEVICE)
        one.copy_prefix(b, 0, lens[b], source=big)  # T7: a prefix written by another batch
        out1, lse1 = batchinv.attention_with_kv_cache(
            q_new[b : b + 1], k_new[b : b + 1], v_new[b : b + 1], one, return_lse=True
        )
        assert_bitwise_equal((out1, lse1), (out8[b : b + 1], lse8[b : b + 1]), name=f"seq {b}")
        # and both equal the row of a one-shot prefill of the whole sequence
        n = lens[b] + 1
        full = _prefill(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n])
        assert_bitwise_equal(out1, full[0][:, -1:], name=f"decode vs prefill {b}")
        assert_bitwise_equal(lse1, full[1][:, :, -1:], name=f"decode lse vs prefill {b}")


@cuda
def test_prefix_reuse_across_caches():
    d, dtype, n = 64, torch.bfloat16, 1500
    q, k, v = _qkv(1, n + 5, n + 5, 8, 2, d, dtype, seed=14)
    a = KVCache(2, n + 5, 2, d, dtype=dtype, device=DEVICE)
    a.append(k[:, :n], v[:, :n], torch.tensor([1], device=DEVICE))
    b = KVCache(3, n + 5, 2, d, dtype=dtype, device=DEVICE)
    b.copy_prefix(1, 2, source=a)
    got_a = batchinv.attention_with_kv_cache(
        q[:, n:], k[:, n:], v[:, n:], a, torch.tensor([1], device=DEVICE), return_lse=True
    )
    got_b = batchinv.attention_with_kv_cache(
        q[:, n:], k[:, n:], v[:, n:], b, torch.tensor([2], device=DEVICE), return_lse=True
    )
    assert_bitwise_equal(got_b, got_a, name="prefix copied into another cache")


@cuda
def test_kv_cache_seqlens_new_pads_and_matches_reference():
    d, dtype = 64, torch.float16
    cache = KVCache(2, 300, 2, d, dtype=dtype, device=DEVICE)
    ref_cache = KVCache(2, 300, 2, d, dtype=torch.float32, device="cpu")
    q, k, v = _qkv(2, 100, 100, 8, 2, d, dtype, seed=15)
    lens = torch.tensor([100, 37], device=DEVICE)
    out, lse = batchinv.attention_with_kv_cache(q, k, v, cache, seqlens_new=lens, return_lse=True)
    ref_out, _ = batchinv.attention_with_kv_cache(
        q.float().cpu(),
        k.float().cpu(),
        v.float().cpu(),
        ref_cache,
        seqlens_new=lens.cpu(),
        return_lse=True,
    )
    assert_within_tolerance(out, ref_out.to(DEVICE), op_class="attention", name="out", dtype=dtype)
    assert bool((out[1, 37:] == 0).all()) and bool((lse[1, :, 37:] == float("-inf")).all())


# ----------------------------------------------------------------------------- autograd


@cuda
def test_requires_grad_forward_has_the_same_bits():
    q, k, v = _qkv(2, 20, 30, 8, 2, 64, torch.bfloat16, seed=16)
    want = batchinv.attention(q, k, v, causal=True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got = batchinv.attention(*leaves, causal=True)
    assert_bitwise_equal(got.detach(), want, name="autograd forward")
    got.sum().backward()  # values: tests/gpu/test_attention_autograd_cuda.py
    assert all(t.grad is not None for t in leaves)


@cuda
def test_kv_cache_refuses_requires_grad():
    cache = KVCache(1, 10, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = _qkv(1, 2, 2, 8, 2, 64, torch.bfloat16, seed=17)
    with pytest.raises(RuntimeError, match="inference-only"):
        batchinv.attention_with_kv_cache(q.requires_grad_(True), k, v, cache)


# ----------------------------------------------------------------------------- bad inputs


@cuda
@pytest.mark.parametrize("d", (80, 96, 256))
def test_unsupported_head_dim_is_a_clear_error(d):
    q, k, v = _qkv(1, 4, 4, 2, 2, d, torch.bfloat16, seed=18)
    with pytest.raises(ValueError, match=f"head dim d={d}"):
        batchinv.attention(q, k, v)


@cuda
def test_float32_on_gpu_is_a_clear_error():
    q, k, v = _qkv(1, 4, 4, 2, 2, 64, torch.float32, seed=19)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        batchinv.attention(q, k, v)


@cuda
def test_mixed_dtypes_shapes_and_devices_are_clear_errors():
    q, k, v = _qkv(1, 4, 4, 2, 2, 64, torch.bfloat16, seed=20)
    with pytest.raises(TypeError):
        batchinv.attention(q, k.half(), v)
    with pytest.raises(ValueError, match="same shape"):
        batchinv.attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="Hq=2"):
        batchinv.attention(q, torch.cat([k, k, k], dim=2), torch.cat([v, v, v], dim=2))
    with pytest.raises(ValueError, match="device"):
        batchinv.attention(q, k.cpu(), v)


@cuda
@pytest.mark.parametrize("scale", (0.0, -0.5))
def test_non_positive_scale_is_a_clear_error(scale):
    q, k, v = _qkv(1, 4, 4, 2, 2, 64, torch.bfloat16, seed=22)
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        batchinv.attention(q, k, v, softmax_scale=scale)
    cu = torch.tensor([0, 4], device=DEVICE)
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        batchinv.attention_varlen(q[0], k[0], v[0], cu, cu, softmax_scale=scale)
    cache = KVCache(1, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        batchinv.attention_with_kv_cache(q, k, v, cache, softmax_scale=scale)
    assert int(cache.lengths[0]) == 0  # nothing was written


@cuda
def test_cache_overflow_is_a_clear_error():
    cache = KVCache(1, 4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = _qkv(1, 5, 5, 2, 2, 64, torch.bfloat16, seed=21)
    with pytest.raises(ValueError, match="max_len=4"):
        batchinv.attention_with_kv_cache(q, k, v, cache)
    assert int(cache.lengths[0]) == 0  # nothing was written


def test_make_layout_owns_a_copy_of_its_lengths():
    # The autograd backward trusts the forward's layout: editing the caller's tensors after
    # make_layout (int32 and contiguous, which an unowned layout would alias) changes nothing.
    starts = torch.tensor([0, 5], dtype=torch.int32)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    lay = gpu.make_layout(starts, lens, starts, lens, 5, 5)
    starts[1], lens[0] = 7, 1
    fields = (lay.q_start, lay.q_len, lay.k_start, lay.k_len)
    assert [t.tolist() for t in fields] == [[0, 5], [5, 3], [0, 5], [5, 3]]


@cuda
@pytest.mark.parametrize(
    "cu_q,cu_k",
    [
        ([0, 5, 3, 8], [0, 2, 4, 8]),
        ([1, 5, 8], [0, 4, 8]),
        ([0, 5, 8], [0, 4, 7]),
        ([0], [0]),
        ([0, 4, 8], [0, 8]),
    ],
)
def test_bad_gpu_cu_seqlens_raise_the_cpu_message(cu_q, cu_k):
    # The GPU lengths are read once and checked on the host by the same code as CPU lengths.
    q, k, v = _qkv(1, 8, 8, 4, 2, 64, torch.bfloat16, seed=40)
    q, k, v = q[0], k[0], v[0]
    errors = []
    for device in ("cpu", DEVICE):
        with pytest.raises(ValueError) as caught:
            batchinv.attention_varlen(
                q, k, v, torch.tensor(cu_q, device=device), torch.tensor(cu_k, device=device)
            )
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert "cu_seqlens" in errors[0]


@cuda
def test_bad_gpu_seqlens_raise_the_cpu_message():
    q, k, v = _qkv(2, 8, 8, 4, 2, 64, torch.bfloat16, seed=41)
    for name, bad in (("seqlens_q", [8, 9]), ("seqlens_k", [-1, 2])):
        errors = []
        for device in ("cpu", DEVICE):
            with pytest.raises(ValueError) as caught:
                batchinv.attention(q, k, v, **{name: torch.tensor(bad, device=device)})
            errors.append(str(caught.value))
        assert errors[0] == errors[1] and name in errors[0]


@cuda
def test_gpu_lengths_with_cpu_q_raise():
    q, k, v = _qkv(2, 8, 8, 4, 2, 64, torch.float32, seed=42)
    with pytest.raises(ValueError, match="seqlens_q is on cuda.*lengths must be on q's device"):
        batchinv.attention(q.cpu(), k.cpu(), v.cpu(), seqlens_q=torch.tensor([8, 8], device=DEVICE))
