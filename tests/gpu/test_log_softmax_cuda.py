"""The CUDA log-softmax kernels: rows bitwise invariant to the batch (forward and input
gradient), bits independent of where the row is cached on chip, within the contract's logprob
tolerance of the fp32 reference, -inf rows by definition, every output element written."""

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
from batchinv.gpu import log_softmax as gpu_log_softmax
from batchinv.reference.log_softmax import log_softmax_fp32

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
QUICK = os.environ.get("BATCHINV_QUICK") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VOCABS = (1, 3, 111, 4097, 32000) if QUICK else (1, 3, 111, 4096, 4097, 32000, 151936)
BATCH_SIZES = (1, 3, 17) if QUICK else (1, 3, 17, 33, 257)
BIG_VOCAB = 151936


def _logits(vocab: int, dtype: torch.dtype, *, grads: bool = False):
    def make(n: int, gen: torch.Generator):
        x = (4.0 * torch.randn(n, vocab, generator=gen)).to(dtype)
        if not grads:
            return x
        return x, torch.randn(n, vocab, generator=gen)

    return make


def _grad_x(x, grad, out_dtype=torch.float32):
    x = x.detach().to(DEVICE).requires_grad_(True)
    batchinv.log_softmax(x, -1, out_dtype).backward(grad.to(DEVICE, out_dtype))
    return x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_rows_are_batch_invariant(vocab, dtype):
    batch_sizes = BATCH_SIZES if vocab < BIG_VOCAB else (1, 3, 17)
    reports = row_invariance_sweep(
        lambda x: batchinv.log_softmax(x.to(DEVICE)), _logits(vocab, dtype), batch_sizes=batch_sizes
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float16))
def test_low_precision_output_rows_are_batch_invariant(out_dtype):
    reports = row_invariance_sweep(
        lambda x: batchinv.log_softmax(x.to(DEVICE), -1, out_dtype),
        _logits(4097, torch.bfloat16),
        batch_sizes=BATCH_SIZES,
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_gradient_rows_are_batch_invariant(vocab, dtype):
    batch_sizes = BATCH_SIZES if vocab < BIG_VOCAB else (1, 3, 17)
    reports = row_invariance_sweep(
        lambda rows: _grad_x(*rows), _logits(vocab, dtype, grads=True), batch_sizes=batch_sizes
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_forward_and_gradient_are_within_tolerance_of_fp32_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (4.0 * torch.randn(5, vocab, generator=gen)).to(dtype)
    x[1, ::7] = float("-inf")  # masked logits
    grad = torch.randn(5, vocab, generator=gen)
    xd = x.detach().to(DEVICE).requires_grad_(True)
    out = batchinv.log_softmax(xd)
    out.backward(grad.to(DEVICE))
    ref_x = x.detach().float().clone().requires_grad_(True)
    ref = log_softmax_fp32(ref_x)
    ref.backward(grad)
    finite = ref.isfinite()
    assert_bitwise_equal(out.detach().cpu().isinf(), ref.detach().isinf())
    assert_within_tolerance(
        out.detach().cpu()[finite], ref.detach()[finite], op_class="logprob", dtype=dtype
    )
    assert_within_tolerance(xd.grad.cpu(), ref_x.grad, op_class="logprob", kind="grad")


@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float16))
def test_low_precision_output_is_within_tolerance(out_dtype):
    gen = torch.Generator().manual_seed(2)
    x = (4.0 * torch.randn(7, 32000, generator=gen)).to(torch.bfloat16)
    out = batchinv.log_softmax(x.to(DEVICE), -1, out_dtype)
    assert out.dtype == out_dtype
    assert_within_tolerance(
        out.float().cpu(), log_softmax_fp32(x), op_class="logprob", dtype=out_dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (4097, 32000, BIG_VOCAB))
@pytest.mark.parametrize("budget", (0, 4096, 40 * 1024))
def test_bits_do_not_depend_on_where_the_row_is_cached(vocab, dtype, budget, monkeypatch):
    # The shared-memory tier's size follows the device; a budget of 0 re-reads everything
    # beyond the register tier from global memory.  The bits must not change.
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = (4.0 * torch.randn(3, vocab, device=DEVICE, generator=gen)).to(dtype)
    grad = torch.randn(3, vocab, device=DEVICE, generator=gen)
    out = batchinv.log_softmax(x)
    grad_x = _grad_x(x, grad)
    monkeypatch.setattr(gpu_log_softmax, "_shared_budget", lambda index, threads, static: budget)
    assert_bitwise_equal(batchinv.log_softmax(x), out)
    assert_bitwise_equal(_grad_x(x, grad), grad_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (8, 111, 4096, 4104))
@pytest.mark.parametrize("offset", (1, 3, 8))
def test_misaligned_and_strided_inputs_give_the_same_bits(vocab, dtype, offset):
    rows = 5
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    storage = (4.0 * torch.randn(rows * (vocab + 8) + 16, device=DEVICE, generator=gen)).to(dtype)
    shifted = storage[offset : offset + rows * vocab].view(rows, vocab)
    strided = storage[: rows * (vocab + 8)].view(rows, vocab + 8)[:, offset : offset + vocab]
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    for x in (shifted, strided):
        assert_bitwise_equal(batchinv.log_softmax(x), batchinv.log_softmax(x.contiguous()))
        assert_bitwise_equal(_grad_x(x, grad), _grad_x(x.contiguous(), grad))


def test_all_minus_inf_rows_are_minus_inf_with_zero_gradient():
    x = torch.randn(4, 4097, device=DEVICE)
    x[2] = float("-inf")
    out = batchinv.log_softmax(x)
    assert bool((out[2] == float("-inf")).all())
    assert bool(out[[0, 1, 3]].isfinite().all())
    grad_x = _grad_x(x, torch.randn(4, 4097, device=DEVICE))
    assert_bitwise_equal(grad_x[2], torch.zeros(4097, device=DEVICE))
    assert bool(grad_x.isfinite().all())


def test_nan_and_inf_rows_do_not_leak_into_their_neighbours():
    x = torch.randn(5, BIG_VOCAB, device=DEVICE).bfloat16()
    alone = batchinv.log_softmax(x[2:3])
    x[1, 17] = float("nan")
    x[3, 5] = float("inf")
    out = batchinv.log_softmax(x)
    assert_bitwise_equal(out[2:3], alone)
    assert bool(out[1].isnan().all()) and bool(out[3].isnan().all())  # as the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (5, 1024, 4097, BIG_VOCAB))
def test_every_output_element_is_written(vocab, dtype):
    rows = 3
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(rows, vocab, device=DEVICE, generator=gen).to(dtype)
    expected = batchinv.log_softmax(x)
    poisoned = torch.full((rows, vocab), float("nan"), device=DEVICE)
    out, lse = gpu_log_softmax.forward(x)
    assert_bitwise_equal(out, expected)
    threads = gpu_log_softmax.threads_for(vocab, dtype, torch.float32)
    # the one-CTA kernel with the T the op uses (the same bits in either form)
    kernel = gpu_log_softmax.kernel_for(
        "log_softmax",
        f"log_softmax_forward_{gpu_log_softmax._SUFFIX[dtype]}_f32_t{threads}",
        x.device,
    )
    smem_groups, shared = gpu_log_softmax._tiering(kernel, x.device, vocab, threads, dtype)
    lse_out = torch.full((rows,), float("nan"), device=DEVICE)
    gpu_log_softmax.launch(
        kernel,
        x.device,
        grid=(rows,),
        block=(threads,),
        args=(poisoned, lse_out, x, rows, vocab, vocab, smem_groups),
        shared_mem=shared,
    )
    assert not bool(poisoned.isnan().any()) and not bool(lse_out.isnan().any())
    assert_bitwise_equal(poisoned, expected)
    assert_bitwise_equal(lse_out, lse)
    grad = torch.randn(rows, vocab, device=DEVICE)
    expected_grad = gpu_log_softmax.backward(grad, x, lse)
    grad_x = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
    _launch_one_cta_backward(grad_x, grad, x, lse)
    assert not bool(grad_x.isnan().any())
    assert_bitwise_equal(grad_x, expected_grad)


def _launch_one_cta_backward(grad_x, grad, x, lse):
    """The one-CTA backward kernel with the T the op uses (``block_threads`` of it: 1024 for
    T = 2048), launched directly (the same bits in either form)."""
    rows, vocab = x.shape
    threads = gpu_log_softmax.threads_for(vocab, x.dtype, grad.dtype, backward=True)
    suffix = f"{gpu_log_softmax._SUFFIX[x.dtype]}_{gpu_log_softmax._SUFFIX[grad.dtype]}"
    kernel = gpu_log_softmax.kernel_for(
        "log_softmax", f"log_softmax_backward_{suffix}_t{threads}", x.device
    )
    block = gpu_log_softmax.block_threads(threads)
    smem_groups, shared = gpu_log_softmax._tiering(kernel, x.device, vocab, block, grad.dtype)
    gpu_log_softmax.launch(
        kernel,
        x.device,
        grid=(rows,),
        block=(block,),
        args=(grad_x, grad, x, lse, rows, vocab, x.stride(0), smem_groups),
        shared_mem=shared,
    )


def test_zero_rows_and_inputs_not_mutated():
    assert batchinv.log_softmax(torch.empty(0, 7, device=DEVICE)).shape == (0, 7)
    x = torch.randn(3, 111, device=DEVICE).bfloat16()
    before = x.clone()
    batchinv.log_softmax(x)
    assert_bitwise_equal(x, before)


def test_bad_input_raises_errors_that_name_the_argument():
    x = torch.randn(3, 11, device=DEVICE)
    with pytest.raises(ValueError, match="dim must be the last dimension"):
        batchinv.log_softmax(x, 0)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        batchinv.log_softmax(x, -1, torch.float64)
    with pytest.raises(ValueError, match="x.shape\\[-1\\] must be >= 1"):
        batchinv.log_softmax(torch.empty(3, 0, device=DEVICE))
    with pytest.raises(TypeError, match="x must have dtype"):
        batchinv.log_softmax(x.double())
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        batchinv.log_softmax(x, chunk_size=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (4096, BIG_VOCAB))
def test_inference_path_gives_the_bits_of_the_autograd_path(vocab, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    x = (4.0 * torch.randn(3, vocab, device=DEVICE, generator=gen)).to(dtype)
    with torch.no_grad():
        expected = batchinv.log_softmax(x)
    got = batchinv.log_softmax(x.detach().clone().requires_grad_(True))
    assert_bitwise_equal(got.detach(), expected)


# The Hopper form (a row split over a thread-block cluster, kept in shared memory) must give
# the bits of the one-CTA form with the same block size; it runs on sm_90 GPUs only.
CLUSTER_VOCABS = (4104, 32000, 40008, BIG_VOCAB)


def _require_cluster_form():
    index = torch.cuda.current_device()
    if not gpu_log_softmax._cluster_capable(index):
        pytest.skip("the cluster form needs an sm_90 GPU and a build with sm_90a")


def _forward_and_grad(x, grad, out_dtype=torch.float32):
    out, lse = gpu_log_softmax.forward(x, out_dtype)
    grad_x = gpu_log_softmax.backward(grad.to(out_dtype), x, lse)
    return out, lse, grad_x


def test_cluster_form_is_chosen_where_it_was_measured_faster():
    # The cases of LONG_ROW_THREADS at V = 151936 take the Hopper form with their T (for
    # T = 1024, 8 CTAs of 128 threads for 2-byte cached rows, 16 of 64 for 4-byte ones; for
    # T = 2048, 16 of 128); T follows V and the dtypes only.  Other cases keep the one-CTA form's
    # T and form.
    _require_cluster_form()
    device = torch.device(DEVICE)
    f32, bf16 = torch.float32, torch.bfloat16
    table = gpu_log_softmax.LONG_ROW_THREADS
    assert table, "the Hopper form is used somewhere"
    for (direction, dtype, out_dtype), threads in table.items():
        backward = direction == "backward"
        cached = out_dtype if backward else dtype
        assert gpu_log_softmax.threads_for(BIG_VOCAB, dtype, out_dtype, backward=backward) == (
            threads
        )
        x = torch.zeros(2, BIG_VOCAB, dtype=dtype, device=DEVICE)
        other = torch.zeros(2, BIG_VOCAB, dtype=out_dtype, device=DEVICE)
        suffix = f"{gpu_log_softmax._SUFFIX[dtype]}_{gpu_log_softmax._SUFFIX[out_dtype]}"
        plan = gpu_log_softmax._cluster_plan(
            direction, suffix, device, BIG_VOCAB, (threads, threads), cached, (x, other), 2
        )
        assert plan is not None, (direction, dtype, out_dtype)
        assert plan[1] == gpu_log_softmax.cluster_shape(threads, cached)[0]
    one_cta = gpu_log_softmax.LARGE_ROW_THREADS
    assert gpu_log_softmax.threads_for(BIG_VOCAB, bf16, bf16) == one_cta
    assert gpu_log_softmax.threads_for(32000, bf16, f32) == one_cta
    x = torch.zeros(2, BIG_VOCAB, dtype=bf16, device=DEVICE)
    out = torch.empty(2, BIG_VOCAB, device=DEVICE)
    # a misaligned row start does not take the cluster kernel (the one-CTA form runs with the
    # same T)
    shifted = torch.zeros(2 * BIG_VOCAB + 8, dtype=bf16, device=DEVICE)[1:][: 2 * BIG_VOCAB]
    shifted = shifted.view(2, -1)
    plan = gpu_log_softmax._cluster_plan(
        "forward", "bf16_f32", device, BIG_VOCAB, (1024, 1024), bf16, (shifted, out), 2
    )
    assert plan is None
    # a T other than this case's long-row T is the one-CTA form's
    plan = gpu_log_softmax._cluster_plan(
        "forward", "bf16_f32", device, BIG_VOCAB, (1024, None), bf16, (x, out), 2
    )
    assert plan is None
    assert gpu_log_softmax.forward_path(x) == "cluster x8 T1024"
    assert gpu_log_softmax.forward_path(x.float()) == "cluster x16 T1024"
    assert gpu_log_softmax.backward_path(x) == "cluster x16 T2048"
    assert gpu_log_softmax.backward_path(x.half()) == "cluster x16 T2048"
    assert gpu_log_softmax.backward_path(x.float()) == "cluster x16 T1024"
    assert gpu_log_softmax.backward_path(x, bf16) == "cluster x8 T1024"
    assert gpu_log_softmax.backward_path(shifted) == "one-cta T2048"


def _force_cluster_form(monkeypatch, threads: int, shape: tuple[int, int] | None = None) -> None:
    monkeypatch.setattr(gpu_log_softmax, "LARGE_ROW_THREADS", threads)
    monkeypatch.setattr(gpu_log_softmax, "_long_row_threads", lambda *args: threads)
    if shape is not None:
        shapes = {**gpu_log_softmax.CLUSTER_SHAPE, (threads, 2): shape, (threads, 4): shape}
        monkeypatch.setattr(gpu_log_softmax, "CLUSTER_SHAPE", shapes)


# Every compiled cluster shape (each has a one-CTA counterpart: T <= 1024).
SAME_TREE_SHAPES = tuple(
    (ctas * cta_threads, (ctas, cta_threads))
    for ctas, cta_threads in sorted(gpu_log_softmax.CLUSTER_SHAPES)
)


@pytest.mark.parametrize("threads, shape", SAME_TREE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", CLUSTER_VOCABS)
def test_cluster_form_gives_the_bits_of_the_one_cta_form(vocab, dtype, threads, shape, monkeypatch):
    _require_cluster_form()
    _force_cluster_form(monkeypatch, threads, shape)
    assert gpu_log_softmax.threads_for(vocab, dtype) == threads
    gen = torch.Generator(device=DEVICE).manual_seed(21)
    x = (4.0 * torch.randn(6, vocab, device=DEVICE, generator=gen)).to(dtype)
    x[1, ::5] = float("-inf")  # masked logits
    x[3] = float("-inf")  # a row with no distribution
    x[4, -1] = 80.0  # the maximum in the last group of the row
    grad = torch.randn(6, vocab, device=DEVICE, generator=gen)
    for out_dtype in (torch.float32, torch.bfloat16):
        cluster = _forward_and_grad(x, grad, out_dtype)
        monkeypatch.setattr(gpu_log_softmax, "USE_CLUSTER", False)
        one_cta = _forward_and_grad(x, grad, out_dtype)
        monkeypatch.setattr(gpu_log_softmax, "USE_CLUSTER", True)
        for got, expected in zip(cluster, one_cta, strict=True):
            assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("threads", gpu_log_softmax.CLUSTER_THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (4104, BIG_VOCAB))
def test_cluster_form_writes_every_output_element(vocab, dtype, threads, monkeypatch):
    _require_cluster_form()
    _force_cluster_form(monkeypatch, threads)
    rows = 3
    gen = torch.Generator(device=DEVICE).manual_seed(22)
    x = torch.randn(rows, vocab, device=DEVICE, generator=gen).to(dtype)
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    out, lse, grad_x = _forward_and_grad(x, grad)
    poisoned = torch.full((rows, vocab), float("nan"), device=DEVICE)
    lse_out = torch.full((rows,), float("nan"), device=DEVICE)
    gpu_log_softmax._forward_into(poisoned, lse_out, x)
    assert_bitwise_equal(poisoned, out)
    assert_bitwise_equal(lse_out, lse)
    poisoned_grad = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
    gpu_log_softmax._backward_into(poisoned_grad, grad, x, lse)
    assert_bitwise_equal(poisoned_grad, grad_x)


def test_a_card_without_the_cluster_form_gets_the_same_bits(monkeypatch):
    # What an A100 (or any card without the sm_90a cluster form) runs: the one-CTA kernel with
    # the same T, chosen without looking at the card.  Every long-row case, forward and backward.
    _require_cluster_form()
    gen = torch.Generator(device=DEVICE).manual_seed(25)
    table = gpu_log_softmax.LONG_ROW_THREADS
    for (direction, dtype, out_dtype), _ in table.items():
        x = (4.0 * torch.randn(3, BIG_VOCAB, device=DEVICE, generator=gen)).to(dtype)
        x[1, ::9] = float("-inf")
        grad = torch.randn(3, BIG_VOCAB, device=DEVICE, generator=gen)
        hopper = _forward_and_grad(x, grad, out_dtype)
        if direction == "forward":  # forward_path names the forward's form only
            assert gpu_log_softmax.forward_path(x, out_dtype).startswith("cluster")
        assert gpu_log_softmax.backward_path(x, out_dtype).startswith("cluster") or (
            ("backward", dtype, out_dtype) not in table
        )
        with monkeypatch.context() as m:
            m.setattr(gpu_log_softmax, "_cluster_capable", lambda index: False)
            assert gpu_log_softmax.forward_path(x, out_dtype).startswith("one-cta")
            assert gpu_log_softmax.backward_path(x, out_dtype).startswith("one-cta")
            other_card = _forward_and_grad(x, grad, out_dtype)
        for got, expected in zip(other_card, hopper, strict=True):
            assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("offset", (1, 3))
def test_misaligned_long_rows_give_the_same_bits(offset):
    # misaligned rows cannot take the cluster form: the one-CTA form with the same T runs
    _require_cluster_form()
    rows, vocab = 3, BIG_VOCAB
    gen = torch.Generator(device=DEVICE).manual_seed(24)
    storage = 4.0 * torch.randn(rows * (vocab + 8) + 16, device=DEVICE, generator=gen)
    storage = storage.to(torch.bfloat16)
    shifted = storage[offset : offset + rows * vocab].view(rows, vocab)
    strided = storage[: rows * (vocab + 8)].view(rows, vocab + 8)[:, offset : offset + vocab]
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    for x in (shifted, strided):
        before = x.clone()
        got = _forward_and_grad(x, grad)
        expected = _forward_and_grad(x.contiguous(), grad)
        for a, b in zip(got, expected, strict=True):
            assert_bitwise_equal(a, b)
        assert_bitwise_equal(x, before)  # the input is not modified


# T = 2048 (the backward with fp32 dy): the 16 x 128 cluster on sm_90a, elsewhere one CTA of 1024
# threads each playing two threads of the tree.  The two must give the same bits, and the tree
# must meet the op's contract like any other.  WIDE_VOCABS: one segment per CTA, a few, and
# Qwen3's vocabulary; rows shorter than LONG_ROW_BYTES are forced to T = 2048.
WIDE = gpu_log_softmax.WIDE_THREADS
WIDE_VOCABS = (4104, 40008, BIG_VOCAB)


def _force_wide_backward(monkeypatch) -> None:
    """Every backward with fp32 dy and V % 8 == 0 past the 128-thread rows takes T = 2048 (the
    forward keeps its own T)."""
    original = gpu_log_softmax._long_row_threads

    def wide(vocab, dtype, out_dtype, backward):
        if backward and out_dtype == torch.float32 and vocab % gpu_log_softmax.GROUP == 0:
            return WIDE
        return original(vocab, dtype, out_dtype, backward)

    monkeypatch.setattr(gpu_log_softmax, "_long_row_threads", wide)


def _wide_rows(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (4.0 * torch.randn(rows, vocab, device=DEVICE, generator=gen)).to(dtype)
    x[1, ::5] = float("-inf")  # masked logits
    x[3] = float("-inf")  # a row with no distribution
    x[4, -1] = 80.0  # the maximum in the last group of the row
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    return x, grad


def _wide_grad(x, grad, lse, form: str, monkeypatch):
    """The backward in ``form`` ("cluster" or "one-cta"), checked to be the one that ran."""
    with monkeypatch.context() as m:
        m.setattr(gpu_log_softmax, "USE_CLUSTER", form == "cluster")
        assert gpu_log_softmax.backward_path(x) == (
            f"cluster x16 T{WIDE}" if form == "cluster" else f"one-cta T{WIDE}"
        )
        return gpu_log_softmax.backward(grad, x, lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", WIDE_VOCABS)
def test_wide_backward_one_cta_form_gives_the_bits_of_the_cluster_form(vocab, dtype, monkeypatch):
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    assert gpu_log_softmax.threads_for(vocab, dtype, torch.float32, backward=True) == WIDE
    x, grad = _wide_rows(6, vocab, dtype, seed=31)
    _, lse = gpu_log_softmax.forward(x)
    cluster = _wide_grad(x, grad, lse, "cluster", monkeypatch)
    one_cta = _wide_grad(x, grad, lse, "one-cta", monkeypatch)
    assert_bitwise_equal(one_cta, cluster)
    assert bool((cluster[3] == 0).all())  # the row with no distribution
    # the one-CTA form whatever share of the row stays on chip (a budget of 0 re-reads all but
    # the register tier; 40 KiB holds one fp32 group per thread of the 1024)
    for budget in (0, 40 * 1024):
        with monkeypatch.context() as m:
            m.setattr(gpu_log_softmax, "_shared_budget", lambda *args, budget=budget: budget)
            assert_bitwise_equal(_wide_grad(x, grad, lse, "one-cta", monkeypatch), cluster)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", WIDE_VOCABS)
def test_wide_backward_writes_every_output_element(vocab, dtype, monkeypatch):
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    rows = 5
    x, grad = _wide_rows(rows, vocab, dtype, seed=32)
    _, lse = gpu_log_softmax.forward(x)
    expected = gpu_log_softmax.backward(grad, x, lse)
    for form in ("cluster", "one-cta"):
        with monkeypatch.context() as m:
            m.setattr(gpu_log_softmax, "USE_CLUSTER", form == "cluster")
            poisoned = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
            gpu_log_softmax._backward_into(poisoned, grad, x, lse)
            assert not bool(poisoned.isnan().any()), form
            assert_bitwise_equal(poisoned, expected)
    poisoned = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
    _launch_one_cta_backward(poisoned, grad, x, lse)  # the t2048 kernel itself
    assert not bool(poisoned.isnan().any())
    assert_bitwise_equal(poisoned, expected)


@pytest.mark.parametrize("form", ("cluster", "one-cta"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", WIDE_VOCABS)
def test_wide_backward_rows_are_batch_invariant(vocab, dtype, form, monkeypatch):
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    monkeypatch.setattr(gpu_log_softmax, "USE_CLUSTER", form == "cluster")
    assert gpu_log_softmax.backward_path(torch.zeros(1, vocab, dtype=dtype, device=DEVICE)) == (
        f"cluster x16 T{WIDE}" if form == "cluster" else f"one-cta T{WIDE}"
    )
    reports = row_invariance_sweep(
        lambda rows: _grad_x(*rows), _logits(vocab, dtype, grads=True), batch_sizes=(1, 3, 17)
    )
    assert_no_drift(reports)


@pytest.mark.parametrize("form", ("cluster", "one-cta"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (4104, BIG_VOCAB))
def test_wide_backward_is_within_tolerance_of_fp32_reference(vocab, dtype, form, monkeypatch):
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    gen = torch.Generator().manual_seed(33)
    x = (4.0 * torch.randn(5, vocab, generator=gen)).to(dtype)
    x[1, ::7] = float("-inf")  # masked logits
    x[2] = float("-inf")  # a row with no distribution
    grad = torch.randn(5, vocab, generator=gen)
    xd = x.to(DEVICE)
    _, lse = gpu_log_softmax.forward(xd)
    grad_x = _wide_grad(xd, grad.to(DEVICE), lse, form, monkeypatch).cpu()
    ref_x = x.float().clone().requires_grad_(True)
    log_softmax_fp32(ref_x).backward(grad)
    assert bool((grad_x[2] == 0).all())
    assert_within_tolerance(grad_x, ref_x.grad, op_class="logprob", kind="grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", (1, 3))
def test_wide_backward_misaligned_rows_give_the_bits_of_the_cluster_form(
    dtype, offset, monkeypatch
):
    # misaligned rows cannot take the cluster form: the one-CTA T = 2048 kernel runs instead
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    rows, vocab = 3, BIG_VOCAB
    gen = torch.Generator(device=DEVICE).manual_seed(34)
    storage = (4.0 * torch.randn(rows * (vocab + 8) + 16, device=DEVICE, generator=gen)).to(dtype)
    shifted = storage[offset : offset + rows * vocab].view(rows, vocab)
    strided = storage[: rows * (vocab + 8)].view(rows, vocab + 8)[:, offset : offset + vocab]
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    for x in (shifted, strided):
        aligned = x.clone()  # a fresh allocation: contiguous and 16-byte aligned
        _, lse = gpu_log_softmax.forward(aligned)
        assert gpu_log_softmax.backward_path(x) == f"one-cta T{WIDE}"
        got = gpu_log_softmax.backward(grad, x, lse)
        expected = _wide_grad(aligned, grad, lse, "cluster", monkeypatch)
        assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", WIDE_VOCABS)
def test_wide_clusters_looping_over_rows_give_the_bits_of_the_one_cta_form(
    vocab, dtype, monkeypatch
):
    # the 16 x 128 exchange (each CTA's warps first, then the CTAs) over many rows per cluster
    _require_cluster_form()
    _force_wide_backward(monkeypatch)
    rows = 7
    x, grad = _wide_rows(rows, vocab, dtype, seed=35)
    _, lse = gpu_log_softmax.forward(x)
    expected = _wide_grad(x, grad, lse, "one-cta", monkeypatch)
    assert gpu_log_softmax.backward_path(x) == f"cluster x16 T{WIDE}"
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CASES", None)  # every case loops
    for clusters in (1, 2, 3):
        monkeypatch.setattr(gpu_log_softmax, "MAX_CLUSTERS", clusters)
        poisoned = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
        gpu_log_softmax._backward_into(poisoned, grad, x, lse)
        assert_bitwise_equal(poisoned, expected)


# The Hopper form launches at most as many clusters as fit and each loops over rows, refilling
# its shared memory with its next row while it finishes the current one.  Capping the clusters
# gives each one many rows (and its mbarriers many phases): the bits must be those of one
# cluster per row, every element written.
@pytest.mark.parametrize("threads", gpu_log_softmax.CLUSTER_THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (4104, 40008, BIG_VOCAB))
def test_clusters_looping_over_rows_give_the_bits_of_one_cluster_per_row(
    vocab, dtype, threads, monkeypatch
):
    _require_cluster_form()
    _force_cluster_form(monkeypatch, threads)
    rows = 7
    gen = torch.Generator(device=DEVICE).manual_seed(25)
    x = (4.0 * torch.randn(rows, vocab, device=DEVICE, generator=gen)).to(dtype)
    x[1, ::5] = float("-inf")  # masked logits
    x[3] = float("-inf")  # a row with no distribution
    x[5, -1] = 80.0  # the maximum in the last group of the row
    grad = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CLUSTERS", False)
    expected = _forward_and_grad(x, grad)
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CLUSTERS", True)
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CASES", None)  # every case loops
    for clusters in (1, 2, 3):
        monkeypatch.setattr(gpu_log_softmax, "MAX_CLUSTERS", clusters)
        for got, want in zip(_forward_and_grad(x, grad), expected, strict=True):
            assert_bitwise_equal(got, want)
        poisoned = torch.full((rows, vocab), float("nan"), device=DEVICE)
        lse_out = torch.full((rows,), float("nan"), device=DEVICE)
        gpu_log_softmax._forward_into(poisoned, lse_out, x)
        assert_bitwise_equal(poisoned, expected[0])
        assert_bitwise_equal(lse_out, expected[1])
        poisoned_grad = torch.full((rows, vocab), float("nan"), dtype=dtype, device=DEVICE)
        gpu_log_softmax._backward_into(poisoned_grad, grad, x, expected[1])
        assert_bitwise_equal(poisoned_grad, expected[2])


def test_persistent_grid_is_capped_by_the_resident_clusters(monkeypatch):
    # At most the resident clusters (or MAX_CLUSTERS), never more than one per row; cases outside
    # PERSISTENT_CASES (None: every case) get one cluster per row.
    count = gpu_log_softmax._cluster_count
    fwd, bwd = ("forward", "bf16_f32"), ("backward", "bf16_f32")
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CASES", None)
    monkeypatch.setattr(gpu_log_softmax, "MAX_CLUSTERS", None)
    assert count(4096, 82, fwd) == 82 and count(5, 82, fwd) == 5
    monkeypatch.setattr(gpu_log_softmax, "MAX_CLUSTERS", 3)
    assert count(4096, 82, fwd) == 3 and count(2, 82, fwd) == 2
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CASES", frozenset({bwd}))
    assert count(4096, 82, bwd) == 3 and count(4096, 82, fwd) == 4096
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CLUSTERS", False)
    assert count(4096, 82, bwd) == 4096


# At the benchmark's size every resident cluster loops over ~50 rows under full memory load: an
# earlier version whose refills raced with the last reads of the slots passed the small test above
# and differed here (backward).  Bits must equal one cluster per row.
@pytest.mark.parametrize(
    "dtype, out_dtype",
    (
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ),
)
def test_clusters_looping_over_rows_at_full_load(dtype, out_dtype, monkeypatch):
    _require_cluster_form()
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CASES", None)  # every case loops
    rows = 4096
    gen = torch.Generator(device=DEVICE).manual_seed(26)
    x = (4.0 * torch.randn(rows, BIG_VOCAB, device=DEVICE, generator=gen)).to(dtype)
    grad = torch.randn(rows, BIG_VOCAB, device=DEVICE, generator=gen).to(out_dtype)
    got = _forward_and_grad(x, grad, out_dtype)
    monkeypatch.setattr(gpu_log_softmax, "PERSISTENT_CLUSTERS", False)
    expected = _forward_and_grad(x, grad, out_dtype)
    for a, b in zip(got, expected, strict=True):
        assert_bitwise_equal(a, b)
