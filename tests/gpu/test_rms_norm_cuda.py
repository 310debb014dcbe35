"""The CUDA RMSNorm kernels: rows bitwise invariant to the batch (forward and input
gradients), within the contract's tolerance of the strict fp32 reference, a weight gradient
that is bitwise the same run to run, every output element written, and clear errors."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

import batchinv
from batchinv.contract import (
    assert_bitwise_equal,
    assert_no_drift,
    assert_within_tolerance,
    row_invariance_sweep,
)
from batchinv.gpu import rms_norm as gpu_rms_norm
from batchinv.reference.rms_norm import fused_add_rms_norm_fp32, rms_norm_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"  # the sanitizer runs a smaller sweep
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HIDDENS = (1, 3, 111, 4097) if QUICK else (1, 3, 111, 4096, 4097, 5120)
HEAD_DIMS = (64, 128)
HEADS = 8
BATCH_SIZES = (1, 3, 17) if QUICK else (1, 3, 17, 33, 257)
# Rows too long for registers take the streaming kernel (bf16 > 32768, fp32 > 16384).
STREAMING_CASES = ((torch.bfloat16, 40000), (torch.float32, 20000))
EPS = 1e-6


def _weight(hidden: int, dtype: torch.dtype, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)


def _rows(shape, dtype):
    def make(n: int, gen: torch.Generator) -> torch.Tensor:
        return (2.0 * torch.randn(n, *shape, generator=gen)).to(dtype)

    return make


def _pairs(shape, dtype):
    def make(n: int, gen: torch.Generator):
        return tuple((2.0 * torch.randn(n, *shape, generator=gen)).to(dtype) for _ in range(2))

    return make


def _gpu_normals(count: int, rows: int, hidden: int, dtype: torch.dtype, seed: int):
    """``count`` [rows, hidden] tensors drawn on the GPU in turn from one generator."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(
        torch.randn(rows, hidden, device=DEVICE, generator=gen).to(dtype) for _ in range(count)
    )


def _input_grads(fn, inputs, grads):
    """Gradients of ``fn(*inputs)`` for ``grads`` (one per output), w.r.t. every input."""
    leaves = [t.detach().to(DEVICE).requires_grad_(True) for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, [g.to(DEVICE) for g in grads])
    return tuple(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_forward_rows_are_batch_invariant(hidden, dtype):
    weight = _weight(hidden, dtype)
    reports = row_invariance_sweep(
        lambda x: batchinv.rms_norm(x.to(DEVICE), weight, EPS),
        _rows((hidden,), dtype),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_fused_add_rows_are_batch_invariant(hidden, dtype):
    weight = _weight(hidden, dtype)
    reports = row_invariance_sweep(
        lambda pair: batchinv.fused_add_rms_norm(
            pair[0].to(DEVICE), pair[1].to(DEVICE), weight, EPS
        ),
        _pairs((hidden,), dtype),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_per_head_qk_norm_tokens_are_batch_invariant(head_dim, dtype):
    weight = _weight(head_dim, dtype)
    reports = row_invariance_sweep(
        lambda x: batchinv.rms_norm(x.to(DEVICE), weight, EPS),
        _rows((HEADS, head_dim), dtype),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS + HEAD_DIMS)
def test_input_gradient_rows_are_batch_invariant(hidden, dtype):
    weight = _weight(hidden, dtype)

    def grad_x(pair):
        x, grad_y = pair
        (gx,) = _input_grads(lambda t: batchinv.rms_norm(t, weight, EPS), (x,), (grad_y,))
        return gx

    reports = row_invariance_sweep(grad_x, _pairs((hidden,), dtype), batch_sizes=BATCH_SIZES)
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_fused_add_input_gradient_rows_are_batch_invariant(hidden, dtype):
    weight = _weight(hidden, dtype)

    def make(n, gen):
        return tuple((2.0 * torch.randn(n, hidden, generator=gen)).to(dtype) for _ in range(4))

    def grads(rows):
        x, residual, grad_y, grad_residual = rows
        return _input_grads(
            lambda a, b: batchinv.fused_add_rms_norm(a, b, weight, EPS),
            (x, residual),
            (grad_y, grad_residual),
        )

    assert_no_drift(row_invariance_sweep(grads, make, batch_sizes=BATCH_SIZES))


@pytest.mark.parametrize(("dtype", "hidden"), STREAMING_CASES)
def test_streaming_rows_are_batch_invariant_forward_and_backward(dtype, hidden):
    weight = _weight(hidden, dtype)

    def both(pair):
        x, grad_y = pair
        y = batchinv.fused_add_rms_norm(x.to(DEVICE), grad_y.to(DEVICE), weight, EPS)
        (gx,) = _input_grads(lambda t: batchinv.rms_norm(t, weight, EPS), (x,), (grad_y,))
        return (*y, gx)

    reports = row_invariance_sweep(both, _pairs((hidden,), dtype), batch_sizes=(1, 3, 5))
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS + HEAD_DIMS)
def test_forward_and_gradients_are_within_tolerance_of_fp32_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(11)
    x = (2.0 * torch.randn(33, hidden, generator=gen)).to(dtype)
    x[5] *= 300.0  # a large-magnitude row
    weight = _weight(hidden, dtype).cpu()
    grad_y = torch.randn(33, hidden, generator=gen).to(dtype)
    grad_x, grad_w = _input_grads(lambda a, w: batchinv.rms_norm(a, w, EPS), (x, weight), (grad_y,))
    y = batchinv.rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS)
    ref_x, ref_w = (
        x.detach().float().clone().requires_grad_(True),
        weight.detach().float().clone().requires_grad_(True),
    )
    ref_y = rms_norm_fp32(ref_x, ref_w, EPS)
    ref_y.backward(grad_y.float())
    assert_within_tolerance(y.cpu(), ref_y.detach(), op_class="reduction", name="y")
    assert_within_tolerance(
        grad_x.cpu(), ref_x.grad, op_class="reduction", kind="grad", name="grad_x"
    )
    assert_within_tolerance(
        grad_w.cpu(), ref_w.grad, op_class="reduction", kind="grad", name="grad_w"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (3, 4097, 5120))
def test_fused_add_is_within_tolerance_of_fp32_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(17, hidden, generator=gen).to(dtype)
    residual = (3.0 * torch.randn(17, hidden, generator=gen)).to(dtype)
    weight = _weight(hidden, dtype)
    y, new_residual = batchinv.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight, EPS)
    ref_y, ref_residual = fused_add_rms_norm_fp32(x, residual, weight.cpu(), EPS)
    assert_within_tolerance(y.cpu(), ref_y, op_class="reduction", name="y")
    assert_within_tolerance(
        new_residual.cpu(), ref_residual, op_class="elementwise", name="new_residual"
    )
    # The residual sum is added in fp32 and rounded once: the correctly rounded sum.
    assert_bitwise_equal(new_residual.cpu(), (x.float() + residual.float()).to(dtype))


def test_fused_add_backward_matches_reference_semantics():
    # grad_x == grad_residual == round(fp32 grad through the norm + grad_new_residual).
    gen = torch.Generator().manual_seed(13)
    hidden = 111
    x, residual, grad_y, grad_res = (torch.randn(9, hidden, generator=gen) for _ in range(4))
    weight = _weight(hidden, torch.float32).cpu()
    gx, gr, gw = _input_grads(
        lambda a, b, w: batchinv.fused_add_rms_norm(a, b, w, EPS),
        (x, residual, weight),
        (grad_y, grad_res),
    )
    assert_bitwise_equal(gx, gr)
    ref = [t.clone().requires_grad_(True) for t in (x, residual, weight)]
    torch.autograd.backward(fused_add_rms_norm_fp32(*ref, EPS), [grad_y, grad_res])
    for name, got, want in (("grad_x", gx, ref[0].grad), ("grad_w", gw, ref[2].grad)):
        assert_within_tolerance(got.cpu(), want, op_class="reduction", kind="grad", name=name)


def _in_order(blocks: torch.Tensor) -> torch.Tensor:
    """[n, k, d] -> the sum over k in order from +0 (fp32, one rounding per add)."""
    total = torch.zeros(blocks.shape[0], blocks.shape[2], device=blocks.device)
    for i in range(blocks.shape[1]):
        total = total + blocks[:, i]
    return total


def _padded(t: torch.Tensor, run: int) -> torch.Tensor:
    """[n, d] -> [ceil(n / run), run, d], the missing rows zeros."""
    n, d = -(-t.shape[0] // run), t.shape[1]
    out = torch.zeros(n * run, d, device=t.device)
    out[: t.shape[0]] = t
    return out.view(n, run, d)


def _first_level_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence):
    """grad_weight's first-level partial rows: ``groups * in_sequence`` consecutive rows each,
    each group's run in order from +0, then the groups in order from +0."""
    d = grad_y.shape[1]
    products = grad_y.float() * (x.float() * rstd[:, None])
    runs = _padded(products, groups * in_sequence).view(-1, in_sequence, d)
    return _in_order(_in_order(runs).view(-1, groups, d))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A float64 result of one operation on fp32 values, rounded once to fp32: the correctly
    rounded fp32 result (53 bits >= 2 * 24 + 2, so for +, *, / and sqrt double rounding is
    harmless), independent of how torch's own fp32 kernels divide or take roots."""
    return t.float().double()


def _forward_by_the_documented_tree(x, weight, threads, eps):
    """``(y, inv_rms)`` of every row of ``x [rows, d]`` by the forward's row tree as
    docs/operators/rms_norm.md defines it: element ``e`` in 16-byte chunk ``c``, chunk ``c`` on
    thread ``c % T``, each thread adding its squares in increasing ``e`` from +0, an xor
    butterfly (offsets ``min(T, W) / 2 .. 1``) inside each warp of ``W`` lanes, then for ``T > W``
    the warp sums added in warp order; ``inv_rms = 1 / sqrt(sum / d + eps)``,
    ``y = round((h * inv_rms) * weight)``, every step one fp32 rounding."""
    rows, d = x.shape
    elems = 16 // x.element_size()
    per_thread = -(-d // (threads * elems))  # chunks per thread holding the row
    padded = torch.zeros(rows, per_thread * threads * elems, dtype=torch.float64, device=x.device)
    padded[:, :d] = x.double()  # +0 past the end adds nothing to a sum that starts at +0
    # [rows, K, T, E]: chunk k * T + lane is thread lane's k-th chunk
    chunks = padded.view(rows, per_thread, threads, elems)
    sums = torch.zeros(rows, threads, dtype=torch.float64, device=x.device)
    for k in range(per_thread):
        for e in range(elems):
            v = chunks[:, k, :, e]
            sums = _f32(sums + _f32(v * v))
    warp = 64 if torch.version.hip else 32
    lanes = min(threads, warp)
    index = torch.arange(threads, device=x.device)
    offset = lanes // 2
    while offset > 0:
        sums = _f32(sums + sums[:, index ^ offset])
        offset //= 2
    total = sums[:, 0]
    for w in range(1, max(1, threads // warp)):
        total = _f32(total + sums[:, w * warp])
    eps32 = torch.tensor(eps, dtype=torch.float32).double()
    inv_rms = _f32(1.0 / _f32(torch.sqrt(_f32(_f32(total / d) + eps32))))
    y = _f32(_f32(x.double() * inv_rms[:, None]) * weight.double())
    return y.to(x.dtype), inv_rms.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trim", (0, 5))  # 0: whole 16-byte chunks (vector path); 5: element path
def test_forward_rows_are_the_documented_tree_in_every_geometry(dtype, trim):
    # The forward's row tree (y and inv_rms bit for bit) rebuilt from elementwise operations for
    # every geometry that keeps the row in registers (t64: two warps per row, as t128 ... t512
    # have more; t128k2 and t128k5 must reduce as t128; trim 0 runs t64's *_vec entry).  The
    # tree is a function of d and the dtype only.
    elems = 16 // dtype.itemsize
    gen = torch.Generator(device=DEVICE).manual_seed(21)
    for threads, per_thread in gpu_rms_norm.GEOMETRIES:
        hidden = threads * per_thread * elems - trim
        name, got_threads, _ = gpu_rms_norm.geometry(hidden, dtype)
        assert got_threads == threads, name
        rows = 5
        x = (3.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype)
        x[1] *= 1e-3  # rows of other magnitudes: the sums round differently
        x[2] *= 40.0
        weight = _weight(hidden, dtype)
        y = torch.full_like(x, float("nan"))
        rstd = torch.full((rows,), float("nan"), device=DEVICE)
        gpu_rms_norm._launch_rows(
            "rms_norm_forward",
            x.device,
            hidden,
            dtype,
            rows,
            (y, 0, rstd, x, 0, weight, rows, hidden, hidden, 0, EPS),
        )
        want_y, want_rstd = _forward_by_the_documented_tree(x, weight, threads, EPS)
        assert_bitwise_equal(rstd, want_rstd, name=f"{name} hidden {hidden}: inv_rms")
        assert_bitwise_equal(y, want_y, name=f"{name} hidden {hidden}: y")


def _weight_grad_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence):
    """grad_weight as docs/operators/rms_norm.md defines it, from torch's elementwise fp32
    operations (one rounding each): the first-level partials (above), then runs of 64 partial
    rows while more than 64 remain, then the rest in order; rounded once.  Missing rows at the
    end are zeros (+0 leaves a sum from +0 unchanged)."""
    in_order, padded = _in_order, _padded
    partials = _first_level_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    while partials.shape[0] > gpu_rms_norm.WEIGHT_GRAD_REDUCE_ROWS:
        partials = in_order(padded(partials, gpu_rms_norm.WEIGHT_GRAD_REDUCE_ROWS))
    return in_order(partials[None])[0].to(grad_y.dtype)


# One hidden size per first-level shape: q/k norm (32 row groups of 1 row), 8 and 4 groups
# (500, 1000 bf16), one group (2500, 4096, 5120 at 300 rows), two groups of 16 (5120 at 9000
# rows: t128k5 from 8192 rows on), and rows whose sums do not fit the fused kernel (12000 bf16,
# t512, stream).
TREE_HIDDENS = (128, 500, 1000, 2500, 4096, 5120, 12000, 20000, 40000)
# Enough rows for the fused kernel (at least FUSED_WEIGHT_GRAD_MIN_BLOCKS CTAs of up to 32 rows);
# fewer take grad_x and the column pass.
FUSED_ROWS = 9000


# Few rows take grad_x and the column pass; many rows the fused kernel, where one exists.
TREE_CASES = [(h, t, False) for t in DTYPES for h in TREE_HIDDENS] + [
    (h, t, True) for t in DTYPES for h in TREE_HIDDENS if gpu_rms_norm.fused_backward_fits(h, t)
]


@pytest.mark.parametrize(("hidden", "dtype", "many_rows"), TREE_CASES)
def test_weight_gradient_is_the_documented_fixed_tree(hidden, dtype, many_rows):
    rows = FUSED_ROWS if many_rows else 300  # 9000: more than 64 partial rows (a second level)
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=9)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    _, grad_weight = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, rows)
    want = _weight_grad_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(grad_weight, want, name=f"grad_weight ({groups}x{in_sequence} rows)")


# The geometries whose first level is 2 x 16 rows from their edge (TWO_GROUP_EDGES) on in the
# dtypes of TWO_GROUP_DTYPES (1 x 16 below it, and in the other dtypes): t128k4 (hidden 4096
# bf16/fp16, 2048 fp32; 4090: the element path; bf16 and fp32 two groups from 16384 rows) and
# t128k5 (hidden 5120 bf16/fp16, 2560 fp32; 5114 and 2554: the element path; every dtype two
# groups from 8192 rows).  Rows: the two-pass path (300), the fused kernel
# (4097: a partial last CTA), both sides of the edge, and the edge plus 16 rows (a last CTA with
# one group of rows past the end); t128k5 also at 16384 rows (t128k4's edge).
TWO_GROUP_EDGES = {"t128k4": 16384, "t128k5": 8192}
TWO_GROUP_HIDDENS = {
    "t128k4": {torch.bfloat16: (4096, 4090), torch.float16: (4096, 4090), torch.float32: (2048,)},
    "t128k5": {
        torch.bfloat16: (5120, 5114),
        torch.float16: (5120, 5114),
        torch.float32: (2560, 2554),
    },
}
TWO_GROUP_CASES = [
    (name, h, t, rows)
    for name, by_dtype in TWO_GROUP_HIDDENS.items()
    for t in DTYPES
    for h in by_dtype[t]
    for rows in sorted(
        {
            300,
            4097,
            16384,
            TWO_GROUP_EDGES[name] - 1,
            TWO_GROUP_EDGES[name],
            TWO_GROUP_EDGES[name] + 16,
        }
    )
]
# Two groups per CTA: (geometry, dtype) pairs; the other pairs of these geometries keep 1 x 16.
TWO_GROUP_DTYPES = {
    "t128k4": (torch.bfloat16, torch.float32),
    "t128k5": (torch.bfloat16, torch.float16, torch.float32),
}


def _check_two_group_tree(name, hidden, dtype, rows):
    assert gpu_rms_norm.backward_geometry(hidden, dtype)[0] == name
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=18)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    grad_x, grad_weight = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, rows)
    two_groups = dtype in TWO_GROUP_DTYPES[name] and rows >= TWO_GROUP_EDGES[name]
    assert (groups, in_sequence) == ((2, 16) if two_groups else (1, 16))
    want = _weight_grad_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(grad_weight, want, name=f"grad_weight ({groups}x{in_sequence} rows)")
    # grad_x does not depend on the first level's shape: the grad_x-only kernel's bits.
    alone, _ = gpu_rms_norm.backward(grad_y, x, weight, rstd, weight_grad=False)
    assert_bitwise_equal(grad_x, alone, name="grad_x")


@pytest.mark.parametrize(
    ("hidden", "dtype", "rows"), [c[1:] for c in TWO_GROUP_CASES if c[0] == "t128k4"]
)
def test_weight_gradient_tree_of_t128k4(hidden, dtype, rows):
    _check_two_group_tree("t128k4", hidden, dtype, rows)


@pytest.mark.parametrize(
    ("hidden", "dtype", "rows"), [c[1:] for c in TWO_GROUP_CASES if c[0] == "t128k5"]
)
def test_weight_gradient_tree_of_t128k5(hidden, dtype, rows):
    _check_two_group_tree("t128k5", hidden, dtype, rows)


def test_two_group_rule_of_the_tests_is_the_hosts():
    # The expectations above are written out here, not read from the code under test; the
    # host's table must say the same.
    assert {k: (tuple(v[0]), v[1]) for k, v in gpu_rms_norm.TWO_GROUPS.items()} == {
        name: (TWO_GROUP_DTYPES[name], TWO_GROUP_EDGES[name]) for name in TWO_GROUP_DTYPES
    }
    assert gpu_rms_norm.TWO_GROUPS_SHAPE == (2, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_tree_with_a_level_below_the_last_two(dtype):
    # More than 64 * 64 first-level partial rows (q/k-like rows: 32 rows per partial, 4375
    # partials): one level of 64-row sums runs before the grid that computes the last two.
    rows, hidden = 140000, 8
    assert -(-rows // 32) > gpu_rms_norm.WEIGHT_GRAD_LAST_LEVELS_ROWS
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=17)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    _, grad_weight = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, rows)
    assert groups * in_sequence == 32
    want = _weight_grad_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(grad_weight, want, name="grad_weight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (8, 13, 4099))
def test_levels_above_the_first_are_the_documented_tree_at_any_row_count(dtype, d):
    # The levels above the first (reduce grids, then the last-levels grid: runs of 64 partial
    # rows, then the run sums) on partial rows given directly: row counts around a run (63, 64,
    # 65), around 16 runs (1024, 1025), the most the last-levels grid takes (4096) and one more
    # (a reduce level first); d = 13 and 4099: a last CTA with columns past the end.  Column 0
    # is all -0: sums start at +0, so it must come out +0.
    gen = torch.Generator(device=DEVICE).manual_seed(24)
    for count in (1, 63, 64, 65, 1024, 1025, 2500, 4096, 4097):
        partials = torch.randn(count, d, device=DEVICE, generator=gen)
        partials[:, 0] = -0.0
        got = gpu_rms_norm._reduce_partials(partials, dtype)
        rows = partials
        while rows.shape[0] > gpu_rms_norm.WEIGHT_GRAD_REDUCE_ROWS:
            rows = _in_order(_padded(rows, gpu_rms_norm.WEIGHT_GRAD_REDUCE_ROWS))
        want = _in_order(rows[None])[0].to(dtype)
        assert_bitwise_equal(got, want, name=f"{count} partial rows of {d}")
        assert got[0].item() == 0.0 and not bool(torch.signbit(got[0]))


# The last-levels grid overlapped with the fused backward (per-run counts, programmatic launch;
# sm_90a only): (dtype, rows, hidden) with one partial row (1 x 16 rows), 512 partial rows in 8
# runs (t128k4g2), 513 (a last run of one partial row), 1024 in 16 runs (fp16 t128k4, 1 x 16),
# t128k5g2 (bf16) and fp32 t128k4g2, and the most the grid takes, 4096 partial rows in 64 runs
# (q/k rows: 32 rows per partial row).
OVERLAP_CASES = (
    (torch.bfloat16, 9, 4096),
    (torch.bfloat16, 16384, 4096),
    (torch.bfloat16, 16400, 4096),
    (torch.float16, 16384, 4096),
    (torch.bfloat16, 16384, 5120),
    (torch.float32, 16384, 2048),
    (torch.bfloat16, 131072, 128),
)


def _needs_programmatic_launch():
    if not gpu_rms_norm._programmatic(torch.device(DEVICE)):
        pytest.skip("the overlapped last levels need the sm_90a kernels (programmatic launch)")


@pytest.mark.parametrize(("dtype", "rows", "hidden"), OVERLAP_CASES)
def test_overlapped_last_levels_give_the_bits_of_the_waiting_form(dtype, rows, hidden, monkeypatch):
    _needs_programmatic_launch()
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=25)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    name, blocks, cta, shape = gpu_rms_norm.fused_backward_plan(hidden, dtype, rows)
    counters = gpu_rms_norm.run_counters_for(x.device, blocks)
    assert counters is not None, f"{blocks} partial rows: no overlapped last levels"
    grad_x = torch.full_like(x, float("nan"))
    partials = torch.full((blocks, hidden), float("nan"), device=DEVICE)
    args = (grad_x, partials, grad_y, x, weight, rstd, 0, rows, hidden, hidden)
    gpu_rms_norm.launch_fused_backward(
        name, dtype, x.device, blocks, cta, args, shape=shape, run_counters=counters
    )
    overlapped = gpu_rms_norm._reduce_partials(partials, dtype, counters)
    # Every counter advanced by 64 in this call (one per CTA of its run, the rest by the last
    # CTA and by CTA 0), so each reads 64 times the call's number on these counters.
    words = counters.counters.view(-1, gpu_rms_norm.RUN_COUNTER_STRIDE)[:, 0].tolist()
    assert len(words) == 64 and counters.generation > 0
    assert words == [64 * counters.generation] * 64
    by_default_x, by_default = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    monkeypatch.setattr(gpu_rms_norm, "OVERLAP_LAST_LEVELS", False)
    assert gpu_rms_norm.run_counters_for(x.device, blocks) is None
    waiting_x, waiting = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    assert_bitwise_equal(overlapped, waiting, name="grad_weight, overlapped")
    assert_bitwise_equal(by_default, waiting, name="grad_weight, the op's default")
    assert_bitwise_equal(grad_x, waiting_x, name="grad_x")
    assert_bitwise_equal(by_default_x, waiting_x, name="grad_x, the op's default")


def test_overlapped_last_levels_are_the_same_bits_on_every_call_and_in_a_cuda_graph():
    # The runs are read while the first level's last CTAs still write theirs: a missed wait
    # would read unwritten or stale partial rows.  Repeated calls and graph replays (the counts
    # are zeroed by a node of the graph) must all give the first call's bits, which are the
    # documented tree's.
    _needs_programmatic_launch()
    dtype, rows, hidden = torch.bfloat16, 16384, 5120
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=26)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    blocks = gpu_rms_norm.fused_backward_plan(hidden, dtype, rows)[1]
    assert gpu_rms_norm.run_counters_for(x.device, blocks) is not None
    first_x, first = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, rows)
    want = _weight_grad_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(first, want, name="grad_weight")
    for call in range(20):
        grad_x, grad_weight = gpu_rms_norm.backward(grad_y, x, weight, rstd)
        assert_bitwise_equal(grad_weight, first, name=f"grad_weight, call {call}")
        assert_bitwise_equal(grad_x, first_x, name=f"grad_x, call {call}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu_rms_norm.backward(grad_y, x, weight, rstd)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_x, graph_weight = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    for replay in range(5):
        graph_weight.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(graph_weight, first, name=f"grad_weight, replay {replay}")
        assert_bitwise_equal(graph_x, first_x, name=f"grad_x, replay {replay}")


def test_threads_on_one_stream_keep_each_calls_two_launches_together():
    # Python threads running the backward on one stream share its counters: a call's first
    # level and last-levels grid must stay next to each other on the stream (the counters'
    # lock), or a call's waits would count another call's CTAs.  Every result must be its
    # inputs' bits.
    _needs_programmatic_launch()
    dtype, rows, hidden = torch.bfloat16, 16384, 4096
    inputs = []
    for seed in (29, 30, 31):
        x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=seed)
        weight = _weight(hidden, dtype, seed=seed)
        _, rstd = gpu_rms_norm.forward(x, weight, EPS)
        inputs.append((grad_y, x, weight, rstd))
    want = [gpu_rms_norm.backward(*args)[1] for args in inputs]
    stream = torch.cuda.current_stream()
    results, errors = [], []

    def worker(k):
        try:
            with torch.cuda.stream(stream):
                for _ in range(8):
                    results.append((k, gpu_rms_norm.backward(*inputs[k])[1]))
        except Exception as error:  # reported below, with the thread's input
            errors.append((k, error))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, between any two launches
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    torch.cuda.synchronize()
    assert not errors, errors
    assert len(results) == 8 * len(inputs)
    for k, got in results:
        assert_bitwise_equal(got, want[k], name=f"grad_weight of input {k}")


def test_run_counters_are_refused_where_levels_come_between():
    _needs_programmatic_launch()
    partials = torch.zeros(gpu_rms_norm.WEIGHT_GRAD_LAST_LEVELS_ROWS + 1, 8, device=DEVICE)
    assert gpu_rms_norm.run_counters_for(partials.device, partials.shape[0]) is None
    counters = gpu_rms_norm.run_counters_for(partials.device, partials.shape[0] - 1)
    with pytest.raises(ValueError, match="run_counters"):
        gpu_rms_norm._reduce_partials(partials, torch.bfloat16, counters)
    with pytest.raises(ValueError, match="run_counters"):  # before any launch
        gpu_rms_norm.launch_fused_backward(
            "t4", torch.bfloat16, partials.device, partials.shape[0], 128, (), run_counters=counters
        )


@pytest.mark.parametrize("mode", ("stream", "call"))
def test_counts_left_by_a_call_whose_last_levels_never_ran_do_not_pass_a_later_wait(
    mode, monkeypatch
):
    # A first level whose last-levels grid was never launched (an error between the two) leaves
    # complete counts behind; the next call on the stream reuses the counters ("stream") under
    # a new generation and must still wait for its own first level.  Its bits are checked
    # against the waiting form; a wait passed too early would read partial rows not yet
    # written (the two calls' inputs differ).
    _needs_programmatic_launch()
    monkeypatch.setattr(gpu_rms_norm, "RUN_COUNTERS", mode)
    dtype, rows, hidden = torch.bfloat16, 16384, 4096
    weight = _weight(hidden, dtype)
    name, blocks, cta, shape = gpu_rms_norm.fused_backward_plan(hidden, dtype, rows)
    partials = torch.empty((blocks, hidden), device=DEVICE)
    for seed in (27, 28):
        x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=seed)
        _, rstd = gpu_rms_norm.forward(x, weight, EPS)
        counters = gpu_rms_norm.run_counters_for(x.device, blocks)
        args = (torch.empty_like(x), partials, grad_y, x, weight, rstd, 0, rows, hidden, hidden)
        gpu_rms_norm.launch_fused_backward(
            name, dtype, x.device, blocks, cta, args, shape=shape, run_counters=counters
        )  # no last levels after it
        _, got = gpu_rms_norm.backward(grad_y, x, weight, rstd)
        monkeypatch.setattr(gpu_rms_norm, "OVERLAP_LAST_LEVELS", False)
        _, want = gpu_rms_norm.backward(grad_y, x, weight, rstd)
        monkeypatch.setattr(gpu_rms_norm, "OVERLAP_LAST_LEVELS", True)
        assert_bitwise_equal(got, want, name=f"grad_weight after an abandoned call ({mode})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (128, 1000, 4096, 5120))
def test_fused_and_two_pass_weight_gradients_have_the_same_bits(hidden, dtype):
    # The backward picks the path from the row count; the bits must not depend on it.
    x, grad_y = _gpu_normals(2, FUSED_ROWS, hidden, dtype, seed=14)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    _, fused = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, FUSED_ROWS)
    partials = gpu_rms_norm._weight_grad_separately(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(fused, gpu_rms_norm._reduce_partials(partials, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (128, 1000, 4096, 5120, 20000))
@pytest.mark.parametrize("with_residual_grad", (False, True))
def test_input_gradient_bits_do_not_depend_on_computing_the_weight_gradient(
    hidden, dtype, with_residual_grad
):
    # With grad_weight (and enough rows) the row is reduced inside the fused kernel; without,
    # by the grad_x kernel.
    rows = FUSED_ROWS if hidden < 10000 else 77
    x, grad_y, extra = _gpu_normals(3, rows, hidden, dtype, seed=10)
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    extra = extra if with_residual_grad else None
    with_weight, _ = gpu_rms_norm.backward(grad_y, x, weight, rstd, extra)
    alone, none = gpu_rms_norm.backward(grad_y, x, weight, rstd, extra, weight_grad=False)
    assert none is None
    assert_bitwise_equal(with_weight, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), ((257, 4096), (5000, 64), (70000, 128)))
def test_weight_gradient_is_bitwise_identical_run_to_run(rows, hidden, dtype):
    # 5000 and 70000 rows take one and two levels of the fixed tree above the first.
    x, grad_y = _gpu_normals(2, rows, hidden, dtype, seed=3)
    weight = _weight(hidden, dtype).requires_grad_(True)
    grads = []
    for _ in range(3):
        weight.grad = None
        batchinv.rms_norm(x, weight, EPS).backward(grad_y)
        grads.append(weight.grad.clone())
    assert_bitwise_equal(grads[1], grads[0])
    assert_bitwise_equal(grads[2], grads[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_ignores_zero_gradient_rows_appended(dtype):
    hidden, rows = 384, 4200  # crosses first-level chunks and a second tree level
    x, grad_y = _gpu_normals(2, rows + 300, hidden, dtype, seed=4)
    grad_y[rows:] = 0
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    _, padded = gpu_rms_norm.backward(grad_y, x, weight, rstd)
    _, exact = gpu_rms_norm.backward(grad_y[:rows], x[:rows], weight, rstd[:rows])
    assert_bitwise_equal(padded, exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (8, 64, 4096, 4104))
@pytest.mark.parametrize("offset", (1, 3, 8))
def test_misaligned_and_strided_inputs_take_a_narrower_path_with_the_same_bits(
    hidden, dtype, offset
):
    rows = 19
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    storage = torch.randn(rows * (hidden + 8) + 16, device=DEVICE, generator=gen).to(dtype)
    shifted = storage[offset : offset + rows * hidden].view(rows, hidden)  # unaligned base
    strided = storage[: rows * (hidden + 8)].view(rows, hidden + 8)[:, offset : offset + hidden]
    weight = _weight(hidden, dtype)
    for x in (shifted, strided):
        aligned = x.contiguous()
        assert_bitwise_equal(
            batchinv.rms_norm(x, weight, EPS), batchinv.rms_norm(aligned, weight, EPS)
        )
        y, h = batchinv.fused_add_rms_norm(x, x.flip(0), weight, EPS)
        y_ref, h_ref = batchinv.fused_add_rms_norm(
            aligned, aligned.flip(0).contiguous(), weight, EPS
        )
        assert_bitwise_equal(y, y_ref)
        assert_bitwise_equal(h, h_ref)
        g = torch.randn(rows, hidden, device=DEVICE, generator=gen).to(dtype)
        (gx,) = _input_grads(lambda t: batchinv.rms_norm(t, weight, EPS), (x,), (g,))
        (gx_ref,) = _input_grads(lambda t: batchinv.rms_norm(t, weight, EPS), (aligned,), (g,))
        assert_bitwise_equal(gx, gx_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_launches_take_the_vec_entries(dtype, monkeypatch):
    # Vector launches of VECTOR_ENTRIES' geometries run the *_vec kernels (the host checks the
    # alignment), element launches the kernels that take both paths; both give the same bits.
    launched = []
    kernel_for = gpu_rms_norm.kernel_for

    def recording(module, kernel, device):
        launched.append(kernel)
        return kernel_for(module, kernel, device)

    monkeypatch.setattr(gpu_rms_norm, "kernel_for", recording)
    elems = 16 // dtype.itemsize
    for name in ("t64", "t128k5"):
        threads, per_thread = {"t64": (64, 8), "t128k5": (128, 5)}[name]
        hidden = threads * per_thread * elems
        assert gpu_rms_norm.geometry(hidden, dtype)[0] == name
        gen = torch.Generator(device=DEVICE).manual_seed(hidden)
        x, residual = (torch.randn(7, hidden, device=DEVICE, generator=gen) for _ in "xr")
        x, residual = x.to(dtype), residual.to(dtype)
        weight = _weight(hidden, dtype)

        def shifted(t):  # the same values one element past a 16-byte boundary (element path)
            storage = torch.empty(t.shape[0], t.shape[1] + 1, dtype=dtype, device=DEVICE)
            storage[:, 1:] = t
            return storage[:, 1:]

        for kernel in ("rms_norm_forward", "rms_norm_fused_forward"):
            outs = {}
            for layout in ("vector", "element"):
                launched.clear()
                a = x if layout == "vector" else shifted(x)
                r = residual if layout == "vector" else shifted(residual)
                if kernel == "rms_norm_forward":
                    outs[layout] = gpu_rms_norm.forward(a, weight, EPS)
                else:
                    outs[layout] = gpu_rms_norm.fused_add_forward(a, r, weight, EPS)
                base = f"{kernel}_{gpu_rms_norm._SUFFIX[dtype]}_{name}"
                vector_entry = (kernel, name) in gpu_rms_norm.VECTOR_ENTRIES
                vector_entry = vector_entry and torch.version.hip is None  # CUDA only
                want = base + "_vec" if layout == "vector" and vector_entry else base
                assert launched == [want], (layout, launched)
            for got, want in zip(outs["vector"], outs["element"], strict=True):
                assert_bitwise_equal(got, want, name=f"{kernel} {name}")


# A negative NaN with a payload in each storage type (as a signed integer of its width).
_NEGATIVE_NAN_PAYLOAD = {
    torch.bfloat16: (torch.int16, -63),  # 0xffc1
    torch.float16: (torch.int16, -511),  # 0xfe01
    torch.float32: (torch.int32, -4194303),  # 0xffc00001
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (128, 4096, 5120))
def test_special_values_have_the_same_bits_on_the_vector_and_element_paths(hidden, dtype):
    # NaN, infinities, a negative NaN with a payload, signed zeros and a row of tiny values in
    # x, the residual and the weight.  Vector launches (bf16: NaN tested after packing, in
    # round_chunk_rare_nan) must give the element path's bits, and a bf16 NaN output must be
    # PyTorch's canonical 0x7fc0.
    rows = 9
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    x = (2.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, device=DEVICE, generator=gen).to(dtype)
    weight = _weight(hidden, dtype).clone()
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] *= 1e-30  # squares below the smallest fp32 subnormal, or zeros
    residual[4, 6] = float("nan")
    residual[5, 8] = -float("inf")
    weight[7] = float("nan")
    weight[9] = float("inf")
    weight[10] = -float("inf")
    int_type, payload = _NEGATIVE_NAN_PAYLOAD[dtype]
    weight.view(int_type)[11] = payload
    weight[12] = 0.0
    weight[13] = -0.0

    def shifted(t):  # the same values one element past a 16-byte boundary: the element path
        storage = torch.empty(t.numel() + 1, dtype=dtype, device=DEVICE)
        out = storage[1:].view(t.shape)
        out.copy_(t)
        return out

    y, rstd = gpu_rms_norm.forward(x, weight, EPS)
    y_element, rstd_element = gpu_rms_norm.forward(shifted(x), weight, EPS)
    assert_bitwise_equal(y, y_element, name="y")
    assert_bitwise_equal(rstd, rstd_element, name="inv_rms")
    fused = gpu_rms_norm.fused_add_forward(x, residual, weight, EPS)
    fused_element = gpu_rms_norm.fused_add_forward(shifted(x), shifted(residual), weight, EPS)
    for got, want, name in zip(fused, fused_element, ("y", "new_residual", "inv_rms"), strict=True):
        assert_bitwise_equal(got, want, name=f"fused {name}")
    assert bool(y.isnan().any()) and bool(fused[0].isnan().any())
    if dtype == torch.bfloat16:
        for t in (y, *fused[:2]):
            nan_bits = t.view(torch.int16)[t.isnan()]
            assert bool((nan_bits == 0x7FC0).all()), "a bf16 NaN output is not 0x7fc0"


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_output_element_is_written_in_every_geometry(dtype):
    # One hidden size per kernel geometry (t4 ... t512 and the streaming form), outputs
    # pre-filled with NaN and launched directly: a NaN left over means an unwritten element.
    elems = 16 // dtype.itemsize
    hiddens = [max(1, t * k * elems - 5) for t, k in gpu_rms_norm.GEOMETRIES]
    hiddens.append(max(t * k for t, k in gpu_rms_norm.GEOMETRIES) * elems + 3)
    names = {gpu_rms_norm.geometry(h, dtype)[0] for h in hiddens}
    assert len(names) == len(gpu_rms_norm.GEOMETRIES) + 1
    backward_names = {gpu_rms_norm.backward_geometry(h, dtype)[0] for h in hiddens}
    assert len(backward_names) == len(gpu_rms_norm.BACKWARD_GEOMETRIES) + 1
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    for hidden in hiddens:
        rows = 37
        x = torch.randn(rows, hidden, device=DEVICE, generator=gen).to(dtype)
        residual = torch.randn(rows, hidden, device=DEVICE, generator=gen).to(dtype)
        weight = _weight(hidden, dtype)
        y = torch.full((rows, hidden), float("nan"), dtype=dtype, device=DEVICE)
        new_residual = torch.full_like(y, float("nan"))
        rstd = torch.full((rows,), float("nan"), device=DEVICE)
        plain_y = torch.full_like(y, float("nan"))
        gpu_rms_norm._launch_rows(
            "rms_norm_forward",
            x.device,
            hidden,
            dtype,
            rows,
            (plain_y, 0, 0, x, 0, weight, rows, hidden, hidden, 0, EPS),
        )
        assert not bool(plain_y.isnan().any()), f"hidden {hidden}: y has unwritten elements"
        assert_bitwise_equal(plain_y, batchinv.rms_norm(x, weight, EPS))
        gpu_rms_norm._launch_rows(
            "rms_norm_fused_forward",
            x.device,
            hidden,
            dtype,
            rows,
            (y, new_residual, rstd, x, residual, weight, rows, hidden, hidden, hidden, EPS),
        )
        assert not bool(y.isnan().any()), f"hidden {hidden}: y has unwritten elements"
        assert not bool(new_residual.isnan().any()), f"hidden {hidden}: new_residual unwritten"
        assert not bool(rstd.isnan().any()), f"hidden {hidden}: rstd unwritten"
        ref_y, ref_h = batchinv.fused_add_rms_norm(x, residual, weight, EPS)
        assert_bitwise_equal(y, ref_y)
        assert_bitwise_equal(new_residual, ref_h)
        assert_bitwise_equal(y, batchinv.rms_norm(new_residual, weight, EPS))
        grad_x = torch.full_like(y, float("nan"))
        gpu_rms_norm._launch_rows(
            "rms_norm_backward",
            x.device,
            hidden,
            dtype,
            rows,
            (grad_x, y, x, weight, rstd, 0, rows, hidden, hidden),
        )
        assert not bool(grad_x.isnan().any()), f"hidden {hidden}: grad_x has unwritten elements"
        if not gpu_rms_norm.fused_backward_fits(hidden, dtype):
            continue
        name, blocks, cta, shape = gpu_rms_norm.fused_backward_plan(hidden, dtype, rows)
        fused_grad_x = torch.full_like(y, float("nan"))
        partials = torch.full((blocks, hidden), float("nan"), device=DEVICE)
        gpu_rms_norm.launch_fused_backward(
            name,
            dtype,
            x.device,
            blocks,
            cta,
            (fused_grad_x, partials, y, x, weight, rstd, 0, rows, hidden, hidden),
            shape=shape,
        )
        assert not bool(partials.isnan().any()), f"hidden {hidden}: partials unwritten"
        assert_bitwise_equal(fused_grad_x, grad_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trim", (0, 3))  # 0: whole 16-byte chunks (vector path); 3: element path
def test_fewer_chunks_per_thread_reduce_a_row_as_the_wider_geometry(dtype, trim):
    # t128k5 (rows of up to 640 chunks) is t128 with registers for 5 chunks instead of 8: a
    # thread's chunks and their order are the same, so every kernel must give t128's bits.  The
    # fused backward of t128k5 also keeps the weight in registers (another code path).
    elems = 16 // dtype.itemsize
    hidden = 128 * 5 * elems - trim
    assert gpu_rms_norm.geometry(hidden, dtype)[0] == "t128k5"
    suffix = gpu_rms_norm._SUFFIX[dtype]
    rows = 67
    gen = torch.Generator(device=DEVICE).manual_seed(15)
    x, residual, grad_y, grad_residual = (
        (2.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype) for _ in range(4)
    )
    weight = _weight(hidden, dtype)

    def run(kernel, grid, outputs, inputs):
        outs = [torch.full_like(o, float("nan")) for o in outputs]
        gpu_rms_norm.launch(
            gpu_rms_norm.kernel_for("rms_norm", kernel, x.device),
            x.device,
            grid=(grid,),
            block=(128,),
            args=(*outs, *inputs),
        )
        return outs

    rstd = torch.empty(rows, device=DEVICE)
    for name in ("t128k5", "t128"):
        got = run(
            f"rms_norm_fused_forward_{suffix}_{name}",
            rows,
            (x, x, rstd),
            (x, residual, weight, rows, hidden, hidden, hidden, EPS),
        )
        plain = run(
            f"rms_norm_forward_{suffix}_{name}",
            rows,
            (x,),
            (0, 0, got[1], 0, weight, rows, hidden, hidden, 0, EPS),
        )
        grad_x = run(
            f"rms_norm_backward_{suffix}_{name}",
            rows,
            (x,),
            (grad_y, got[1], weight, got[2], grad_residual, rows, hidden, hidden),
        )
        blocks = -(-rows // gpu_rms_norm.WEIGHT_GRAD_CHUNK_ROWS)
        fused = run(
            f"rms_norm_backward_weight_grad_{suffix}_{name}",
            blocks,
            (x, torch.empty(blocks, hidden, device=DEVICE)),
            (grad_y, got[1], weight, got[2], grad_residual, rows, hidden, hidden, 0, 0),
        )
        results = (*got, *plain, *grad_x, *fused)
        if name == "t128k5":
            narrow = results
    if trim == 0:  # the fused forward's vector entry (whole chunks only): the same bits
        vector = run(
            f"rms_norm_fused_forward_{suffix}_t128k5_vec",
            rows,
            (x, x, rstd),
            (x, residual, weight, rows, hidden, hidden, hidden, EPS),
        )
        for label, a, b in zip(("y", "new_residual", "rstd"), vector, narrow[:3], strict=True):
            assert_bitwise_equal(a, b, name=f"t128k5_vec fused {label}")
    for label, a, b in zip(
        ("y", "new_residual", "rstd", "plain y", "grad_x", "fused grad_x", "partials"),
        narrow,
        results,
        strict=True,
    ):
        assert not bool(a.isnan().any()), f"{label}: unwritten elements"
        assert_bitwise_equal(a, b, name=label)
    assert_bitwise_equal(narrow[3], narrow[0], name="plain y vs fused y")
    assert_bitwise_equal(narrow[5], narrow[4], name="fused grad_x vs grad_x kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trim", (0, 3))  # 0: whole 16-byte chunks (vector path); 3: element path
def test_backward_t128k4_reduces_a_row_as_t128(dtype, trim):
    # The backward of rows of 129 .. 512 chunks (bf16 hidden 4096) runs t128k4 (the forward
    # t64): 128 threads of 4 chunks, so a row's tree is t128's; the backward kernels of t128k4,
    # t128k5 and t128 must give the same grad_x and first-level partials.  t128k4's fused kernel
    # also loads each row while the previous one is worked on (67 rows: the last CTA's loads run
    # past the end), staged in shared memory on the vector path (trim 0, CUDA) and in registers
    # on the element path, the others do not, so this also checks that neither changes bits.
    elems = 16 // dtype.itemsize
    hidden = 128 * 4 * elems - trim
    assert gpu_rms_norm.backward_geometry(hidden, dtype)[0] == "t128k4"
    rows = 67
    suffix = gpu_rms_norm._SUFFIX[dtype]
    gen = torch.Generator(device=DEVICE).manual_seed(16)
    x, grad_y, grad_residual = (
        (2.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype) for _ in range(3)
    )
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    blocks = -(-rows // gpu_rms_norm.WEIGHT_GRAD_CHUNK_ROWS)
    inputs = (grad_y, x, weight, rstd, grad_residual, rows, hidden, hidden)
    results = {}
    for name in ("t128k4", "t128k5", "t128"):
        grad_x = torch.full_like(x, float("nan"))
        fused_grad_x = torch.full_like(x, float("nan"))
        partials = torch.full((blocks, hidden), float("nan"), device=DEVICE)
        gpu_rms_norm.launch(
            gpu_rms_norm.kernel_for("rms_norm", f"rms_norm_backward_{suffix}_{name}", x.device),
            x.device,
            grid=(rows,),
            block=(128,),
            args=(grad_x, *inputs),
        )
        gpu_rms_norm.launch_fused_backward(
            name, dtype, x.device, blocks, 128, (fused_grad_x, partials, *inputs)
        )
        for label, t in (
            ("grad_x", grad_x),
            ("fused grad_x", fused_grad_x),
            ("partials", partials),
        ):
            assert not bool(t.isnan().any()), f"{name} {label}: unwritten elements"
        assert_bitwise_equal(fused_grad_x, grad_x, name=f"{name}: fused vs grad_x kernel")
        results[name] = (grad_x, partials)
    for name in ("t128k5", "t128"):
        assert_bitwise_equal(results["t128k4"], results[name], name=f"t128k4 vs {name}")
    # The op runs t128k4 for this hidden size.
    op_grad_x, _ = gpu_rms_norm.backward(grad_y, x, weight, rstd, grad_residual)
    assert_bitwise_equal(op_grad_x, results["t128k4"][0], name="op vs t128k4")
    # Its two-group CTAs (bf16, fp32; 2 groups x 16 rows; here 67 rows: three CTAs, the last
    # with 3 rows) compute grad_x as t128 does and partial rows as the documented tree.
    if dtype not in TWO_GROUP_DTYPES["t128k4"]:
        return
    groups, in_sequence = gpu_rms_norm.TWO_GROUPS_SHAPE
    two_blocks = -(-rows // (groups * in_sequence))
    two_grad_x = torch.full_like(x, float("nan"))
    two_partials = torch.full((two_blocks, hidden), float("nan"), device=DEVICE)
    gpu_rms_norm.launch_fused_backward(
        "t128k4",
        dtype,
        x.device,
        two_blocks,
        128 * groups,
        (two_grad_x, two_partials, *inputs),
        shape=(groups, in_sequence),
    )
    assert_bitwise_equal(two_grad_x, results["t128"][0], name="t128k4g2 grad_x vs t128")
    want = _first_level_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
    assert_bitwise_equal(two_partials, want, name="t128k4g2 partials")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trim", (0, 3))  # 0: whole 16-byte chunks (vector path); 3: element path
def test_backward_t128k5_two_groups_are_the_documented_tree(dtype, trim):
    # t128k5's two-group CTAs (t128k5g2: 2 groups x 16 rows, each group reducing its rows at a
    # named barrier of its own) launched directly on 67 rows: three CTAs,
    # the last with 3 rows (its second group wholly past the end).  grad_x must be the grad_x-only
    # kernel's, the partial rows the documented 2 x 16 first level, with and without a residual
    # gradient.
    elems = 16 // dtype.itemsize
    hidden = 128 * 5 * elems - trim
    assert gpu_rms_norm.backward_geometry(hidden, dtype)[0] == "t128k5"
    rows = 67
    suffix = gpu_rms_norm._SUFFIX[dtype]
    gen = torch.Generator(device=DEVICE).manual_seed(23)
    x, grad_y, grad_residual = (
        (2.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype) for _ in range(3)
    )
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    groups, in_sequence = 2, 16
    blocks = -(-rows // (groups * in_sequence))
    for extra in (None, grad_residual):
        inputs = (grad_y, x, weight, rstd, extra if extra is not None else 0, rows, hidden, hidden)
        grad_x = torch.full_like(x, float("nan"))
        gpu_rms_norm.launch(
            gpu_rms_norm.kernel_for("rms_norm", f"rms_norm_backward_{suffix}_t128k5", x.device),
            x.device,
            grid=(rows,),
            block=(128,),
            args=(grad_x, *inputs),
        )
        two_grad_x = torch.full_like(x, float("nan"))
        partials = torch.full((blocks, hidden), float("nan"), device=DEVICE)
        gpu_rms_norm.launch_fused_backward(
            "t128k5",
            dtype,
            x.device,
            blocks,
            128 * groups,
            (two_grad_x, partials, *inputs),
            shape=(groups, in_sequence),
        )
        assert not bool(grad_x.isnan().any()), "grad_x: unwritten elements"
        assert_bitwise_equal(two_grad_x, grad_x, name="t128k5g2 grad_x vs grad_x kernel")
        want = _first_level_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
        assert_bitwise_equal(partials, want, name="t128k5g2 partials")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trim", (0, 3))  # 0: whole 16-byte chunks (vector path); 3: element path
def test_backward_t4_runs_of_one_row_are_the_documented_tree(dtype, trim):
    # The q/k norm's fused backward (t4: 32 row groups of 4 threads, a partial row of 32 runs of
    # one row) writes each run's sums as +0 + its products instead of adding them to cleared
    # slots, and lays the groups' sums out interleaved.  67 rows: three
    # CTAs, the last with 3 rows and 29 groups past the end, whose sums must be +0; one row of
    # -0 gradients, whose products are -0 (a run's sum from +0 is +0 there).
    elems = 16 // dtype.itemsize
    hidden = 4 * 4 * elems - trim
    assert gpu_rms_norm.backward_geometry(hidden, dtype)[0] == "t4"
    rows = 67
    gen = torch.Generator(device=DEVICE).manual_seed(22)
    x, grad_y, grad_residual = (
        (2.0 * torch.randn(rows, hidden, device=DEVICE, generator=gen)).to(dtype) for _ in range(3)
    )
    grad_y[5] = -0.0
    weight = _weight(hidden, dtype)
    _, rstd = gpu_rms_norm.forward(x, weight, EPS)
    groups, in_sequence = gpu_rms_norm.weight_grad_chunking(hidden, dtype, rows)
    assert (groups, in_sequence) == (32, 1)
    blocks = -(-rows // groups)
    for extra in (None, grad_residual):
        inputs = (grad_y, x, weight, rstd, extra if extra is not None else 0, rows, hidden, hidden)
        fused_grad_x = torch.full_like(x, float("nan"))
        partials = torch.full((blocks, hidden), float("nan"), device=DEVICE)
        gpu_rms_norm.launch_fused_backward(
            "t4", dtype, x.device, blocks, 128, (fused_grad_x, partials, *inputs)
        )
        want = _first_level_by_the_documented_tree(grad_y, x, rstd, groups, in_sequence)
        assert_bitwise_equal(partials, want, name="t4 partial rows")
        alone, _ = gpu_rms_norm.backward(grad_y, x, weight, rstd, extra, weight_grad=False)
        assert_bitwise_equal(fused_grad_x, alone, name="t4 fused grad_x vs grad_x kernel")


def test_nan_rows_do_not_leak_into_their_neighbours():
    x = torch.randn(5, 4096, device=DEVICE).bfloat16()
    weight = _weight(4096, torch.bfloat16)
    alone = batchinv.rms_norm(x[2:3], weight, EPS)
    poisoned = x.clone()
    poisoned[1] = float("nan")
    poisoned[3] = float("inf")
    out = batchinv.rms_norm(poisoned, weight, EPS)
    assert_bitwise_equal(out[2:3], alone)
    assert bool(out[1].isnan().all())


def test_zero_rows_and_an_all_zero_row():
    weight = _weight(64, torch.float32).requires_grad_(True)
    empty = torch.empty(0, 3, 64, device=DEVICE, requires_grad=True)
    out = batchinv.rms_norm(empty, weight, EPS)
    assert out.shape == (0, 3, 64)
    out.sum().backward()
    assert_bitwise_equal(weight.grad, torch.zeros(64, device=DEVICE))
    zeros = torch.zeros(2, 64, device=DEVICE)
    # (0 * inv_rms) * w: no NaN from 0/0 (eps > 0), and the sign of w's zero product.
    assert_bitwise_equal(batchinv.rms_norm(zeros, weight.detach(), EPS), zeros * weight.detach())


def test_inputs_are_not_mutated():
    x = torch.randn(7, 111, device=DEVICE).bfloat16()
    residual = torch.randn(7, 111, device=DEVICE).bfloat16()
    weight = _weight(111, torch.bfloat16)
    before = [t.clone() for t in (x, residual, weight)]
    batchinv.rms_norm(x, weight, EPS)
    batchinv.fused_add_rms_norm(x, residual, weight, EPS)
    for t, b in zip((x, residual, weight), before, strict=True):
        assert_bitwise_equal(t, b)


def test_bad_input_raises_errors_that_name_the_argument():
    x = torch.randn(4, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        batchinv.rms_norm(x, weight, 0.0)
    with pytest.raises(ValueError, match="eps must be > 0 in float32"):
        batchinv.rms_norm(x, weight, 1e-50)
    with pytest.raises(ValueError, match="weight must have shape"):
        batchinv.rms_norm(x, torch.ones(65, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="weight has dtype"):
        batchinv.rms_norm(x, weight.bfloat16(), 1e-6)
    with pytest.raises(TypeError, match="x must have dtype"):
        batchinv.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        batchinv.rms_norm(x, weight.cpu(), 1e-6)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        batchinv.fused_add_rms_norm(x, x[:2], weight, 1e-6)
    with pytest.raises(ValueError, match="residual is on cpu"):
        batchinv.fused_add_rms_norm(x, x.cpu(), weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (128, 4096))
def test_inference_path_gives_the_bits_of_the_autograd_path(hidden, dtype):
    # Without gradients the op skips autograd and the saved inv_rms: same kernels, same bits.
    x, residual = _gpu_normals(2, 33, hidden, dtype, seed=8)
    weight = _weight(hidden, dtype)
    with torch.no_grad():
        y = batchinv.rms_norm(x, weight, EPS)
        fused = batchinv.fused_add_rms_norm(x, residual, weight, EPS)
    x_grad = x.detach().clone().requires_grad_(True)
    assert_bitwise_equal(batchinv.rms_norm(x_grad, weight, EPS).detach(), y)
    fused_grad = batchinv.fused_add_rms_norm(x_grad, residual, weight, EPS)
    assert_bitwise_equal([t.detach() for t in fused_grad], list(fused))
