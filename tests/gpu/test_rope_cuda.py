"""The CUDA RoPE kernel: a token's rotation depends only on its vectors and its absolute
position (bitwise, in any batch, layout or schedule), within the contract's tolerance of the
fp32 reference, the backward is the inverse rotation, bad positions raise IndexError."""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.gpu import rope as gpu_rope
from batchinv.reference.rope import MAX_EXACT_POSITION, rope_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (2, 6, 64, 128)  # 2 and 6: half is not a multiple of a 16-byte vector
HEADS = ((4, 2), (1, 1)) if QUICK else ((4, 2), (32, 8), (1, 1))  # (query heads, kv heads)
BATCH_SIZES = (1, 3, 17) if QUICK else (1, 3, 17, 33, 257)
THETA = 1_000_000.0
MAX_POSITION = 40960


def _make_tokens(hq: int, hk: int, head_dim: int, dtype: torch.dtype, *, grads: bool = False):
    def make(n: int, gen: torch.Generator):
        q = torch.randn(n, hq, head_dim, generator=gen).to(dtype)
        k = torch.randn(n, hk, head_dim, generator=gen).to(dtype)
        positions = torch.randint(0, MAX_POSITION, (n,), generator=gen)
        if not grads:
            return q, k, positions
        gq = torch.randn(n, hq, head_dim, generator=gen).to(dtype)
        gk = torch.randn(n, hk, head_dim, generator=gen).to(dtype)
        return q, k, positions, gq, gk

    return make


def _rope(q, k, positions, **kwargs):
    return batchinv.rope(
        q.to(DEVICE),
        k.to(DEVICE),
        positions.to(DEVICE),
        theta=THETA,
        max_position=MAX_POSITION,
        **kwargs,
    )


def _rope_grads(q, k, positions, gq, gk):
    q, k = q.detach().to(DEVICE).requires_grad_(True), k.detach().to(DEVICE).requires_grad_(True)
    torch.autograd.backward(_rope(q, k, positions), [gq.to(DEVICE), gk.to(DEVICE)])
    return q.grad, k.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("hq", "hk"), HEADS)
def test_tokens_are_batch_invariant(hq, hk, head_dim, dtype):
    reports = row_invariance_sweep(
        lambda rows: _rope(*rows),
        _make_tokens(hq, hk, head_dim, dtype),
        batch_sizes=BATCH_SIZES,
        int_high=MAX_POSITION,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gradient_tokens_are_batch_invariant(head_dim, dtype):
    reports = row_invariance_sweep(
        lambda rows: _rope_grads(*rows),
        _make_tokens(4, 2, head_dim, dtype, grads=True),
        batch_sizes=BATCH_SIZES,
        int_high=MAX_POSITION,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunked_prefill_and_decode_give_the_same_bits(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    length = 67
    q = torch.randn(length, 8, 128, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(length, 2, 128, device=DEVICE, generator=gen).to(dtype)
    positions = torch.arange(length, device=DEVICE) + 1000
    full = _rope(q, k, positions)
    for chunk in (1, 7, 64):
        parts = [
            _rope(q[s : s + chunk], k[s : s + chunk], positions[s : s + chunk])
            for s in range(0, length, chunk)
        ]
        assert_bitwise_equal(torch.cat([p[0] for p in parts]), full[0])
        assert_bitwise_equal(torch.cat([p[1] for p in parts]), full[1])
    # [B, S, H, d] with [B, S] positions: the same tokens, another leading shape.
    batched = _rope(q.view(1, length, 8, 128), k.view(1, length, 2, 128), positions.view(1, length))
    assert_bitwise_equal(batched[0].view(length, 8, 128), full[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("max_position", (MAX_POSITION, MAX_EXACT_POSITION))
def test_forward_and_gradients_are_within_tolerance_of_fp32_reference(
    head_dim, dtype, max_position
):
    gen = torch.Generator().manual_seed(2)
    tokens = 300
    q = torch.randn(tokens, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, 2, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    positions[:3] = torch.tensor([0, max_position - 1, max_position // 2])
    gq = torch.randn(tokens, 4, head_dim, generator=gen).to(dtype)
    gk = torch.randn(tokens, 2, head_dim, generator=gen).to(dtype)
    qd, kd = q.detach().to(DEVICE).requires_grad_(True), k.detach().to(DEVICE).requires_grad_(True)
    q_rot, k_rot = batchinv.rope(
        qd, kd, positions.to(DEVICE), theta=THETA, max_position=max_position
    )
    torch.autograd.backward((q_rot, k_rot), [gq.to(DEVICE), gk.to(DEVICE)])
    rq, rk = (
        q.detach().float().clone().requires_grad_(True),
        k.detach().float().clone().requires_grad_(True),
    )
    ref_q, ref_k = rope_fp32(rq, rk, positions, theta=THETA, max_position=max_position)
    torch.autograd.backward((ref_q, ref_k), [gq.float(), gk.float()])
    for name, got, want, kind in (
        ("q_rot", q_rot, ref_q.detach(), "forward"),
        ("k_rot", k_rot, ref_k.detach(), "forward"),
        ("grad_q", qd.grad, rq.grad, "grad"),
        ("grad_k", kd.grad, rk.grad, "grad"),
    ):
        assert_within_tolerance(
            got.detach().cpu(), want, op_class="elementwise", kind=kind, name=name
        )


def _kernel_cos_sin(positions: torch.Tensor, head_dim: int):
    """The kernel's own fp32 cos/sin: rotating (1, ..., 1, 0, ..., 0) returns (cos, sin)
    exactly (1 * c - 0 * s = c and 0 * c + 1 * s = s)."""
    half = head_dim // 2
    unit = torch.zeros(positions.numel(), 1, head_dim, device=DEVICE)
    unit[..., :half] = 1.0
    rotated, _ = _rope(unit, unit, positions)
    return rotated[..., :half], rotated[..., half:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotation_and_its_backward_are_bitwise_the_formula(head_dim, dtype):
    # With the kernel's cos/sin, the forward is x1*c - x2*s, x2*c + x1*s and the backward the
    # exact transpose g1*c + g2*s, g2*c - g1*s, each an fp32 product/sum, rounded once.
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    half = head_dim // 2
    q = torch.randn(50, 4, head_dim, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(50, 2, head_dim, device=DEVICE, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (50,), device=DEVICE, generator=gen)
    cos, sin = _kernel_cos_sin(positions, head_dim)

    def rotate(x, sign):
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        if sign > 0:
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).to(dtype)

    q_rot, k_rot = _rope(q, k, positions)
    assert_bitwise_equal(q_rot, rotate(q, +1))
    assert_bitwise_equal(k_rot, rotate(k, +1))
    grad_q, grad_k = _rope_grads(q, k, positions, q_rot, k_rot)
    assert_bitwise_equal(grad_q, rotate(q_rot, -1))
    assert_bitwise_equal(grad_k, rotate(k_rot, -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int32_and_int64_positions_and_strided_views_give_the_same_bits(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    tokens, hq, hk, d = 33, 8, 2, 128
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=DEVICE, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)  # non-contiguous views of a fused projection
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=DEVICE, generator=gen)
    expected = _rope(q.contiguous(), k.contiguous(), positions)
    assert_bitwise_equal(list(_rope(q, k, positions)), list(expected))
    assert_bitwise_equal(list(_rope(q, k, positions.int())), list(expected))
    # An unaligned base address takes the element path: same bits.
    storage = torch.randn(tokens * hq * d + 8, device=DEVICE, generator=gen).to(dtype)
    shifted = storage[3 : 3 + tokens * hq * d].view(tokens, hq, d)
    assert_bitwise_equal(
        list(_rope(shifted, k, positions)), list(_rope(shifted.contiguous(), k, positions))
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (2, 6, 128))
def test_every_output_element_is_written(head_dim, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    q = torch.randn(9, 5, head_dim, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(9, 3, head_dim, device=DEVICE, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (9,), device=DEVICE, generator=gen)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(k, float("nan"))
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=DEVICE)
    inv_freq = gpu_rope.inv_freq_on(q.device, head_dim, THETA)
    gpu_rope.launch(
        gpu_rope.kernel_for("rope", f"rope_{gpu_rope._SUFFIX[dtype]}_i64", q.device),
        q.device,
        grid=(9,),
        block=(gpu_rope.THREADS,),
        args=(
            q_out,
            k_out,
            q,
            k,
            positions,
            inv_freq,
            first_bad,
            9,
            5,
            3,
            head_dim,
            5 * head_dim,
            head_dim,
            3 * head_dim,
            head_dim,
            MAX_POSITION,
            0,
        ),
        shared_mem=4 * head_dim,
    )
    assert not bool(q_out.isnan().any()) and not bool(k_out.isnan().any())
    assert int(first_bad.item()) == -1
    expected = _rope(q, k, positions)
    assert_bitwise_equal(q_out, expected[0])
    assert_bitwise_equal(k_out, expected[1])


@pytest.mark.parametrize("bad", (-1, MAX_POSITION, 2**40))
def test_bad_position_raises_and_the_context_survives(bad):
    q = torch.randn(64, 4, 64, device=DEVICE).bfloat16()
    k = torch.randn(64, 2, 64, device=DEVICE).bfloat16()
    positions = torch.arange(64, device=DEVICE)
    positions[37] = bad
    with pytest.raises(
        IndexError,
        match=rf"position_ids\[37\] = {bad} is outside the valid range \[0, {MAX_POSITION}\)",
    ):
        _rope(q, k, positions)
    positions[37] = 5
    _rope(q, k, positions)
    torch.cuda.synchronize()


def test_unchecked_call_returns_nan_tokens_for_bad_positions():
    q = torch.randn(8, 4, 64, device=DEVICE)
    k = torch.randn(8, 2, 64, device=DEVICE)
    positions = torch.arange(8, device=DEVICE)
    positions[2] = -3
    q_rot, k_rot = _rope(q, k, positions, check_positions=False)
    assert bool(q_rot[2].isnan().all()) and bool(k_rot[2].isnan().all())
    good = torch.tensor([0, 1, 3, 4, 5, 6, 7], device=DEVICE)
    expected = _rope(q[good], k[good], positions[good])
    assert_bitwise_equal(q_rot[good], expected[0])
    assert_bitwise_equal(k_rot[good], expected[1])


def test_first_bad_token_is_reported_when_several_are_bad():
    q = torch.randn(4096, 1, 8, device=DEVICE)
    positions = torch.zeros(4096, dtype=torch.int32, device=DEVICE)
    positions[3000] = -5
    positions[100] = MAX_POSITION
    with pytest.raises(IndexError, match=r"position_ids\[100\]"):
        _rope(q, q, positions)


def test_zero_tokens_and_inputs_not_mutated():
    empty = torch.empty(0, 4, 64, device=DEVICE)
    q_rot, k_rot = _rope(empty, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert q_rot.shape == (0, 4, 64) and k_rot.shape == (0, 4, 64)
    q = torch.randn(5, 4, 64, device=DEVICE).bfloat16()
    k = torch.randn(5, 2, 64, device=DEVICE).bfloat16()
    positions = torch.arange(5, device=DEVICE)
    before = [t.clone() for t in (q, k, positions)]
    q_rot, _ = _rope(q, k, positions)
    assert q_rot.data_ptr() != q.data_ptr()
    for t, b in zip((q, k, positions), before, strict=True):
        assert_bitwise_equal(t, b)


def test_bad_input_raises_errors_that_name_the_argument():
    q = torch.randn(5, 4, 64, device=DEVICE)
    positions = torch.arange(5, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        batchinv.rope(q[..., :63], q[..., :63], positions, theta=THETA)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        batchinv.rope(q, q, positions[:4], theta=THETA)
    with pytest.raises(TypeError, match="position_ids must have dtype"):
        batchinv.rope(q, q, positions.float(), theta=THETA)
    with pytest.raises(ValueError, match="position_ids is on cpu but q is on cuda"):
        batchinv.rope(q, q, positions.cpu(), theta=THETA)
    with pytest.raises(ValueError, match="theta must be a finite number > 0"):
        batchinv.rope(q, q, positions, theta=0.0)
    with pytest.raises(TypeError, match="k has dtype"):
        batchinv.rope(q, q.half(), positions, theta=THETA)
    with pytest.raises(ValueError, match=r"k.shape\[-1\] must equal head_dim"):
        batchinv.rope(q, q[..., :32], positions, theta=THETA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_path_gives_the_bits_of_the_autograd_path(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    q = torch.randn(33, 8, 128, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(33, 2, 128, device=DEVICE, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (33,), device=DEVICE, generator=gen)
    with torch.no_grad():
        expected = _rope(q, k, positions)
    got = _rope(q.detach().clone().requires_grad_(True), k, positions)
    assert_bitwise_equal([t.detach() for t in got], list(expected))
    unchecked = _rope(q, k, positions, check_positions=False)
    assert_bitwise_equal(list(unchecked), list(expected))
