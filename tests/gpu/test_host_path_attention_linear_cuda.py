"""The eager no-grad path of ``attention``, ``attention_varlen``, ``linear`` and
``log_softmax`` (launch plans kept per signature, one allocation, pointers as ints) gives the
bits of the general path (the GPU modules' general functions), eagerly and in a CUDA graph,
at decode shapes and at 17 / 64 query rows.  The host logic (keys, switches, errors) is
``tests/ops/test_host_path_cache.py``'s."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import attention_hopper
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import log_softmax as gpu_log_softmax

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE_ROWS = (1, 8, 17, 64)
CONTEXTS = (256, 4100)  # one split; three splits (the workspace gets its own allocation)
# (query rows, key rows) per packed sequence; a sequence without queries or keys included.
VARLEN_LENGTHS = [
    ([1] * 8, [256, 1, 4100, 17, 2048, 2049, 640, 77]),
    ([1, 0, 1, 1], [300, 0, 0, 4100]),
    ([17, 5, 64], [17, 300, 64]),
    ([64, 0, 17], [64, 5, 2100]),
]


def _randn(*shape, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)


def _padded(batch, sq, sk, dtype, seed=0):
    return (
        _randn(batch, sq, HEADS, HEAD_DIM, dtype=dtype, seed=seed),
        _randn(batch, sk, KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed + 1),
        _randn(batch, sk, KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed + 2),
    )


def _varlen(q_lens, k_lens, dtype, seed=0):
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = _randn(tq, HEADS, HEAD_DIM, dtype=dtype, seed=seed)
    k = _randn(tk, KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed + 1)
    v = _randn(tk, KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed + 2)
    return q, k, v, cu_q, cu_k  # host cu_seqlens: the lean path's


@pytest.fixture(params=["hopper tile", "mma tile"])
def tile_kernel(request, monkeypatch):
    """4-warp tile launches: the Hopper kernel where it applies (the lean path leaves those to
    the general path) or the mma.sync tile kernel (the lean path launches it)."""
    gpu_attention._LEAN.clear()
    if request.param == "mma tile":
        monkeypatch.setattr(attention_hopper, "applies", lambda q, k, v: False)
    yield request.param
    gpu_attention._LEAN.clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("rows", DECODE_ROWS)
@pytest.mark.parametrize("causal", [False, True])
def test_decode_attention_gives_the_general_path_bits(rows, context, dtype, causal):
    q, k, v = _padded(rows, 1, context, dtype, seed=rows)
    want = gpu_attention.attention(q, k, v, causal=causal)
    gpu_attention._LEAN.clear()
    with torch.no_grad():
        first = batchinv.attention(q, k, v, causal=causal)
        again = batchinv.attention(q, k, v, causal=causal)  # from the kept plan
    assert_bitwise_equal(first, want, name="first call")
    assert_bitwise_equal(again, want, name="kept plan")
    (kept,) = gpu_attention._LEAN.values()
    assert kept is not None and kept.plan.combine is not None  # the lean split launch ran
    # A strided q takes the general path: the same bits.
    wide = torch.empty(rows, 1, HEADS, HEAD_DIM + 64, device=DEVICE, dtype=dtype)
    strided = wide[..., :HEAD_DIM]
    strided.copy_(q)
    with torch.no_grad():
        assert_bitwise_equal(batchinv.attention(strided, k, v, causal=causal), want, name="strided")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "sq", "sk"), [(2, 17, 17), (1, 64, 64), (3, 17, 2100)])
def test_prefill_attention_gives_the_general_path_bits(tile_kernel, batch, sq, sk, dtype):
    q, k, v = _padded(batch, sq, sk, dtype, seed=sq)
    for causal in (False, True):
        want = gpu_attention.attention(q, k, v, causal=causal)
        with torch.no_grad():
            for call in ("first", "kept"):
                got = batchinv.attention(q, k, v, causal=causal)
                assert_bitwise_equal(got, want, name=f"{tile_kernel}, causal={causal}, {call}")
    if tile_kernel == "mma tile":
        assert None not in gpu_attention._LEAN.values()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_lens", "k_lens"), VARLEN_LENGTHS)
def test_varlen_attention_gives_the_general_path_bits(tile_kernel, q_lens, k_lens, dtype):
    q, k, v, cu_q, cu_k = _varlen(q_lens, k_lens, dtype, seed=len(q_lens))
    for causal in (False, True):
        want = gpu_attention.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
        with torch.no_grad():
            for call in ("first", "kept"):
                got = batchinv.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
                assert_bitwise_equal(got, want, name=f"{tile_kernel}, causal={causal}, {call}")
            # GPU lengths take the general path (one host sync): the same bits.
            on_gpu = (cu_q.to(DEVICE), cu_k.to(DEVICE))
            got = batchinv.attention_varlen(q, k, v, *on_gpu, causal=causal)
            assert_bitwise_equal(got, want, name=f"{tile_kernel}, causal={causal}, GPU lengths")


def _new_values(*inputs: torch.Tensor, seed: int = 100) -> None:
    for i, t in enumerate(inputs):
        gen = torch.Generator(device=DEVICE).manual_seed(seed + i)
        t.copy_(torch.randn(t.shape, device=DEVICE, generator=gen).to(t.dtype))


def _capture_on_the_warm_up_stream(call):
    """``(graph, output)``: ``call`` run once on a side stream, then captured on that stream,
    so that the capture launches the plans (and the per-sequence layouts, uploaded on that
    stream) which the warm-up kept, and uploads nothing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    kept = dict(gpu_attention._LEAN)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        output = call()
    assert gpu_attention._LEAN == kept  # the capture made no plan of its own
    return graph, output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 17, 64))
def test_attention_replays_in_a_cuda_graph(tile_kernel, rows, dtype):
    q, k, v = _padded(rows, 1, 300, dtype, seed=rows)
    pq, pk, pv = _padded(2, 17, 300, dtype, seed=rows + 7)
    # Packed prefill rows take the Hopper tile kernel on the general path, which uploads its
    # layout inside the capture: the lean path's case here is decode-like rows there.
    q_lens = [1, 0, 17] if tile_kernel == "mma tile" else [1, 0, 1]
    vq, vk, vv, cu_q, cu_k = _varlen(q_lens, [300, 5, 17], dtype, seed=rows)

    def step():
        return (
            batchinv.attention(q, k, v, causal=True),
            batchinv.attention(pq, pk, pv, causal=True),
            batchinv.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True),
        )

    with torch.no_grad():
        graph, captured = _capture_on_the_warm_up_stream(step)
        for replay in range(2):
            _new_values(q, k, v, pq, pk, pv, vq, vk, vv, seed=100 + 10 * replay)
            graph.replay()
            torch.cuda.synchronize()
            want = (
                gpu_attention.attention(q, k, v, causal=True),
                gpu_attention.attention(pq, pk, pv, causal=True),
                gpu_attention.attention_varlen(vq, vk, vv, cu_q, cu_k, causal=True),
            )
            names = ("decode", "prefill", "varlen")
            for name, got, expected in zip(names, captured, want, strict=True):
                assert_bitwise_equal(got, expected, name=f"{tile_kernel}, replay {replay}, {name}")


def test_a_plan_made_during_a_capture_replays_and_is_not_kept():
    q, k, v = _padded(8, 1, 300, torch.bfloat16, seed=5)
    gpu_attention._LEAN.clear()
    with torch.no_grad():
        graph, captured = capture_graph(lambda: batchinv.attention(q, k, v))
        assert len(gpu_attention._LEAN) == 1  # the warm-up's, on its own stream
        _new_values(q)
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(captured, gpu_attention.attention(q, k, v), name="replay")


# ----------------------------------------------------------------------------- linear


LINEAR_SHAPES = [(4096, 4096), (12288, 4096), (1024, 4096), (4096, 12288)]  # (out, in)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", DECODE_ROWS)
@pytest.mark.parametrize(("n", "k"), LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_the_general_path_bits(rows, n, k, dtype, bias):
    x = _randn(rows, k, dtype=dtype, seed=rows)
    w = _randn(n, k, dtype=dtype, seed=n) / 64
    b = _randn(n, dtype=dtype, seed=k) if bias else None
    want = gpu_linear.forward(x, w, b)
    gpu_linear._LEAN.clear()  # below: only this test's plans
    with torch.no_grad():
        for call in ("first", "kept"):
            assert_bitwise_equal(batchinv.linear(x, w, b), want, name=call)
        x3 = x.view(1, rows, k)  # a leading shape: the output keeps it
        assert_bitwise_equal(batchinv.linear(x3, w, b), want.view(1, rows, n), name="3-d")
        other = _randn(rows, k, dtype=dtype, seed=rows + 1)  # another address: another TMA map
        assert_bitwise_equal(batchinv.linear(other, w, b), gpu_linear.forward(other, w, b))
    assert None not in gpu_linear._LEAN.values()


@pytest.mark.parametrize("rows", (1, 17, 64))
def test_linear_replays_in_a_cuda_graph(rows):
    x = _randn(rows, 4096, dtype=torch.bfloat16, seed=1)
    w = _randn(4096, 4096, dtype=torch.bfloat16, seed=2) / 64
    with torch.no_grad():
        graph, captured = capture_graph(lambda: batchinv.linear(x, w))
        _new_values(x)
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(captured, gpu_linear.forward(x, w), name="replay")


def _general_backward(monkeypatch, *args):
    with monkeypatch.context() as patch:
        patch.setattr(gpu_linear, "_lean_backward", lambda *a: None)
        return gpu_linear.backward(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (64, 1024, 1000))
@pytest.mark.parametrize(("n", "k"), LINEAR_SHAPES)
def test_linear_backward_gives_the_general_path_bits(rows, n, k, dtype, monkeypatch):
    x = _randn(rows, k, dtype=dtype, seed=rows).requires_grad_(True)
    w = (_randn(n, k, dtype=dtype, seed=n) / 64).requires_grad_(True)
    grad = _randn(rows, n, dtype=dtype, seed=k)
    gpu_linear._LEAN_BACKWARD.clear()  # below: only this test's plans
    for needs in ((True, True, False), (True, False, False), (False, True, False)):
        want = _general_backward(monkeypatch, grad, x.detach(), w.detach(), None, needs)
        for call in ("first", "kept"):
            got = gpu_linear.backward(grad, x.detach(), w.detach(), None, needs)
            assert_bitwise_equal(
                [g for g in got if g is not None], [g for g in want if g is not None], name=call
            )
    out = batchinv.linear(x, w)  # through autograd: the kept launches
    got = torch.autograd.grad(out, (x, w), grad)
    want = _general_backward(monkeypatch, grad, x.detach(), w.detach(), None, (True, True, False))
    assert_bitwise_equal(list(got), list(want[:2]), name="autograd")
    # A plan for every call whose grad_x reads its operands in place (cuBLASLt's pinned
    # algorithm may serve grad_x at this size: then the general path runs, as above).
    route, _ = gpu_linear.grad_x_route(grad.reshape(-1, n), w.detach())
    planned = [p is not None for p in gpu_linear._LEAN_BACKWARD.values()]
    assert planned == [route == "in place", route == "in place", True]


def test_linear_backward_replays_in_a_cuda_graph(monkeypatch):
    x = _randn(256, 4096, dtype=torch.bfloat16, seed=1)
    w = _randn(4096, 4096, dtype=torch.bfloat16, seed=2) / 64
    grad = _randn(256, 4096, dtype=torch.bfloat16, seed=3)
    needs = (True, True, False)
    gpu_linear.backward(grad, x, w, None, needs)  # the plan, made outside the capture
    graph, captured = capture_graph(lambda: gpu_linear.backward(grad, x, w, None, needs)[:2])
    _new_values(grad)
    graph.replay()
    torch.cuda.synchronize()
    want = _general_backward(monkeypatch, grad, x, w, None, needs)
    assert_bitwise_equal(list(captured), list(want[:2]), name="replay")


# ----------------------------------------------------------------------------- log_softmax


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows", DECODE_ROWS)
@pytest.mark.parametrize("vocab", (151936, 32000, 4104))
def test_log_softmax_gives_the_general_path_bits(rows, vocab, dtype, out_dtype):
    x = 4 * _randn(rows, vocab, dtype=dtype, seed=rows)
    want = gpu_log_softmax.forward(x, out_dtype, need_lse=False)[0]
    with torch.no_grad():
        for call in ("first", "kept"):
            assert_bitwise_equal(batchinv.log_softmax(x, -1, out_dtype), want, name=call)
        x3 = x.view(1, rows, vocab)
        got = batchinv.log_softmax(x3, -1, out_dtype)
        assert_bitwise_equal(got, want.view(1, rows, vocab), name="3-d")


@pytest.mark.parametrize("rows", (1, 17, 64))
def test_log_softmax_replays_in_a_cuda_graph(rows):
    x = _randn(rows, 151936, dtype=torch.bfloat16, seed=3)
    with torch.no_grad():
        graph, captured = capture_graph(lambda: batchinv.log_softmax(x))
        _new_values(x)
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(captured, gpu_log_softmax.forward(x, need_lse=False)[0], name="replay")
