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
from batchinv import registry
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import attention_hopper, linear_cublaslt
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import log_softmax as gpu_log_softmax

DTYPE = torch.bfloat16


class FakeKernel:
    """A kernel that records each launch with its pointers as ints (the general path passes
    tensors, the lean path their addresses)."""

    def __init__(self, name: str, launches: list):
        self.name = name
        self._launches = launches

    def __call__(
        self, grid, block, args, shared_mem=0, stream=None, device=None, programmatic=False
    ):
        args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        record = (self.name, tuple(grid), tuple(block), args, shared_mem, stream, programmatic)
        self._launches.append(record)

    def attributes(self, device_index):
        return {"max_dynamic_shared_bytes": 1 << 20, "static_shared_bytes": 0}

    def set_max_dynamic_shared_memory(self, nbytes, device=None):
        pass


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


def _without_outputs(record):
    """A launch with the output, lse and workspace pointers left out (fresh per call) and the
    per-sequence layout pointers (a varlen general call uploads its layout afresh)."""
    name, grid, block, args, shared, stream, programmatic = record
    if name.startswith("attn_combine"):
        kept = args[6:]
    else:
        maps = 2 if name.endswith("_tma") else 0
        kept = args[: maps + 3] + args[maps + 10 :]
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
    for cached in (gpu_linear._auto_choice, gpu_linear._gemm_kernel, gpu_linear._tensor_map):
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
