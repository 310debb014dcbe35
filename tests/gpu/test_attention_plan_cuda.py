"""The CUDA attention forward's launch plans (``gpu.attention._plan``): a call with the default
options reuses the plan of an earlier call with the same key, which must give the bits of a
call that plans afresh (explicit options bypass the cache), must never be reused for other
strides, alignment, dtypes or layout bounds, and must not skip a check.

Tests without the ``cuda`` mark check the key on CPU tensors and run anywhere.
"""

from __future__ import annotations

import pytest
import torch

from _streams import capture_graph, run_interleaved_on_streams
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import attention as gpu

DEVICE = "cuda"
cuda = pytest.mark.cuda


def _layout(lens, ctx, device, q_len=1, max_k_len=None):
    """Sequence b: ``q_len`` query rows from row ``b * q_len``, ``lens[b]`` keys from row
    ``b * ctx``."""
    batch = len(lens)
    ar = torch.arange(batch, device=device)
    return gpu.make_layout(
        ar * q_len,
        torch.full((batch,), q_len, device=device),
        ar * ctx,
        torch.tensor(lens, device=device),
        q_len,
        max(lens) if max_k_len is None else max_k_len,
    )


# ----------------------------------------------------------------------------- host logic (CPU)


def _cpu_rows(rows, heads, d=64, offset=0):
    flat = torch.zeros(rows * heads * d + offset, dtype=torch.bfloat16)
    return flat[offset:].view(rows, heads, d)


def test_plan_key_sees_strides_alignment_dtype_and_layout_bounds():
    q = _cpu_rows(2, 8)
    k = _cpu_rows(2 * 1100, 2)
    layout = _layout([1100, 5], 1100, "cpu")
    key = gpu._plan_key(q, k, k, layout, True)
    # Other tensors and another layout with the same numbers: the same key.
    same = gpu._plan_key(
        _cpu_rows(2, 8), _cpu_rows(2 * 1100, 2), k, _layout([1100, 7], 1100, "cpu"), True
    )
    assert same == key
    wide = _cpu_rows(2 * 1100, 4)[:, ::2]  # same shape, other strides
    others = [
        gpu._plan_key(q, wide, k, layout, True),
        gpu._plan_key(q, _cpu_rows(2 * 1100, 2, offset=4), k, layout, True),  # 8-byte base
        gpu._plan_key(q, k, _cpu_rows(2 * 1100, 2, offset=8), layout, True),  # 16-byte base
        gpu._plan_key(q, k.half(), k, layout, True),
        gpu._plan_key(q, k, k, _layout([5, 2049], 2049, "cpu"), True),  # longer max_k_len
        gpu._plan_key(q, k, k, _layout([1100, 5, 5], 1100, "cpu"), True),  # batch
        gpu._plan_key(q, k, k, layout, False),
    ]
    assert others[2] == key  # a 16-byte aligned base is as good as any other
    for i, other in enumerate(others):
        if i != 2:
            assert other != key, i


def test_layout_pointers_are_its_tensors_addresses():
    layout = _layout([3, 4], 4, "cpu")
    fields = (layout.q_start, layout.q_len, layout.k_start, layout.k_len)
    assert layout.pointers == tuple(t.data_ptr() for t in fields)
    assert layout.batch == 2


# ----------------------------------------------------------------------------- CUDA


def _decode(lens, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    """``(q, k, v)`` rows of a decode batch (one query per sequence, contexts ``lens`` in a
    ``[B * max, Hkv, d]`` storage with NaN past each length) and its layout."""
    batch, ctx = len(lens), max(lens)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, hq, d, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(batch, ctx, hkv, d, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(batch, ctx, hkv, d, device=DEVICE, generator=gen).to(dtype)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    return (q, k.view(-1, hkv, d), v.view(-1, hkv, d)), _layout(lens, ctx, DEVICE)


def _fresh(rows, layout, scale, **options):
    """The same call planned afresh: explicit options take the uncached path."""
    return gpu.forward(*rows, layout, True, scale, prefill_zero=False, **options)


@cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("d", (64, 128))
def test_a_reused_plan_gives_the_bits_of_a_fresh_one(dtype, d):
    rows, layout = _decode([1, 1025, 4097, 64], d=d, dtype=dtype, seed=d)
    scale = gpu.scale_of(None, d)
    mode, warps = gpu.choose(layout, 8, 2, torch.device(DEVICE), "auto", None)
    assert (mode, warps) == ("split", 1)
    want = _fresh(rows, layout, scale, mode=mode, warps=warps)
    gpu._PLANS.clear()
    first = gpu.forward(*rows, layout, True, scale, prefill_zero=False)
    assert len(gpu._PLANS) == 1
    again = gpu.forward(*rows, layout, True, scale, prefill_zero=False)
    assert len(gpu._PLANS) == 1  # the second call found the first call's plan
    assert_bitwise_equal(first, want, name="planned")
    assert_bitwise_equal(again, want, name="reused")
    # A new layout with the same bounds (a decode step's) reuses the plan with its own lengths.
    layout2 = _layout([30, 4000, 1, 1025], 4097, DEVICE, max_k_len=4097)
    assert layout2.max_k_len == layout.max_k_len
    got = gpu.forward(*rows, layout2, True, scale, prefill_zero=False)
    assert len(gpu._PLANS) == 1
    assert_bitwise_equal(got, _fresh(rows, layout2, scale, mode=mode, warps=warps))


def _uninitialised_decode(batch, ctx, hq=32, hkv=8, d=128):
    """``(q, k, v)`` rows and layout of a GQA 32/8 decode batch at ``ctx`` keys each, left
    uninitialised: a plan reads shapes, strides and alignment, never values."""
    q = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.empty(batch * ctx, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    return (q, k, torch.empty_like(k)), _layout([ctx] * batch, ctx, DEVICE)


@cuda
def test_coop_default_stages_follow_the_few_ctas_rule():
    # A cooperative decode launch of at most COOP_FEW_CTAS_PER_SM CTAs per SM takes
    # COOP_FEW_CTAS_STAGES K/V stages, a larger one COOP_DEFAULT_STAGES.  A GQA 32/8 decode
    # launch has 8 (kv heads) x B x splits CTAs: B=1 at 32769 keys is 136 CTAs and B=8 at 4097
    # keys 192 (2 stages on a 132-SM H100/H200), B=64 at 4096 keys 1024 CTAs (1 stage);
    # one-split batches on both sides of the threshold.
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    limit = int(gpu.COOP_FEW_CTAS_PER_SM * sms)
    one_split = gpu.SPLIT_KEYS
    cases = [(1, 32769), (8, 4097), (64, 4096)]
    cases += [(limit // 8, one_split), (limit // 8 + 1, one_split)]
    for batch, ctx in cases:
        rows, layout = _uninitialised_decode(batch, ctx)
        ctas = 8 * batch * -(-ctx // gpu.SPLIT_KEYS)
        plan = gpu._plan(*rows, layout, True)[0]
        grid = plan.main.grid
        assert grid[0] * grid[1] * grid[2] == ctas, (batch, ctx)
        want = gpu.COOP_FEW_CTAS_STAGES if ctas <= limit else gpu.COOP_DEFAULT_STAGES
        pinned = {s: gpu._plan(*rows, layout, True, stages=s)[0].main for s in gpu.COOP_STAGES}
        chosen = [s for s, launch in pinned.items() if launch == plan.main]
        assert chosen == [want], (batch, ctx, ctas, sms, chosen)
    assert (gpu.COOP_FEW_CTAS_STAGES, gpu.COOP_DEFAULT_STAGES) == (2, 1)


@cuda
def test_a_plan_is_not_reused_for_other_strides_alignment_or_bounds():
    lens = [1, 1025, 4097]
    (q, k, v), layout = _decode(lens, seed=3)
    scale = gpu.scale_of(None, 128)
    gpu._PLANS.clear()
    gpu.forward(q, k, v, layout, True, scale, prefill_zero=False)  # plans contiguous K/V (TMA)
    # K/V as every other head of a wider storage: same shape, other strides (no TMA map).
    wide_k = torch.stack([k, torch.full_like(k, float("nan"))], dim=2).view(k.shape[0], 4, 128)
    wide_v = torch.stack([v, torch.full_like(v, float("nan"))], dim=2).view(v.shape[0], 4, 128)
    strided = (q, wide_k[:, ::2], wide_v[:, ::2])
    assert strided[1].shape == k.shape and strided[1].stride() != k.stride()
    got = gpu.forward(*strided, layout, True, scale, prefill_zero=False)
    assert_bitwise_equal(got, _fresh((q, k, v), layout, scale, mode="split", warps=1))
    # The same tensors with a shorter longest context: fewer splits, another plan.
    short = _layout([1, 1025, 1025], 4097, DEVICE)
    got = gpu.forward(q, k, v, short, True, scale, prefill_zero=False)
    assert_bitwise_equal(got, _fresh((q, k, v), short, scale, mode="split", warps=1))


@cuda
def test_a_misaligned_k_is_copied_and_its_plan_never_kept():
    # A contiguous K at an 8-byte base: as_rows copies it (passed on unchanged it would be a
    # misaligned-address fault), and a plan made on a copy is never kept.
    lens = [1, 1025, 4097]
    (q, k, v), layout = _decode(lens, seed=4)
    scale = gpu.scale_of(None, 128)
    flat = torch.empty(k.numel() + 4, dtype=k.dtype, device=DEVICE)
    shifted = flat[4:].view(k.shape)
    shifted.copy_(k)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 8
    gpu._PLANS.clear()
    want = _fresh((q, k, v), layout, scale, mode="split", warps=1)
    for _ in range(2):
        got = gpu.forward(q, shifted, v, layout, True, scale, prefill_zero=False)
        assert_bitwise_equal(got, want)
    assert len(gpu._PLANS) == 0


@cuda
def test_prefill_and_empty_calls_through_the_cache():
    # A prefill layout (4-warp tile: the Hopper kernel where it applies) and a call with no
    # query rows, each twice through the cache, against the fresh plan.
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = (
        torch.randn(2 * 300, h, 128, device=DEVICE, generator=gen).to(torch.bfloat16)
        for h in (8, 2, 2)
    )
    layout = _layout([300, 300], 300, DEVICE, q_len=300)
    scale = gpu.scale_of(None, 128)
    want = gpu.forward(q, k, v, layout, True, scale, mode="tile", warps=4)
    for run in range(2):
        assert_bitwise_equal(gpu.forward(q, k, v, layout, True, scale), want, name=f"run {run}")
    empty_q = q[:0]
    for _ in range(2):
        out, lse = gpu.forward(empty_q, k, v, layout, True, scale)
        assert out.shape == (0, 8, 128) and lse.shape == (8, 0)


@cuda
def test_checks_still_raise_after_a_plan_is_reused():
    (q, k, v), layout = _decode([1, 1100], seed=7)
    scale = gpu.scale_of(None, 128)
    for _ in range(2):
        gpu.forward(q, k, v, layout, True, scale)
    with pytest.raises(TypeError, match="k has dtype torch.float32"):
        gpu.forward(q, k.float(), v, layout, True, scale)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        gpu.forward(q.float(), k, v, layout, True, scale)
    with pytest.raises(ValueError, match="head dim d=96"):
        gpu.forward(q[..., :96], k[..., :96], v[..., :96], layout, True, scale)
    with pytest.raises(ValueError, match="mode must be one of"):
        gpu.forward(q, k, v, layout, True, scale, mode="splits")
    with pytest.raises(TypeError, match="tma must be a bool"):
        gpu.forward(q, k, v, layout, True, scale, tma=1)


@cuda
def test_reused_plans_on_two_streams_and_in_a_cuda_graph():
    cases = [_decode([4097, 3000, 1025, 64, 1] * 4, hq=32, hkv=8, seed=s) for s in (11, 12)]
    scale = gpu.scale_of(None, 128)
    want = [_fresh(rows, layout, scale, mode="split", warps=1) for rows, layout in cases]
    got = run_interleaved_on_streams(
        [
            lambda rows=rows, layout=layout: gpu.forward(
                *rows, layout, True, scale, prefill_zero=False
            )
            for rows, layout in cases
        ],
        rounds=3,
    )
    for i in range(2):
        for run, result in enumerate(got[i]):
            assert_bitwise_equal(result, want[i], name=f"stream {i}, run {run}")
    (q, k, v), layout = cases[0]
    graph, captured = capture_graph(
        lambda: gpu.forward(q, k, v, layout, True, scale, prefill_zero=False)
    )
    for step in range(2):
        gen = torch.Generator(device=DEVICE).manual_seed(20 + step)
        q.copy_(torch.randn(q.shape, device=DEVICE, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(captured, _fresh((q, k, v), layout, scale, mode="split", warps=1))
