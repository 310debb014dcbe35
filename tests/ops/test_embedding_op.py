"""batchinv.embedding on CPU: the public op, the module, the registry, bad input."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.reference.embedding import EmbeddingReference, embedding_backward, embedding_fp32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", (torch.int32, torch.int64))
def test_forward_is_the_gather(dtype, id_dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 111, generator=gen).to(dtype)
    ids = torch.randint(0, 37, (3, 17), generator=gen, dtype=torch.int64).to(id_dtype)
    out = batchinv.embedding(ids, weight)
    assert out.shape == (3, 17, 111) and out.dtype == dtype
    assert_bitwise_equal(out, weight[ids.long()])


def test_fp32_path_upcasts_rows_not_the_table():
    weight = torch.randn(5, 4).bfloat16()
    out = embedding_fp32(torch.tensor([4, 0]), weight)
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, weight[[4, 0]].float())


def test_weight_gradient_sums_in_position_order_in_fp32():
    # Crafted so the order and the precision of the sum matter: in bf16,
    # 1 + 2^-9 + 2^-9 rounds differently when accumulated in bf16 than in fp32.
    weight = torch.zeros(3, 1, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.tensor([2, 0, 2, 2])
    grad = torch.tensor([[1.0], [5.0], [2.0**-9], [2.0**-9]], dtype=torch.bfloat16)
    batchinv.embedding(ids, weight).backward(grad)
    expected = torch.tensor([[5.0], [0.0], [(1.0 + 2.0**-9 + 2.0**-9)]]).bfloat16()
    assert_bitwise_equal(weight.grad, expected)


def test_weight_gradient_matches_float64_sum_and_repeats_bitwise():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 9, (400,), generator=gen)  # many repeats
    grad = torch.randn(400, 33, generator=gen)
    first = embedding_backward(ids, grad, 9, torch.float32)
    second = embedding_backward(ids, grad.clone(), 9, torch.float32)
    assert_bitwise_equal(first, second)
    exact = torch.zeros(9, 33, dtype=torch.float64).index_add_(0, ids, grad.double())
    assert torch.allclose(first.double(), exact, rtol=1e-5, atol=1e-5)


def test_weight_gradient_ignores_deterministic_flag():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 5, (64,), generator=gen)
    grad = torch.randn(64, 8, generator=gen).bfloat16()
    results = []
    for flag in (False, True):
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(flag)
        try:
            results.append(embedding_backward(ids, grad, 5, torch.bfloat16))
        finally:
            torch.use_deterministic_algorithms(previous)
    assert_bitwise_equal(results[0], results[1])


def test_row_of_an_id_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 16, generator=gen).bfloat16()
    probe = torch.tensor([7])
    alone = batchinv.embedding(probe, weight)
    for batch in (3, 17, 33):
        ids = torch.randint(0, 50, (batch,), generator=gen)
        for position in (0, batch // 2, batch - 1):
            ids[position] = 7
            assert_bitwise_equal(batchinv.embedding(ids, weight)[position : position + 1], alone)


def test_nn_module_and_reference_module_agree():
    weight = torch.randn(11, 6)
    module = batchinv.nn.Embedding.from_pretrained(weight.clone(), freeze=False)
    reference = EmbeddingReference(weight.clone())
    ids = torch.tensor([[1, 10], [0, 1]])
    assert_bitwise_equal(module(ids), reference(ids))
    assert reference.forward_fp32(ids).dtype == torch.float32
    module(ids).sum().backward()
    reference(ids).sum().backward()
    assert_bitwise_equal(module.weight.grad, reference.weight.grad)


def test_inputs_are_not_mutated():
    weight = torch.randn(6, 3, requires_grad=True)
    ids = torch.tensor([5, 0, 5])
    weight_before, ids_before = weight.detach().clone(), ids.clone()
    batchinv.embedding(ids, weight).sum().backward()
    assert_bitwise_equal(weight.detach(), weight_before)
    assert_bitwise_equal(ids, ids_before)


@pytest.mark.parametrize("bad_id", (-1, 6, 10**6))
def test_out_of_range_id_names_its_position(bad_id):
    ids = torch.tensor([[0, 1], [2, bad_id]])
    with pytest.raises(
        IndexError, match=rf"ids\[1, 1\] = {bad_id} is outside the valid range \[0, 6\)"
    ):
        batchinv.embedding(ids, torch.randn(6, 3))


@pytest.mark.parametrize(
    "ids, weight, error, message",
    [
        (
            torch.tensor([0.0]),
            torch.randn(3, 2),
            TypeError,
            r"ids must have dtype in \(int32, int64\)",
        ),
        (torch.tensor([0]), torch.randn(3, 2).double(), TypeError, r"weight must have dtype in"),
        (torch.tensor([0]), torch.randn(3), ValueError, r"weight must have 2 dimensions"),
        ([0], torch.randn(3, 2), TypeError, r"ids must be a torch.Tensor, got list"),
        (torch.tensor([0]), torch.randn(0, 2), ValueError, r"at least one row"),
    ],
)
def test_bad_input_is_a_clear_error(ids, weight, error, message):
    with pytest.raises(error, match=message):
        batchinv.embedding(ids, weight)


def test_empty_ids_give_an_empty_result():
    out = batchinv.embedding(torch.zeros(0, 3, dtype=torch.int64), torch.randn(4, 5))
    assert out.shape == (0, 3, 5)


def test_registry_has_no_silent_fallback():
    with pytest.raises(batchinv.registry.UnknownOpError, match="unknown op 'nope'"):
        batchinv.registry.lookup("nope", torch.device("cpu"))
    with pytest.raises(
        batchinv.registry.BackendNotImplementedError, match="no backend for device type 'meta'"
    ):
        batchinv.registry.lookup("embedding.forward", torch.device("meta"))
    with pytest.raises(ValueError, match="already has a cpu implementation"):
        batchinv.registry.register("embedding.forward", "cpu")(lambda *a: None)
    assert batchinv.registry.registered_ops()["embedding.forward"] == ("cpu", "cuda", "hip")
