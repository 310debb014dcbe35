"""The CUDA embedding kernel: bitwise equal to ``weight[ids]``, safe on bad ids, same
bits through CuPy, deterministic weight gradient equal to the CPU reference."""

from __future__ import annotations

import os

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.reference.embedding import embedding_backward

pytestmark = pytest.mark.cuda

QUICK = os.environ.get("BATCHINV_QUICK") == "1"  # the sanitizer runs a smaller sweep
VOCABS = (1, 7, 1000) if QUICK else (1, 7, 1000, 151936)
HIDDENS = (1, 3, 111, 128) if QUICK else (1, 3, 111, 128, 4096, 4097)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)


def _case(vocab, hidden, dtype, id_dtype, num_ids=257, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(vocab, hidden, device="cuda", generator=gen).to(dtype)
    ids = torch.randint(0, vocab, (num_ids,), device="cuda", generator=gen).to(id_dtype)
    return ids, weight


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_forward_is_bitwise_the_gather(vocab, hidden, dtype, id_dtype):
    ids, weight = _case(vocab, hidden, dtype, id_dtype)
    out = batchinv.embedding(ids, weight)
    assert_bitwise_equal(out, weight[ids.long()])


@pytest.mark.parametrize("offset_elements", (1, 2, 3, 4, 8))
def test_misaligned_table_takes_a_narrower_path_with_the_same_bits(offset_elements):
    vocab, hidden = 50, 64
    storage = torch.randn(vocab * hidden + 16, device="cuda").bfloat16()
    weight = storage[offset_elements : offset_elements + vocab * hidden].view(vocab, hidden)
    ids = torch.randint(0, vocab, (3, 33), device="cuda")
    assert_bitwise_equal(batchinv.embedding(ids, weight), weight[ids])


def test_nan_and_signed_zero_payloads_are_copied_exactly():
    weight = torch.tensor([[0.0, -0.0], [float("nan"), float("-inf")]], device="cuda")
    weight.view(torch.int32)[1, 0] = 0x7FC00001  # a NaN with a payload
    out = batchinv.embedding(torch.tensor([1, 0, 1], device="cuda"), weight)
    assert_bitwise_equal(out, weight[[1, 0, 1]])


@pytest.mark.parametrize("bad_id", (-1, 1000, 2**40))
def test_bad_id_raises_and_the_context_survives(bad_id):
    ids, weight = _case(1000, 128, torch.bfloat16, torch.int64, num_ids=64)
    ids[37] = bad_id
    with pytest.raises(
        IndexError, match=rf"ids\[37\] = {bad_id} is outside the valid range \[0, 1000\)"
    ):
        batchinv.embedding(ids, weight)
    ids[37] = 5
    assert_bitwise_equal(batchinv.embedding(ids, weight), weight[ids])
    torch.cuda.synchronize()


def test_first_bad_position_is_reported_when_several_are_bad():
    ids, weight = _case(100, 8, torch.float32, torch.int32, num_ids=4096)
    ids[3000] = -5
    ids[100] = 100
    with pytest.raises(IndexError, match=r"ids\[100\] = 100"):
        batchinv.embedding(ids, weight)


def test_same_image_through_cupy_gives_the_same_bits(tmp_path):
    cupy = pytest.importorskip("cupy")
    from batchinv import _native

    ids, weight = _case(1000, 111, torch.bfloat16, torch.int64)
    ours = batchinv.embedding(ids, weight)
    image = tmp_path / "embedding.fatbin"
    image.write_bytes(_native.embedded_image("embedding"))
    kernel = cupy.RawModule(path=str(image)).get_function("embedding_forward_i64")
    out = torch.full_like(ours, float("nan"))
    first_bad = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    row_bytes = weight.shape[1] * weight.element_size()
    torch.cuda.synchronize()
    kernel(
        (ids.numel(), 1, 1),
        (64, 1, 1),
        (
            out.data_ptr(),
            weight.data_ptr(),
            ids.data_ptr(),
            cupy.int64(ids.numel()),
            cupy.int64(row_bytes),
            cupy.int64(weight.shape[0]),
            first_bad.data_ptr(),
        ),
    )
    cupy.cuda.runtime.deviceSynchronize()
    assert int(first_bad.item()) == -1
    assert_bitwise_equal(out, ours)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_equals_the_cpu_reference_bitwise(dtype):
    gen = torch.Generator().manual_seed(4)
    vocab, hidden, num_ids = 300, 111, 2000
    ids = torch.randint(0, vocab, (num_ids,), generator=gen)
    ids[::7] = 3  # a heavily repeated id, like a padding token
    grad = torch.randn(num_ids, hidden, generator=gen).to(dtype)
    expected = embedding_backward(ids, grad, vocab, dtype)
    weight = torch.zeros(vocab, hidden, dtype=dtype, device="cuda", requires_grad=True)
    batchinv.embedding(ids.cuda(), weight).backward(grad.cuda())
    assert_bitwise_equal(weight.grad.cpu(), expected)


def test_weight_gradient_is_bitwise_identical_run_to_run():
    ids, weight = _case(512, 4096, torch.bfloat16, torch.int64, num_ids=8192)
    ids[::3] = 0
    weight.requires_grad_(True)
    grad = torch.randn(ids.numel(), 4096, device="cuda").bfloat16()
    grads = []
    for _ in range(3):
        weight.grad = None
        batchinv.embedding(ids, weight).backward(grad)
        grads.append(weight.grad.clone())
    assert_bitwise_equal(grads[0], grads[1])
    assert_bitwise_equal(grads[0], grads[2])


def test_row_is_the_same_in_any_batch():
    ids, weight = _case(1000, 4096, torch.bfloat16, torch.int64, num_ids=33)
    probe = ids[:1]
    alone = batchinv.embedding(probe, weight)
    for batch in (3, 17, 33):
        for position in (0, batch // 2, batch - 1):
            batch_ids = ids[:batch].clone()
            batch_ids[position] = probe[0]
            row = batchinv.embedding(batch_ids, weight)[position : position + 1]
            assert_bitwise_equal(row, alone)


def test_non_contiguous_weight_is_rejected_on_gpu():
    weight = torch.randn(8, 6, device="cuda")[:, ::2]
    with pytest.raises(ValueError, match="weight must be contiguous"):
        batchinv.embedding(torch.tensor([0], device="cuda"), weight)


def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match="weight is on cuda:0 but ids is on cpu"):
        batchinv.embedding(torch.tensor([0]), torch.randn(4, 4, device="cuda"))


def test_inputs_are_not_mutated_on_gpu():
    ids, weight = _case(100, 16, torch.bfloat16, torch.int32)
    before = (ids.clone(), weight.clone())
    batchinv.embedding(ids, weight)
    assert_bitwise_equal(ids, before[0])
    assert_bitwise_equal(weight, before[1])


def test_unchecked_call_returns_nan_rows_for_bad_ids_without_reading_them():
    ids, weight = _case(100, 33, torch.bfloat16, torch.int64, num_ids=8)
    ids[2] = 100
    out = batchinv.embedding(ids, weight, check_ids=False)
    assert bool(out[2].isnan().all())
    good = torch.tensor([0, 1, 3, 4, 5, 6, 7], device="cuda")
    assert_bitwise_equal(out[good], weight[ids[good]])
