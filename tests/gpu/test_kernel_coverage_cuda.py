"""Every kernel variant added for attention (the Hopper tile and cooperative decode kernels
included), token logprobs, the cluster log-softmax and its one-CTA 2048-wide backward, the
small-M (single and grouped), in-place backward and K-group linear kernels, the fused RMSNorm
backward and the reworked RoPE and SiLU-mul bodies, run once on small odd shapes (NaN in the
padding where there is padding), and checked for finite results and exact zeros where nothing
may be written. The value and invariance checks live in each op's own test file; this file is
the short target that `nox -s sanitize` runs under compute-sanitizer (memcheck is ~50x slower
than a plain run, so the full op files would take too long)."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.gpu import attention as gpu_attention
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import log_softmax as gpu_log_softmax
from batchinv.gpu import rms_norm as gpu_rms_norm
from batchinv.kv_cache import KVCache

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16)


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize(
    "mode, warps, options",
    (
        ("tile", 4, {}),  # the Hopper tile kernel at d = 64 and 128 on sm_90a
        ("tile", 4, {"hopper": False}),  # the mma.sync tile kernel
        ("tile", 1, {}),
        ("split", 1, {"coop": False}),  # the one-warp split kernel
        ("split", 1, {"coop": True, "stages": 1}),  # the cooperative decode kernel
        ("split", 1, {"coop": True, "stages": 2}),
        ("split", 1, {"coop": True, "stages": 3}),
        ("split", 4, {}),
    ),
    ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()) if isinstance(p, dict) else str(p),
)
def test_attention_forward_variants(dtype, d, mode, warps, options):
    # more than one split (SPLIT_KEYS = 2048), lengths not multiples of 64
    sq, sk = 70, gpu_attention.SPLIT_KEYS + 76
    q = _randn(2, sq, 4, d, dtype=dtype, seed=1)
    k = _randn(2, sk, 2, d, dtype=dtype, seed=2)
    v = _randn(2, sk, 2, d, dtype=dtype, seed=3)
    seqlens_q = torch.tensor([sq, 5], device=DEVICE)
    seqlens_k = torch.tensor([sk, 700], device=DEVICE)
    k[1, 700:] = float("nan")
    v[1, 700:] = float("nan")
    out, lse = gpu_attention.attention(
        q,
        k,
        v,
        causal=True,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        return_lse=True,
        mode=mode,
        warps=warps,
        **options,
    )
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :5]).all()
    assert (out[1, 5:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
def test_attention_decode_with_an_empty_context(dtype, d):
    # Decode (the cooperative split kernel and the combine kernel) where one sequence has no
    # key: the combine writes +0 / -inf there (out is not pre-filled on this path).
    lens = [0, 1100, 2049]
    q = _randn(3, 1, 4, d, dtype=dtype, seed=5)
    k = _randn(3, 2049, 2, d, dtype=dtype, seed=6)
    v = _randn(3, 2049, 2, d, dtype=dtype, seed=7)
    k[1, 1100:] = float("nan")
    v[1, 1100:] = float("nan")
    out, lse = gpu_attention.attention(
        q, k, v, causal=True, seqlens_k=torch.tensor(lens, device=DEVICE), return_lse=True
    )
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
def test_attention_decode_from_cache_and_backward(dtype, d):
    cache = KVCache(3, 1200, 2, d, dtype=dtype, device=DEVICE)
    prefix = _randn(3, 1100, 2, d, dtype=dtype, seed=4)
    cache.append(prefix, prefix.flip(1))
    for step in range(2):  # decode: one token per sequence
        q = _randn(3, 1, 4, d, dtype=dtype, seed=10 + step)
        kv = _randn(3, 1, 2, d, dtype=dtype, seed=20 + step)
        out = batchinv.attention_with_kv_cache(q, kv, kv, cache)
        assert torch.isfinite(out).all()
    q, k, v = (
        _randn(1, 130, heads, d, dtype=dtype, seed=seed).requires_grad_(True)
        for heads, seed in ((4, 30), (2, 31), (2, 32))
    )
    batchinv.attention(q, k, v, causal=True).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_forward_and_backward(dtype):
    hidden = _randn(37, 256, dtype=dtype, seed=5).requires_grad_(True)
    weight = (_randn(5000, 256, dtype=dtype, seed=6) / 16).requires_grad_(True)
    targets = torch.randint(0, 5000, (37,), device=DEVICE)
    targets[3] = -100
    logprobs, entropy = batchinv.token_logprobs(hidden, weight, targets, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    assert logprobs[3] == 0


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))  # 8- and 16-CTA clusters
@pytest.mark.parametrize("backward", (False, True))
def test_log_softmax_cluster_form(dtype, backward):
    x = _randn(3, 151936, dtype=dtype, seed=7).requires_grad_(backward)
    threads = gpu_log_softmax.threads_for(151936, dtype, torch.float32)
    out = batchinv.log_softmax(x)
    assert torch.isfinite(out).all() and threads > 0
    if backward:
        out.sum().backward()
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("offset", (0, 1))  # 16-byte vector path, element path
def test_log_softmax_wide_backward_one_cta_form(dtype, offset, monkeypatch):
    # T = 2048 played by one CTA of 1024 threads (what cards without clusters, and misaligned
    # rows, run for the backward with fp32 dy; fp32 rows are forced to T = 2048), into a
    # NaN-poisoned gradient.
    monkeypatch.setattr(gpu_log_softmax, "USE_CLUSTER", False)
    monkeypatch.setitem(gpu_log_softmax.LONG_ROW_THREADS, ("backward", dtype, torch.float32), 2048)
    rows, vocab = 3, 151936
    storage = _randn(rows * vocab + 8, dtype=dtype, seed=20)
    x = storage[offset : offset + rows * vocab].view(rows, vocab)
    assert gpu_log_softmax.backward_path(x) == "one-cta T2048"
    _, lse = gpu_log_softmax.forward(x)
    grad_x = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
    grad = _randn(rows, vocab, dtype=torch.float32, seed=21)
    gpu_log_softmax._backward_into(grad_x, grad, x, lse)
    assert torch.isfinite(grad_x).all()


def _hopper() -> bool:
    return gpu_linear.uses_hopper(torch.device(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", (1, 9, 17))
def test_linear_small_m_variants(dtype, m):
    if not _hopper():
        pytest.skip("the small-M kernels are sm_90a only")
    x = _randn(m, 200, dtype=dtype, seed=8)  # K not a multiple of the 64-wide box
    weight = _randn(40, 200, dtype=dtype, seed=9)  # N not a multiple of a CTA's rows
    bias = _randn(40, dtype=dtype, seed=10)
    for config in gpu_linear.small_m_configs():
        out = gpu_linear.matmul_nt(x, weight, bias, family="small_m", config=config)
        assert out.shape == (m, 40) and torch.isfinite(out).all(), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", (1, 9))
def test_linear_small_m_grouped_variants(dtype, m):
    if not _hopper():
        pytest.skip("the grouped small-M kernels are sm_90a only")
    x = _randn(m, 200, dtype=dtype, seed=16)  # K not a multiple of the 64-wide box
    weights = [_randn(n, 200, dtype=dtype, seed=17 + n) for n in (40, 24, 8)]  # partial bands
    biases = [_randn(40, dtype=dtype, seed=20), None, _randn(8, dtype=dtype, seed=21)]
    for config in gpu_linear.small_m_grouped_configs():
        out = gpu_linear.matmul_grouped(x, weights, biases, config=config)
        assert out.shape == (m, 72) and torch.isfinite(out).all(), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", (3, 70))
def test_linear_in_place_backward_variants(dtype, tokens):
    if not _hopper():
        pytest.skip("the in-place backward kernels are sm_90a only")
    grad = _randn(tokens, 40, dtype=dtype, seed=13)  # 40 out_features: a partial tile
    x = _randn(tokens, 200, dtype=dtype, seed=14)  # tokens below one 64-token box
    weight = _randn(40, 200, dtype=dtype, seed=15)
    for config in gpu_linear.transposed_configs():
        if config.layout == "tb":  # grad_x = dY · W
            out, shape = gpu_linear.matmul_nn(grad, weight, config=config), (tokens, 200)
        else:  # grad_W = dYᵀ · X
            out, shape = gpu_linear.matmul_tn(grad, x, config=config), (40, 200)
        assert out.shape == shape and torch.isfinite(out).all(), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", (3, 70))
def test_linear_k_group_kernels(dtype, m):
    if not _hopper():
        pytest.skip("the K-group kernels are sm_90a only")
    x = _randn(m, 200, dtype=dtype, seed=11)  # 4 groups of 64 columns used, the last partial
    weight = _randn(300, 200, dtype=dtype, seed=12)  # 300 rows: a partial tile
    bias = _randn(300, dtype=dtype, seed=13)
    for family in ("small_m", "hopper"):
        partials = gpu_linear.k_group_partials(x, weight, 64, 8, family=family)
        assert torch.isfinite(partials[:4]).all(), family
        assert (partials[4:] == 0).all() and not partials[4:].signbit().any(), family
    for count in (1, 2, 4, 8):
        node = gpu_linear.k_group_tree(partials[:count].contiguous())
        assert node.shape == (m, 300) and torch.isfinite(node).all(), count
        out = gpu_linear.k_group_tree(partials[:count].contiguous(), bias, dtype)
        assert out.dtype == dtype and torch.isfinite(out).all(), count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d", ((8192, 128), (4096, 4096), (300, 5000), (70, 999)))
def test_rms_norm_fused_and_two_pass_backward(dtype, rows, d):
    x = _randn(rows, d, dtype=dtype, seed=13).requires_grad_(True)
    residual = _randn(rows, d, dtype=dtype, seed=14).requires_grad_(True)
    weight = (1 + _randn(d, dtype=torch.float32, seed=15) / 4).to(dtype).requires_grad_(True)
    y, new_residual = batchinv.fused_add_rms_norm(x, residual, weight, 1e-6)
    (y.float().sum() + new_residual.float().sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (x, residual, weight))


@pytest.mark.parametrize(
    "dtype, d, rows",
    ((torch.bfloat16, 1032, 16384), (torch.float32, 1032, 16384), (torch.bfloat16, 4104, 8192)),
)
def test_rms_norm_two_group_backward(dtype, d, rows):
    # From 16384 rows the hidden-1024..4096 (bf16) / 512..2048 (fp32) backward runs the
    # two-row-group kernel t128k4g2 (d = 1032 keeps it small under the sanitizer), and from 8192
    # rows the hidden-4096..5120 one t128k5g2 (d = 4104, its smallest bf16 rows).
    assert gpu_rms_norm.fused_backward_plan(d, dtype, rows)[3] == gpu_rms_norm.TWO_GROUPS_SHAPE
    # From 16384 rows the last-levels grid takes each run as it is stored (sm_90a): the sanitizer
    # sees the counts and the waits.
    assert gpu_rms_norm.overlap_rule(d, dtype, rows) == (rows >= 16384)
    x = _randn(rows, d, dtype=dtype, seed=16).requires_grad_(True)
    weight = (1 + _randn(d, dtype=torch.float32, seed=17) / 4).to(dtype).requires_grad_(True)
    batchinv.rms_norm(x, weight, 1e-6).float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (x, weight))


def test_rms_norm_backward_shapes_cover_both_paths():
    """The shapes above reach the fused kernel (>= 256 CTAs of 16-32 rows) and the two-pass
    fallback (70 rows); so the sanitizer sees both."""
    assert gpu_rms_norm.fused_backward_fits(128, torch.bfloat16)
    assert gpu_rms_norm.fused_backward_fits(4096, torch.float16)
    assert gpu_rms_norm.FUSED_WEIGHT_GRAD_MIN_BLOCKS > 70


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", (0, 1))  # 16-byte vector path, element path
def test_rope_and_silu_mul_load_paths(dtype, offset):
    tokens, d = 37, 128
    storage = _randn(tokens * 6 * d + 8, dtype=dtype, seed=16)
    q = storage[offset : offset + tokens * 4 * d].view(tokens, 4, d).requires_grad_(True)
    k = _randn(tokens, 2, d, dtype=dtype, seed=17).requires_grad_(True)
    positions = torch.arange(tokens, device=DEVICE) * 7
    q_rot, k_rot = batchinv.rope(q, k, positions, theta=1e6)
    (q_rot.float().sum() + k_rot.float().sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    gate = storage[offset : offset + tokens * 300].view(tokens, 300).detach().requires_grad_(True)
    up = _randn(tokens, 300, dtype=dtype, seed=18).requires_grad_(True)
    out = batchinv.silu_mul(gate, up)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(gate.grad).all()


@pytest.mark.parametrize("vocab", (32000, 151937))
def test_log_softmax_one_cta_and_cluster_forms(vocab):
    x = _randn(3, vocab, dtype=torch.bfloat16, seed=19).requires_grad_(True)
    out = batchinv.log_softmax(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
