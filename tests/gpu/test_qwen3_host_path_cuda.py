"""The batchinv op table's host-path shortcuts on CUDA keep every bit and every check:

- ``batchinv.linear`` / ``batchinv.embedding`` without gradients run the kernels without an
  autograd node: the same bits as through the node;
- the table's residual add (``torch.add`` on CUDA) equals the reference's fp32 add with one
  rounding bit for bit, special values included;
- RoPE checks a forward's position ids once (one host sync per decode step for the ids of the
  embedding and one for the positions, whatever the number of layers), and a bad position or a
  position tensor written in place is still caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.host_syncs import count_host_syncs
from batchinv.models import Qwen3, Qwen3Config
from batchinv.models.qwen3 import ops as model_ops
from batchinv.reference.qwen3_chain import REFERENCE_OPS

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_without_grad_equals_the_autograd_path(rows, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    x = torch.randn(rows, 256, device=DEVICE, generator=gen).to(dtype)
    w = (torch.randn(384, 256, device=DEVICE, generator=gen) / 16).to(dtype).requires_grad_()
    through_node = batchinv.linear(x, w)
    assert through_node.grad_fn is not None
    with torch.no_grad():
        direct = batchinv.linear(x, w)
        again = batchinv.linear(x, w)  # the cached launch plan
    assert direct.grad_fn is None
    assert_bitwise_equal(direct, through_node.detach())
    assert_bitwise_equal(again, direct)


def test_embedding_without_grad_equals_the_autograd_path_and_checks_ids():
    weight = torch.randn(300, 64, device=DEVICE).bfloat16().requires_grad_()
    ids = torch.randint(0, 300, (5, 3), device=DEVICE)
    through_node = batchinv.embedding(ids, weight)
    with torch.no_grad():
        direct = batchinv.embedding(ids, weight)
        with pytest.raises(IndexError, match="ids"):
            batchinv.embedding(torch.tensor([4, 300], device=DEVICE), weight)
    assert_bitwise_equal(direct, through_node.detach())


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    values = [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.tiny / 8]
    values += [info.eps, 1.0 + info.eps, float("inf"), float("-inf"), float("nan"), 3.0e-5]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_add_equals_the_reference_bit_for_bit(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    h = (torch.randn(33, 4096, device=DEVICE, generator=gen) * 8).to(dtype)
    delta = (torch.randn(33, 4096, device=DEVICE, generator=gen) / 8).to(dtype)
    special = _special_values(dtype).to(DEVICE)
    grid_h = special[:, None].expand(-1, special.numel()).reshape(-1)
    grid_d = special[None, :].expand(special.numel(), -1).reshape(-1)
    for a, b in ((h, delta), (grid_h, grid_d), (delta, h)):
        got = model_ops.BATCHINV_OPS.residual_add(a, b)
        assert_bitwise_equal(got, REFERENCE_OPS.residual_add(a, b))


def _model(layers: int, max_position: int = 512) -> Qwen3:
    config = dataclasses.replace(
        Qwen3Config.tiny(), num_hidden_layers=layers, max_position_embeddings=max_position
    )
    return Qwen3.from_config(config, seed=0, device=DEVICE, dtype=torch.bfloat16)


@pytest.mark.parametrize("layers", [1, 3])
def test_decode_step_syncs_twice_whatever_the_layers(layers):
    model = _model(layers)
    caches = model.new_caches(4, 64)
    prompt = torch.randint(0, 512, (4, 9), device=DEVICE)
    token = torch.randint(0, 512, (4, 1), device=DEVICE)
    with torch.no_grad():
        model(prompt, caches=caches)
        syncs = count_host_syncs(lambda: model(token, caches=caches))[1]
    assert syncs == 2  # the embedding's id check and one RoPE position check


def test_decode_matches_prefill_bits_with_the_shortcuts():
    model = _model(2)
    ids = torch.randint(0, 512, (3, 12), device=DEVICE)
    caches = model.new_caches(3, 16)
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :10], caches=caches)
        steps = [model(ids[:, t : t + 1], caches=caches) for t in (10, 11)]
    assert_bitwise_equal(torch.cat(steps, dim=1), full[:, 10:])


def test_a_position_past_the_model_limit_still_raises_in_decode():
    model = _model(2, max_position=20)
    caches = model.new_caches(2, 32)
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 19), device=DEVICE), caches=caches)  # positions 0..18
        model(torch.randint(0, 512, (2, 1), device=DEVICE), caches=caches)  # position 19
        with pytest.raises(IndexError, match="position_ids"):
            model(torch.randint(0, 512, (2, 1), device=DEVICE), caches=caches)  # 20


def test_a_position_tensor_written_in_place_is_checked_again():
    q = torch.randn(2, 1, 4, 64, device=DEVICE).bfloat16()
    k = torch.randn(2, 1, 2, 64, device=DEVICE).bfloat16()
    positions = torch.tensor([[5], [9]], device=DEVICE)
    kwargs = dict(theta=10000.0, head_dim=64, max_position=16)
    first = model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)
    second = count_host_syncs(lambda: model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs))[1]
    assert second == 0  # the same unmodified tensor: not read again
    assert_bitwise_equal(model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)[0], first[0])
    positions[1, 0] = 16
    with pytest.raises(IndexError, match="position_ids"):
        model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)
    with pytest.raises(IndexError, match="position_ids"):  # a failed check is not remembered
        model_ops.BATCHINV_OPS.rope(q, k, positions, **kwargs)
