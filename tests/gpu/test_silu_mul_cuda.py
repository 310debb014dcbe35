"""The CUDA SiLU-mul kernels: elementwise, so every row is bitwise the same in any batch and on
any load path; within the contract's tolerance of the fp32 reference; fused layout equal to
the two-tensor form bit for bit; every output element written; clear errors."""

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
from batchinv.gpu import silu_mul as gpu_silu_mul
from batchinv.reference.silu_mul import silu_mul_fp32, silu_mul_fused_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WIDTHS = (1, 3, 111, 4097) if QUICK else (1, 3, 111, 4096, 4097, 12288)
BATCH_SIZES = (1, 3, 17) if QUICK else (1, 3, 17, 33, 257)


def _make(count: int, width: int, dtype: torch.dtype):
    def make(n: int, gen: torch.Generator):
        parts = tuple((3.0 * torch.randn(n, width, generator=gen)).to(dtype) for _ in range(count))
        return parts if count > 1 else parts[0]

    return make


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().to(DEVICE).requires_grad_(True) for t in inputs]
    fn(*leaves).backward(grad_out.to(DEVICE))
    return tuple(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rows_are_batch_invariant(width, dtype):
    reports = row_invariance_sweep(
        lambda rows: batchinv.silu_mul(rows[0].to(DEVICE), rows[1].to(DEVICE)),
        _make(2, width, dtype),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_rows_are_batch_invariant(width, dtype):
    reports = row_invariance_sweep(
        lambda gate_up: batchinv.silu_mul_fused(gate_up.to(DEVICE)),
        _make(1, 2 * width, dtype),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_gradient_rows_are_batch_invariant(width, dtype):
    def both(rows):
        gate, up, grad = rows
        fused = torch.cat((gate, up), dim=-1)
        return (
            *_grads(batchinv.silu_mul, (gate, up), grad),
            *_grads(batchinv.silu_mul_fused, (fused,), grad),
        )

    reports = row_invariance_sweep(both, _make(3, width, dtype), batch_sizes=BATCH_SIZES)
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_forward_and_gradients_are_within_tolerance_of_fp32_reference(width, dtype):
    gen = torch.Generator().manual_seed(1)
    # Unit-scale inputs: the regime the contract's table is calibrated in.  The fp32 gradient
    # cancels in 1 + g * (1 - s) near g = -1.28, so its absolute error grows with |grad * up|,
    # and the GPU's expf differs from the CPU's by an ulp there (measured on an H200 with
    # inputs scaled by 3: 6.0e-7 against an allowed 5.2e-7 at one element in 110592).
    gate, up, grad = (torch.randn(3, 9, width, generator=gen) for _ in range(3))
    gate, up, grad = gate.to(dtype), up.to(dtype), grad.to(dtype)
    out = batchinv.silu_mul(gate.to(DEVICE), up.to(DEVICE))
    grad_gate, grad_up = _grads(batchinv.silu_mul, (gate, up), grad)
    ref_gate, ref_up = (
        gate.detach().float().clone().requires_grad_(True),
        up.detach().float().clone().requires_grad_(True),
    )
    ref = silu_mul_fp32(ref_gate, ref_up)
    ref.backward(grad.float())
    assert_within_tolerance(out.cpu(), ref.detach(), op_class="elementwise", name="out")
    assert_within_tolerance(
        grad_gate.cpu(), ref_gate.grad, op_class="elementwise", kind="grad", name="grad_gate"
    )
    assert_within_tolerance(
        grad_up.cpu(), ref_up.grad, op_class="elementwise", kind="grad", name="grad_up"
    )
    fused = torch.cat((gate, up), dim=-1)
    assert_within_tolerance(
        batchinv.silu_mul_fused(fused.to(DEVICE)).cpu(),
        silu_mul_fused_fp32(fused),
        op_class="elementwise",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", (1, 8, 111, 4096))
def test_fused_layout_equals_the_two_tensor_form_bitwise(width, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    gate_up = (3.0 * torch.randn(17, 2 * width, device=DEVICE, generator=gen)).to(dtype)
    gate, up = gate_up[:, :width].contiguous(), gate_up[:, width:].contiguous()
    assert_bitwise_equal(batchinv.silu_mul_fused(gate_up), batchinv.silu_mul(gate, up))
    grad = torch.randn(17, width, device=DEVICE, generator=gen).to(dtype)
    (grad_fused,) = _grads(batchinv.silu_mul_fused, (gate_up,), grad)
    grad_gate, grad_up = _grads(batchinv.silu_mul, (gate, up), grad)
    assert_bitwise_equal(grad_fused, torch.cat((grad_gate, grad_up), dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", (8, 64, 12288))
@pytest.mark.parametrize("offset", (1, 3, 8))
def test_misaligned_and_strided_inputs_give_the_same_bits(width, dtype, offset):
    rows = 9
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    storage = (3.0 * torch.randn(2 * rows * (width + 8) + 16, device=DEVICE, generator=gen)).to(
        dtype
    )
    gate = storage[offset : offset + rows * width].view(rows, width)
    up = (
        storage[rows * (width + 8) :]
        .narrow(0, 0, rows * (width + 8))
        .view(rows, width + 8)[:, :width]
    )
    expected = batchinv.silu_mul(gate.contiguous(), up.contiguous())
    assert_bitwise_equal(batchinv.silu_mul(gate, up), expected)
    grad = torch.randn(rows, width, device=DEVICE, generator=gen).to(dtype)
    got = _grads(batchinv.silu_mul, (gate, up), grad)
    want = _grads(batchinv.silu_mul, (gate.contiguous(), up.contiguous()), grad)
    assert_bitwise_equal(list(got), list(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_elements_bits_do_not_depend_on_its_chunks_other_gate_values(dtype):
    # The backward's vector path divides without nvcc's operand check when every gate value of
    # a 16-byte chunk has 2^-60 <= |g| <= 40, and with __fdiv_rn otherwise, so an element's
    # instructions depend on its neighbours (the forward runs one sequence for every element; it
    # is checked here too).  Gate values at and near the range's ends, plus random ones; the same
    # rows again with every 4th gate set to 0 (each chunk, 4 or 8 elements, then takes the
    # general path), and as misaligned views (the element path, __fdiv_rn throughout): every
    # other element has the same bits in all three, forward and both gradients.
    rows, width = 4, 4096
    gen = torch.Generator().manual_seed(12)
    gate = (3.0 * torch.randn(rows, width, generator=gen)).clamp(-39.0, 39.0)
    ends = torch.tensor([2.0**-60, 2.0**-59, 2.0**-61, 40.0, 39.9, 40.1, 1e-18, 1e-17])
    for r in range(rows):
        picks = torch.randint(0, width, (256,), generator=gen)
        signs = torch.where(torch.rand(256, generator=gen) < 0.5, -1.0, 1.0)
        gate[r, picks] = ends[torch.randint(0, len(ends), (256,), generator=gen)] * signs
    up = torch.randn(rows, width, generator=gen)
    grad = torch.randn(rows, width, generator=gen)
    gate, up, grad = (t.to(dtype).to(DEVICE) for t in (gate, up, grad))
    poisoned = gate.clone()
    poisoned[:, ::4] = 0.0
    storage = torch.empty(3 * rows * width + 3, dtype=dtype, device=DEVICE)
    shifted = [
        storage[1 + i * (rows * width + 1) :][: rows * width].view(rows, width) for i in range(3)
    ]
    for view, t in zip(shifted, (gate, up, grad), strict=True):
        view.copy_(t)
    keep = torch.ones(width, dtype=torch.bool, device=DEVICE)
    keep[::4] = False

    def results(g, u, dy):
        return (batchinv.silu_mul(g, u), *_grads(batchinv.silu_mul, (g, u), dy))

    fast = results(gate, up, grad)
    general = results(poisoned, up, grad)
    element = results(shifted[0], shifted[1], shifted[2])
    for a, b, c in zip(fast, general, element, strict=True):
        assert_bitwise_equal(a[:, keep], b[:, keep])
        assert_bitwise_equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", (5, 2048, 8192, 8200, 12288, 20000))
def test_every_output_element_is_written(width, dtype):
    # Outputs pre-filled with NaN and the kernels launched directly, over tilings with one and
    # several tiles per row (tiles of up to 2048 elements) on both load paths.
    rows = 5
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    gate, up, grad = (
        torch.randn(rows, width, device=DEVICE, generator=gen).to(dtype) for _ in range(3)
    )
    out = torch.full((rows, width), float("nan"), dtype=dtype, device=DEVICE)
    gpu_silu_mul._forward_rows(out, gate, up, rows, width)
    assert not bool(out.isnan().any())
    assert_bitwise_equal(out, batchinv.silu_mul(gate, up))
    grad_gate, grad_up = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
    gpu_silu_mul._backward_rows(grad_gate, grad_up, grad, gate, up, rows, width)
    assert not bool(grad_gate.isnan().any()) and not bool(grad_up.isnan().any())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_to_the_storage_type_matches_torch_on_both_load_paths(dtype):
    # For gate >= 20, exp(-gate) < 2^-25, so 1 + e rounds to 1 and silu(gate) is gate exactly:
    # the output is gate * up (exact in fp32 for bf16/fp16 inputs) rounded once to the dtype,
    # which torch's CPU conversion gives independently.  up spans subnormal to huge values so
    # that the rounding meets ties, overflow to inf, subnormal results and NaN/inf inputs; the
    # aligned tensors take the 16-byte vector path, the shifted views the element path.
    rows, width = 6, 4096
    gen = torch.Generator().manual_seed(11)
    gate = torch.empty(rows, width).uniform_(20.0, 300.0, generator=gen)
    exponents = torch.randint(-140, 125, (rows, width), generator=gen).float()
    up = torch.randn(rows, width, generator=gen) * torch.exp2(exponents)
    up[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 0.0])
    gate[1, :2] = torch.tensor([float("nan"), float("inf")])
    gate, up = gate.to(dtype), up.to(dtype)
    want = (gate.float() * up.float()).to(dtype)
    vector = batchinv.silu_mul(gate.to(DEVICE), up.to(DEVICE)).cpu()
    storage = torch.empty(2 * rows * width + 2, dtype=dtype, device=DEVICE)
    gate_shifted = storage[1 : 1 + rows * width].view(rows, width)
    up_shifted = storage[rows * width + 2 :].view(rows, width)
    gate_shifted.copy_(gate.to(DEVICE))
    up_shifted.copy_(up.to(DEVICE))
    element = batchinv.silu_mul(gate_shifted, up_shifted).cpu()
    assert_bitwise_equal(vector, element)
    # NaN where torch has NaN (payloads differ between CPU and GPU), torch's bits elsewhere.
    assert_bitwise_equal(vector.isnan(), want.isnan())
    finite = ~want.isnan()
    assert_bitwise_equal(vector[finite], want[finite])


def _on_both_paths(fn, *tensors):
    """``fn`` on 16-byte-aligned copies (the vector path) and on copies that start one element
    into their storage (the element path); both results."""
    aligned = [t.to(DEVICE).contiguous() for t in tensors]
    shifted = []
    for t in aligned:
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)
        view = storage[1:].view(t.shape)
        view.copy_(t)
        shifted.append(view)
    return fn(*aligned), fn(*shifted)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_follow_the_reference(dtype):
    # -inf -> NaN, inf -> inf, +-0 -> +-0, 1e-40 (subnormal in fp32) -> g / 2, gate >= 100 ->
    # gate * up, gate <= -100 (1 + exp(-g) = inf) -> -0: exact, on both paths.
    gate = torch.tensor(
        [[float("-inf"), float("inf"), 0.0, -0.0, 100.0, -100.0, 1e-40, float("nan")]]
    ).to(dtype)
    up = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]).to(dtype)
    vector, element = _on_both_paths(batchinv.silu_mul, gate, up)
    assert_bitwise_equal(vector, element)
    want = silu_mul_fp32(gate.float(), up.float()).to(dtype)
    assert_bitwise_equal(vector.cpu().isnan(), want.isnan())
    finite = ~want.isnan()
    assert_bitwise_equal(vector.cpu()[finite], want[finite])


def test_silu_is_not_flushed_where_one_plus_exp_exceeds_2_pow_126():
    # For -88.7 < g < -87.3, 1 + exp(-g) lies in (2^126, 2^128): its reciprocal is subnormal, so
    # the forward's flush-to-zero reciprocal, taken of 1 + exp(-g) itself, would give silu = -0
    # where the value is about -1e-36 (normal); the kernel takes it of (1 + exp(-g)) / 4.
    gate = torch.linspace(-88.7, -87.4, 64).view(8, 8)
    vector, element = _on_both_paths(batchinv.silu_mul, gate, torch.ones_like(gate))
    assert_bitwise_equal(vector, element)
    want = silu_mul_fp32(gate, torch.ones_like(gate))
    assert bool((want < 0).all())
    assert bool((vector < 0).all()), vector
    assert_within_tolerance(vector.cpu(), want, op_class="elementwise")


def _every_gate_value(dtype: torch.dtype) -> torch.Tensor:
    """Every bf16/fp16 bit pattern, or 2^22 fp32 ones (one random pattern in each run of 1024
    consecutive patterns), without NaN and -inf (those give NaN: the special-value test)."""
    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(13)
        low = torch.randint(0, 1024, (2**22,), generator=gen, dtype=torch.int64)
        bits = torch.arange(2**22, dtype=torch.int64) * 1024 + low
        bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # the patterns as int32
        gate = bits.to(torch.int32).view(torch.float32)
    else:
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        gate = bits.view(dtype)
    keep = ~gate.isnan() & (gate != float("-inf"))
    return gate[keep]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_gate_value_is_within_tolerance_and_equal_on_both_paths(dtype):
    # The forward's exp and reciprocal are the GPU's approximations (kernels_cu/silu_mul.cu):
    # over the whole range of the dtype (every bf16/fp16 gate, 2^22 fp32 gates spread over all
    # exponents and signs) with up = 1, so the output is silu(g) itself, the result stays within
    # the contract's tolerance of the fp32 reference, and the vector and element paths agree
    # bit for bit.
    values = _every_gate_value(dtype)
    gate = torch.zeros(-(-values.numel() // 1024) * 1024, dtype=dtype)
    gate[: values.numel()] = values
    gate = gate.view(-1, 1024)
    up = torch.ones_like(gate)
    vector, element = _on_both_paths(batchinv.silu_mul, gate, up)
    assert_bitwise_equal(vector, element)
    assert_within_tolerance(
        vector.cpu(), silu_mul_fp32(gate.float(), up.float()), op_class="elementwise"
    )


def test_nan_rows_do_not_leak_into_their_neighbours():
    gate = torch.randn(5, 4096, device=DEVICE).bfloat16()
    up = torch.randn(5, 4096, device=DEVICE).bfloat16()
    alone = batchinv.silu_mul(gate[2:3], up[2:3])
    gate[1] = float("nan")
    up[3] = float("inf")
    assert_bitwise_equal(batchinv.silu_mul(gate, up)[2:3], alone)


def test_zero_rows_and_inputs_not_mutated():
    empty = torch.empty(0, 4, 16, device=DEVICE)
    assert batchinv.silu_mul(empty, empty).shape == (0, 4, 16)
    assert batchinv.silu_mul_fused(empty).shape == (0, 4, 8)
    gate_up = torch.randn(3, 22, device=DEVICE).bfloat16()
    before = gate_up.clone()
    batchinv.silu_mul_fused(gate_up)
    batchinv.silu_mul(gate_up[:, :11], gate_up[:, 11:])
    assert_bitwise_equal(gate_up, before)


def test_bad_input_raises_errors_that_name_the_argument():
    gate = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="up must have the shape of gate"):
        batchinv.silu_mul(gate, gate[:, :4])
    with pytest.raises(TypeError, match="up has dtype"):
        batchinv.silu_mul(gate, gate.half())
    with pytest.raises(ValueError, match="up is on cpu but gate is on cuda"):
        batchinv.silu_mul(gate, gate.cpu())
    with pytest.raises(ValueError, match="gate_up must have an even"):
        batchinv.silu_mul_fused(gate[:, :7])
    with pytest.raises(TypeError, match="gate must have dtype"):
        batchinv.silu_mul(gate.double(), gate.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_path_gives_the_bits_of_the_autograd_path(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    gate_up = (3.0 * torch.randn(17, 2 * 4096, device=DEVICE, generator=gen)).to(dtype)
    gate, up = gate_up[:, :4096], gate_up[:, 4096:]
    with torch.no_grad():
        plain, fused = batchinv.silu_mul(gate, up), batchinv.silu_mul_fused(gate_up)
    leaf = gate_up.detach().clone().requires_grad_(True)
    assert_bitwise_equal(batchinv.silu_mul_fused(leaf).detach(), fused)
    assert_bitwise_equal(batchinv.silu_mul(leaf[:, :4096], leaf[:, 4096:]).detach(), plain)
