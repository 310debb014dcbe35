"""The eager no-grad path of ``attention``, ``attention_varlen``, ``linear`` and
``log_softmax`` on CUDA keeps launch plans per signature.  On the CPU the CUDA modules run
against recording stand-ins for the kernels (CPU tensors dispatched as CUDA), so these tests
pin the host logic: a lean call launches the kernels, grids and integer arguments of the
general path, its cache keys hold no tensors, a switch changed at run time takes effect at
once, and a bad argument after good calls raises the op's own error.  The bits on a GPU are
``tests/gpu/test_host_path_attention_linear_cuda.py``'s."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _fake_kernels import FakeKernel
from batchinv import registry
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import attention_hopper, linear_cublaslt
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import log_softmax as gpu_log_softmax

DTYPE = torch.bfloat16


def _walk(value):
    """Every object inside nested tuples, lists, dicts and frozensets."""
    if isinstance(value, (tuple, list, frozenset, set)):
        for item in value:
            yield from _walk(item)
    elif isinstance(value, dict):
        for item in value.items():
            yield from _walk(item)
    else:
        yield value


def _holds_no_tensor(cache: dict) -> bool:
    return not any(isinstance(item, torch.Tensor) for item in _walk(list(cache)))


# ----------------------------------------------------------------------------- attention


@pytest.fixture
def attention_launches(monkeypatch):
    """CPU tensors dispatched to the CUDA attention of an sm_90 device, every launch recorded
    (TMA maps as the bytes of their arguments)."""
    launches = []
    monkeypatch.setattr(registry, "backend_of", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpu_attention, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(gpu_attention, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gpu_attention, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_attention, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(attention_hopper, "applies", lambda q, k, v: False)
    monkeypatch.setattr(gpu_attention, "tensor_map_2d", lambda *args: repr(args).encode())
    monkeypatch.setattr(
        gpu_attention, "_kernel", lambda name, device, shared: FakeKernel(name, launches)
    )
    _clear_attention_caches()
    yield launches
    _clear_attention_caches()  # nothing made with the stand-ins outlives the test


def _clear_attention_caches():
    for cache in (gpu_attention._LEAN, gpu_attention._PLANS, gpu_attention._FULL_LAYOUTS):
        cache.clear()
    gpu_attention._encoded_tma_map.cache_clear()


def _qkv(batch, sq, sk, hq=8, hkv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=gen).to(DTYPE)
    k = torch.randn(batch, sk, hkv, d, generator=gen).to(DTYPE)
    v = torch.randn(batch, sk, hkv, d, generator=gen).to(DTYPE)
    return q, k, v


def _without_outputs(record, layout=True):
    """A launch with the output, lse and workspace pointers left out (fresh per call), and
    without the per-sequence layout pointers unless ``layout`` (a padded call's layout is kept
    per shape and stream; a varlen general call uploads its layout afresh)."""
    name, grid, block, args, shared, stream, programmatic = record
    if name.startswith("attn_combine"):
        kept = args[3:] if layout else args[6:]
    else:
        maps = 2 if name.endswith("_tma") else 0
        kept = args[: maps + 3] + args[maps + (6 if layout else 10) :]
    return name, grid, block, kept, shared, stream, programmatic


def _general_padded(q, k, v, **options):
    return gpu_attention.attention(q, k, v, **options)


@pytest.mark.parametrize(
    ("batch", "sq", "sk"),
    [(1, 1, 256), (8, 1, 256), (64, 1, 256), (3, 1, 4100), (2, 17, 300), (1, 64, 64)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lean_padded_attention_launches_what_the_general_path_launches(
    attention_launches, batch, sq, sk, causal
):
    q, k, v = _qkv(batch, sq, sk)
    with torch.no_grad():
        out = batchinv.attention(q, k, v, causal=causal)
        again = batchinv.attention(q, k, v, causal=causal)
    lean = [_without_outputs(r) for r in attention_launches]
    assert len(gpu_attention._LEAN) == 1 and None not in gpu_attention._LEAN.values()
    attention_launches.clear()
    _general_padded(q, k, v, causal=causal)
    general = [_without_outputs(r) for r in attention_launches]
    assert lean == general + general  # both lean calls, the second from the kept plan
    assert out.shape == again.shape == q.shape and out.dtype == DTYPE and out.is_contiguous()


def test_lean_attention_output_lse_and_workspace_share_one_aligned_buffer(attention_launches):
    q, k, v = _qkv(3, 1, 256)  # decode: a one-split launch and its combine; 96 bytes of lse
    with torch.no_grad():
        out = batchinv.attention(q, k, v)
    (main, combine) = attention_launches
    assert main[0].startswith("attn_split_coop") and combine[0].startswith("attn_combine")
    out_ptr, lse_ptr, ws_ptr = main[3][5:8]  # after the two TMA maps and q, k, v
    assert combine[3][:3] == (ws_ptr, out_ptr, lse_ptr)
    lean = next(iter(gpu_attention._LEAN.values()))
    tq, hq, d = 3, 8, 64
    assert out_ptr == out.data_ptr() and lean.alloc > 0
    assert lse_ptr >= out_ptr + tq * hq * d * 2 and lse_ptr % 256 == out_ptr % 256
    assert ws_ptr >= lse_ptr + hq * tq * 4 and ws_ptr % 256 == out_ptr % 256
    ws_bytes = tq * hq * (d + 2) * 4  # one split
    assert ws_ptr + ws_bytes <= out_ptr + out.untyped_storage().nbytes()


def test_a_long_split_workspace_takes_its_own_allocation(attention_launches):
    q, k, v = _qkv(2, 1, 8 * 2048)  # eight splits: the workspace is ~16x out's bytes
    with torch.no_grad():
        out = batchinv.attention(q, k, v)
    lean = next(iter(gpu_attention._LEAN.values()))
    assert lean.alloc == 0 and lean.scratch > 0
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()


# Packed length sets (queries, keys per sequence), a sequence without queries or keys included.
VARLEN_LENGTHS = [
    ([1, 1, 1], [256, 17, 4100]),
    ([1, 0, 1], [300, 0, 40]),
    ([17, 5, 64], [17, 300, 64]),
    ([0, 3], [5, 2100]),
]


def _varlen_case(q_lens, k_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 8, 64, generator=gen).to(DTYPE)
    k = torch.randn(int(cu_k[-1]), 2, 64, generator=gen).to(DTYPE)
    v = torch.randn(int(cu_k[-1]), 2, 64, generator=gen).to(DTYPE)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(("q_lens", "k_lens"), VARLEN_LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_lean_varlen_attention_launches_what_the_general_path_launches(
    attention_launches, q_lens, k_lens, causal
):
    q, k, v, cu_q, cu_k = _varlen_case(q_lens, k_lens)
    with torch.no_grad():
        for _ in range(2):
            out = batchinv.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    lean = [_without_outputs(r, layout=False) for r in attention_launches]
    (kept,) = gpu_attention._LEAN.values()
    attention_launches.clear()
    gpu_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    general = [_without_outputs(r, layout=False) for r in attention_launches]
    assert lean == general + general and out.shape == q.shape
    # The kept layout holds the values of a layout built afresh from the same lengths.
    fresh = gpu_attention._varlen_layout(cu_q, cu_k, "cpu")
    for field in ("q_start", "q_len", "k_start", "k_len", "max_q_len", "max_k_len"):
        torch.testing.assert_close(getattr(kept.layout, field), getattr(fresh, field))
    assert _holds_no_tensor(gpu_attention._LEAN)


def test_new_length_values_make_a_new_layout(attention_launches):
    q, k, v, cu_q, cu_k = _varlen_case([1, 1], [256, 40])
    with torch.no_grad():
        batchinv.attention_varlen(q, k, v, cu_q, cu_k)
        other_k = torch.tensor([0, 40, 296], dtype=torch.int32)  # the same totals, other lengths
        batchinv.attention_varlen(q, k, v, cu_q, other_k)
    first, second = (record[3][7:11] for record in attention_launches[::2])
    assert first != second and len(gpu_attention._LEAN) == 2
    (layout_a, layout_b) = (lean.layout for lean in gpu_attention._LEAN.values())
    assert layout_a.k_len.tolist() == [256, 40] and layout_b.k_len.tolist() == [40, 256]


def test_the_lean_attention_key_sees_causal_scale_dtype_and_stream(attention_launches, monkeypatch):
    q, k, v = _qkv(4, 1, 300)
    half = (q.half(), k.half(), v.half())
    cases = [((q, k, v), {}), ((q, k, v), {"causal": True}), ((q, k, v), {"softmax_scale": 0.5})]
    with torch.no_grad():
        for inputs, keywords in [*cases, (half, {})]:
            attention_launches.clear()
            batchinv.attention(*inputs, **keywords)
            lean = [_without_outputs(r) for r in attention_launches]
            attention_launches.clear()
            _general_padded(*inputs, **keywords)
            assert lean == [_without_outputs(r) for r in attention_launches], keywords
        assert len(gpu_attention._LEAN) == 4
        # Another stream: a layout uploaded on that stream, and the launches on it.
        monkeypatch.setattr(gpu_attention, "current_raw_stream", lambda index: 8)
        attention_launches.clear()
        batchinv.attention(q, k, v)
    assert len(gpu_attention._LEAN) == 5
    assert {record[5] for record in attention_launches} == {8}
    # One layout per (shape, stream): the calls on the first stream share theirs.
    assert len({id(lean.layout) for lean in gpu_attention._LEAN.values()}) == 2
    assert _holds_no_tensor(gpu_attention._LEAN)


def test_a_plan_made_during_a_graph_capture_is_not_kept(attention_launches, monkeypatch):
    q, k, v = _qkv(2, 1, 64)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with torch.no_grad():
        batchinv.attention(q, k, v)
    assert len(gpu_attention._LEAN) == 0 and len(attention_launches) == 2


def _stand_in_launch(kernel, device, grid, block, args, shared_mem=0, programmatic=False):
    """``runtime.launch`` on a ``FakeKernel`` (the general path's launches)."""
    kernel(grid, block, args, shared_mem, 7, device.index or 0, programmatic)


# ----------------------------------------------------------------------------- log_softmax


@pytest.fixture
def log_softmax_launches(monkeypatch):
    """CPU tensors dispatched to the CUDA log_softmax of an sm_90 device, launches recorded."""
    launches = []
    props = type("Props", (), {})()
    props.shared_memory_per_multiprocessor = 233472
    props.shared_memory_per_block_optin = 232448
    monkeypatch.setattr(registry, "backend_of", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gpu_log_softmax, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(gpu_log_softmax, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_log_softmax, "_properties", lambda index: props)
    monkeypatch.setattr(gpu_log_softmax, "_shared_budget", lambda index, threads, static: 40960)
    monkeypatch.setattr(gpu_log_softmax, "_resident_clusters", lambda *args: 16)
    monkeypatch.setattr(gpu_log_softmax, "allow_dynamic_shared", lambda *args: None)
    monkeypatch.setattr(gpu_log_softmax, "_allow_cluster_size", lambda *args: None)
    monkeypatch.setattr(
        gpu_log_softmax, "kernel_for", lambda module, name, device: FakeKernel(name, launches)
    )
    monkeypatch.setattr(gpu_log_softmax, "launch", _stand_in_launch)
    gpu_log_softmax._LEAN.clear()
    yield launches
    gpu_log_softmax._LEAN.clear()


def _without_pointers(record, pointers):
    name, grid, block, args, shared, stream, programmatic = record
    return name, grid, block, args[pointers:], shared, stream, programmatic


@pytest.mark.parametrize("rows", [1, 8, 64, 3])
@pytest.mark.parametrize(("vocab", "dtype"), [(151936, DTYPE), (32000, DTYPE), (4104, torch.half)])
def test_lean_log_softmax_launches_what_the_general_path_launches(
    log_softmax_launches, rows, vocab, dtype
):
    x = torch.randn(2, rows, vocab).to(dtype)[1]
    for _ in range(2):
        out = batchinv.log_softmax(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert len(gpu_log_softmax._LEAN) == 1 and None not in gpu_log_softmax._LEAN.values()
    lean = list(log_softmax_launches)
    log_softmax_launches.clear()
    gpu_log_softmax.forward(x, torch.float32, need_lse=False)
    general = [_without_pointers(r, 1) for r in log_softmax_launches]
    assert [_without_pointers(r, 1) for r in lean] == general + general
    assert lean[0][3][1:3] == (0, x.data_ptr())  # no lse; x where it lies


def test_log_softmax_switches_take_effect_at_once(log_softmax_launches, monkeypatch):
    x = torch.randn(2, 151936).to(DTYPE)
    batchinv.log_softmax(x)
    monkeypatch.setattr(gpu_log_softmax, "USE_CLUSTER", False)
    batchinv.log_softmax(x)
    monkeypatch.setattr(gpu_log_softmax, "_shared_budget", lambda index, threads, static: 0)
    batchinv.log_softmax(x)
    names = [record[0] for record in log_softmax_launches]
    assert names[0].startswith("log_softmax_cluster_forward") and "cluster" not in names[1]
    assert log_softmax_launches[1][3][-1] > 0 and log_softmax_launches[2][3][-1] == 0  # smem tier
    assert _holds_no_tensor(gpu_log_softmax._LEAN)


# ----------------------------------------------------------------------------- linear


@pytest.fixture
def linear_launches(monkeypatch):
    """CPU tensors dispatched to the CUDA linear of an sm_90 device, launches recorded."""
    launches = []
    monkeypatch.setattr(registry, "backend_of", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpu_linear, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(gpu_linear, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_linear, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(gpu_linear, "_require_sm80", lambda device: None)
    monkeypatch.setattr(gpu_linear, "allow_dynamic_shared", lambda *args: None)
    monkeypatch.setattr(gpu_linear, "tensor_map_2d", lambda *args: repr(args).encode())
    monkeypatch.setattr(
        gpu_linear, "kernel_for", lambda module, name, device: FakeKernel(name, launches)
    )
    monkeypatch.setattr(gpu_linear, "launch", _stand_in_launch)
    monkeypatch.setattr(linear_cublaslt, "takes_pinned", lambda m, weight, path, matmul: False)
    _clear_linear_caches()
    yield launches
    _clear_linear_caches()


def _clear_linear_caches():
    gpu_linear._LEAN.clear()
    gpu_linear._LEAN_BACKWARD.clear()
    gpu_linear._LEAN_GROUPED.clear()
    cached_functions = (gpu_linear._auto_choice, gpu_linear._gemm_kernel, gpu_linear._tensor_map)
    cached_functions += (gpu_linear._grouped_kernel, gpu_linear._grouped_weight_map)
    for cached in cached_functions:
        cached.cache_clear()


def _linear_case(rows, n=256, k=512, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DTYPE)
    w = torch.randn(n, k, generator=gen).to(DTYPE)
    return x, w, (torch.randn(n, generator=gen).to(DTYPE) if bias else None)


@pytest.mark.parametrize("rows", [1, 8, 17, 64, 1024])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["auto", "own"])
def test_lean_linear_launches_what_the_general_path_launches(linear_launches, rows, bias, path):
    x, w, b = _linear_case(rows, bias=bias)
    batchinv.set_linear_path(path)
    try:
        with torch.no_grad():
            batchinv.linear(x, w, b)
            out = batchinv.linear(x, w, b)
        lean = [_without_pointers(r, 3) for r in linear_launches]
        linear_launches.clear()
        gpu_linear.forward(x, w, b)
    finally:
        batchinv.set_linear_path(None)
    general = [_without_pointers(r, 3) for r in linear_launches]
    # Where the pinned path may serve the call (its self-check decides), the general path runs.
    pinned_may_serve = rows >= 1024 and path == "auto" and not bias
    kept = list(gpu_linear._LEAN.values())
    assert len(kept) == 1 and (kept[0] is None) == pinned_may_serve
    assert lean == general + general and out.shape == (rows, 256)


def test_set_linear_path_takes_effect_at_once(linear_launches, monkeypatch):
    asked = []

    def takes_pinned(m, weight, path, matmul):
        asked.append(path)
        return False  # refused: batchinv's kernels serve the call either way

    monkeypatch.setattr(linear_cublaslt, "takes_pinned", takes_pinned)
    x, w, _ = _linear_case(1024)
    try:
        with torch.no_grad():
            batchinv.set_linear_path("own")
            batchinv.linear(x, w)
            batchinv.linear(x, w)
            assert asked == []  # "own" never asks the pinned path
            batchinv.set_linear_path("cublaslt")
            batchinv.linear(x, w)
            assert asked == ["cublaslt"]
    finally:
        batchinv.set_linear_path(None)
    assert len(linear_launches) == 3 and _holds_no_tensor(gpu_linear._LEAN)


def test_linear_tma_maps_follow_the_operands_address(linear_launches):
    x, w, _ = _linear_case(8)
    other = x.clone()
    with torch.no_grad():
        for operand in (x, other, x):
            batchinv.linear(operand, w)
    maps = [record[3][0] for record in linear_launches]
    assert maps[0] == maps[2] != maps[1]
    assert str(x.data_ptr()).encode() in maps[0] and str(other.data_ptr()).encode() in maps[1]
    assert len({record[3][1] for record in linear_launches}) == 1  # the weight's map, kept


def _without_output(record):
    name, grid, block, args, shared, stream, programmatic = record
    return name, grid, block, (*args[:2], 0, *args[3:]), shared, stream, programmatic


# (rows, out, in): small batches, and one whose products take 128-row tiles.
BACKWARD_SHAPES = [(1, 256, 512), (8, 256, 512), (64, 256, 512), (1024, 256, 512)]
BACKWARD_SHAPES += [(2048, 2048, 2048)]


@pytest.mark.parametrize(("rows", "n", "k"), BACKWARD_SHAPES)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("path", ["auto", "own"])
def test_lean_linear_backward_launches_what_the_general_path_launches(
    linear_launches, monkeypatch, rows, n, k, needs, path
):
    # The maps without their device index (a CPU tensor has none; the lean path asks for it).
    monkeypatch.setattr(gpu_linear, "tensor_map_2d", lambda *args: repr(args[:-1]).encode())
    x, w, _ = _linear_case(rows, n, k)
    grad = torch.randn(rows, n).to(DTYPE)
    batchinv.set_linear_path(path)
    try:
        got = [gpu_linear.backward(grad, x, w, None, (*needs, False)) for _ in range(2)]
        lean = list(linear_launches)
        linear_launches.clear()
        monkeypatch.setattr(gpu_linear, "_lean_backward", lambda *args: None)
        want = gpu_linear.backward(grad, x, w, None, (*needs, False))
    finally:
        batchinv.set_linear_path(None)
    general = list(linear_launches)
    # Small batches take the copies route for grad_x: no plan where grad_x is needed there
    # (the general path's padded copies get new addresses per call: compared without maps).
    planned = not (needs[0] and gpu_linear.takes_small_m(rows, k))
    if rows == 2048:  # 128-row tiles: grad_x's map boxes then differ from the weight gradient's
        names = {r[0] for r in general}
        assert any("_tb_" in name and "bm128" in name for name in names) == needs[0]
    assert (None not in gpu_linear._LEAN_BACKWARD.values()) == planned
    strip = _without_output if planned else (lambda r: _without_pointers(r, 3))
    assert [strip(r) for r in lean] == [strip(r) for r in general + general]
    for result in got:
        for ours, theirs in zip(result, want, strict=True):
            assert (ours is None) == (theirs is None)
            if ours is not None:
                assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert _holds_no_tensor(gpu_linear._LEAN_BACKWARD)


def test_lean_linear_backward_leaves_a_bias_gradient_to_the_general_path(linear_launches):
    x, w, b = _linear_case(64, bias=True)
    grad = torch.randn(64, 256).to(DTYPE)
    grad_x, grad_w, grad_b = gpu_linear.backward(grad, x, w, b.dtype, (True, True, True))
    assert grad_b is not None and grad_b.shape == (256,)
    assert len(gpu_linear._LEAN_BACKWARD) == 0
    gpu_linear.backward(grad, x, w, b.dtype, (True, True, False))  # no bias gradient asked
    assert list(gpu_linear._LEAN_BACKWARD.values()) != [None]


@pytest.fixture
def grouped_launches(linear_launches, monkeypatch):
    """``linear_launches`` with ``linear_group`` taking CPU tensors: its device test passes
    (the rest of ``_grouped_biases`` runs)."""

    def on_any_device(x, weights, biases):
        tensors = [x, *weights, *(b for b in biases or () if b is not None)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None
        try:
            return gpu_linear.check_grouped_args(x.reshape(-1, x.shape[-1]), weights, biases)
        except (TypeError, ValueError):
            return None

    monkeypatch.setattr(gpu_linear, "_grouped_biases", on_any_device)
    # The maps without their device index (a CPU tensor has none; the kept path asks for it).
    monkeypatch.setattr(gpu_linear, "tensor_map_2d", lambda *args: repr(args[:-1]).encode())
    return linear_launches


def _without_grouped_output(record):
    name, grid, block, args, shared, stream, programmatic = record
    out_at = 1 + gpu_linear.MAX_GROUPED  # after x's map and one map per slot
    return name, grid, block, (*args[:out_at], 0, *args[out_at + 1 :]), shared, stream, programmatic


def _grouped_case(lead, out_features=(512, 128, 128), bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 256, generator=gen).to(DTYPE)
    weights = [torch.randn(n, 256, generator=gen).to(DTYPE) for n in out_features]
    biases = [torch.randn(n, generator=gen).to(DTYPE) if bias and i != 1 else None
              for i, n in enumerate(out_features)]  # fmt: skip
    return x, weights, biases if bias else None


@pytest.mark.parametrize("lead", [(1,), (8,), (16,), (2, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [(512, 128, 128), (256, 0, 128), (1024, 1024)])
def test_kept_linear_group_launches_what_the_checked_path_launches(
    grouped_launches, monkeypatch, lead, bias, out_features
):
    x, weights, biases = _grouped_case(lead, out_features, bias)
    with torch.no_grad():
        got = [gpu_linear.linear_group(x, weights, biases) for _ in range(2)]
        kept = list(grouped_launches)
        grouped_launches.clear()
        monkeypatch.setattr(gpu_linear, "_grouped_signature", lambda *args: None)
        want = gpu_linear.linear_group(x, weights, biases)
    general = list(grouped_launches)
    assert len(general) == 1 and "_grouped_" in general[0][0]
    assert [_without_grouped_output(r) for r in kept] == [
        _without_grouped_output(r) for r in general + general
    ]
    plans = list(gpu_linear._LEAN_GROUPED.values())
    assert len(plans) == 1 and isinstance(plans[0], gpu_linear._LeanGrouped)
    assert _holds_no_tensor(gpu_linear._LEAN_GROUPED)
    for views in got:
        assert [v.shape for v in views] == [w.shape for w in want]
        assert views[0].data_ptr() == views[0]._base.data_ptr()  # views of one output


def test_kept_linear_group_declines_what_the_checked_path_declines(grouped_launches):
    x, weights, biases = _grouped_case((8,))
    weights[0].requires_grad_(True)
    for _ in range(2):
        assert gpu_linear.linear_group(x, weights, biases) is None
    assert list(gpu_linear._LEAN_GROUPED.values()) == [None] and grouped_launches == []
    x = torch.randn(1024, 256).to(DTYPE)  # beyond the small-M rule
    with torch.no_grad():
        assert gpu_linear.linear_group(x, weights, biases) is None


def test_linear_group_on_misaligned_or_empty_operands_takes_the_checked_path(grouped_launches):
    x, weights, _ = _grouped_case((8,))
    shifted = torch.empty(8 * 256 + 1, dtype=DTYPE)[1:].view(8, 256)  # 2 bytes past alignment
    shifted.copy_(x)
    with torch.no_grad():
        assert len(gpu_linear.linear_group(shifted, weights, None)) == 3
        assert len(gpu_linear._LEAN_GROUPED) == 0  # no key for a misaligned operand
        empty = gpu_linear.linear_group(x[:0], weights, None)
    assert [v.shape for v in empty] == [(0, 512), (0, 128), (0, 128)]
    assert list(gpu_linear._LEAN_GROUPED.values()) == [gpu_linear._GENERAL]


# ----------------------------------------------------------------------------- bad after good
# Each case: a good call on the lean CUDA path (made twice: the second from the kept plan),
# then calls that differ in one thing the checks read; every one must raise its own error.


def _attn(q_dtype=DTYPE, d=64, **options):
    q, k, v = _qkv(2, 1, 64, d=d)
    return batchinv.attention(q.to(q_dtype), k.to(q_dtype), v.to(q_dtype), **options)


def _varlen(cu_q=(0, 1, 2), cu_k=(0, 40, 64)):
    q, k, v, _, _ = _varlen_case([1, 1], [40, 24])
    cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    return batchinv.attention_varlen(q, k, v, cu_q, cu_k)


def _strided_weight():
    return torch.randn(512, 512).to(DTYPE)[::2]  # the good call's shape [256, 512]


BAD_AFTER_GOOD = [
    ("attention", _attn, lambda: _attn(d=96), ValueError, "head dim d=96"),
    ("attention", _attn, lambda: _attn(q_dtype=torch.float32), TypeError, "float16"),
    ("attention", _attn, lambda: _attn(softmax_scale=-0.5), ValueError, "must be positive"),
    ("attention", _varlen, lambda: _varlen(cu_k=(0, 40, 63)), ValueError, r"cu_seqlens_k\[-1\]"),
    ("attention", _varlen, lambda: _varlen(cu_q=(0, 2, 1)), ValueError, "non-decreasing"),
    (
        "linear",
        lambda: batchinv.linear(*_linear_case(8)[:2]),
        lambda: batchinv.linear(_linear_case(8)[0], _strided_weight()),
        ValueError,
        "weight must be contiguous",
    ),
    (
        "linear",
        lambda: batchinv.linear(*_linear_case(8)[:2]),
        lambda: batchinv.linear(*_linear_case(8, k=500)[:2]),
        ValueError,
        "in_features % 8 == 0",
    ),
    (
        "linear",
        lambda: batchinv.linear(*_linear_case(8)[:2]),
        lambda: batchinv.linear(*(t.float() for t in _linear_case(8)[:2])),
        TypeError,
        "bf16 or fp16",
    ),
    (
        "log_softmax",
        lambda: batchinv.log_softmax(torch.randn(3, 4104).to(DTYPE)),
        lambda: batchinv.log_softmax(torch.randn(3, 4104).to(DTYPE), 0),
        ValueError,
        "dim",
    ),
    (
        "log_softmax",
        lambda: batchinv.log_softmax(torch.randn(3, 4104).to(DTYPE)),
        lambda: batchinv.log_softmax(torch.randn(3, 4104).to(DTYPE), -1, torch.int32),
        TypeError,
        "out_dtype",
    ),
]


@pytest.mark.parametrize("case", BAD_AFTER_GOOD, ids=[f"{c[0]}-{c[4]}" for c in BAD_AFTER_GOOD])
def test_a_bad_call_raises_after_good_lean_calls(
    case, attention_launches, linear_launches, log_softmax_launches
):
    _, good, bad, error, match = case
    with torch.no_grad():
        good()
        good()
        launched = len(attention_launches) + len(linear_launches) + len(log_softmax_launches)
        for _ in range(2):  # and again: a failing call leaves nothing behind
            with pytest.raises(error, match=match):
                bad()
        now = len(attention_launches) + len(linear_launches) + len(log_softmax_launches)
        assert now == launched  # nothing launched for a bad call
        good()


def test_the_op_tables_hold_signatures_not_tensors(attention_launches):
    from batchinv.ops import attention as attention_op

    with torch.no_grad():
        _attn()
        _varlen()
    _attn(return_lse=True)
    for table in (
        attention_op._PADDED_WITHOUT_LENGTHS,
        attention_op._PADDED_FULL,
        attention_op._VARLEN_NO_GRAD,
    ):
        assert len(table) == 1 and _holds_no_tensor(table._known)
        for run in table._known.values():
            closure = [c.cell_contents for c in (run.__closure__ or ())]
            assert not any(isinstance(c, torch.Tensor) for c in closure)


def test_a_non_tensor_argument_raises_the_ops_own_error_with_grad_enabled():
    cu = torch.tensor([0, 2])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        batchinv.attention_varlen([[0.0]], torch.randn(2, 1, 8), torch.randn(2, 1, 8), cu, cu)
