"""The host-light path of the public ops on CUDA (calls that need no gradient: checks once per
signature, contiguous launches with pointers passed as ints) gives the bits of the general
launch path, in every layout and in a CUDA graph, and keeps every value check."""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import rms_norm as gpu_rms_norm
from batchinv.gpu import silu_mul as gpu_silu_mul

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values contiguous and 16-byte aligned, contiguous one element past a 16-byte
    boundary (the element kernels), and as a strided view (the general path)."""
    rows, width = t.shape
    shifted = torch.empty(rows * width + 1, dtype=t.dtype, device=t.device)[1:].view(rows, width)
    shifted.copy_(t)
    strided = torch.empty(rows, width + 8, dtype=t.dtype, device=t.device)[:, :width]
    strided.copy_(t)
    return {"aligned": t, "shifted": shifted, "strided": strided}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (128, 2048, 4096, 5120, 12288))
def test_rms_norm_no_grad_gives_the_general_path_bits(dtype, hidden):
    gen = torch.Generator(device=DEVICE).manual_seed(hidden)
    x = (2 * torch.randn(5, hidden, device=DEVICE, generator=gen)).to(dtype)
    residual = torch.randn(5, hidden, device=DEVICE, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden, device=DEVICE, generator=gen)).to(dtype)
    want_y = gpu_rms_norm.run_forward(x, weight, EPS)[0]
    want_fused = gpu_rms_norm.run_forward(x, weight, EPS, residual)[:2]
    for (name, a), r in zip(_layouts(x).items(), _layouts(residual).values(), strict=True):
        with torch.no_grad():
            assert_bitwise_equal(batchinv.rms_norm(a, weight, EPS), want_y, name=name)
            got = batchinv.fused_add_rms_norm(a, r, weight, EPS)
        assert_bitwise_equal(list(got), list(want_fused), name=f"fused {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", (8, 1000, 12288))
def test_silu_mul_no_grad_gives_the_general_path_bits(dtype, inter):
    gen = torch.Generator(device=DEVICE).manual_seed(inter)
    gate, up = (3 * torch.randn(2, 3, inter, device=DEVICE, generator=gen)).to(dtype).unbind(0)
    want = gpu_silu_mul.forward(gate, up)
    gate_up = torch.cat([gate, up], dim=-1)
    for (name, g), u in zip(_layouts(gate).items(), _layouts(up).values(), strict=True):
        assert_bitwise_equal(batchinv.silu_mul(g, u), want, name=name)
    assert_bitwise_equal(batchinv.silu_mul_fused(gate_up), want, name="fused")
    assert_bitwise_equal(gpu_silu_mul.forward_fused(gate_up), want, name="fused, general path")


def test_unchecked_embedding_calls_share_a_flag_that_never_leaks_into_a_checked_call():
    weight = torch.randn(10, 64, device=DEVICE).bfloat16()
    ids = torch.tensor([[1, 2, 3], [9, 0, 4]], device=DEVICE)
    assert_bitwise_equal(batchinv.embedding(ids, weight, check_ids=False), weight[ids])
    bad = torch.tensor([1, 10, 3], device=DEVICE)
    rows = batchinv.embedding(bad, weight, check_ids=False)  # no error, a NaN row
    assert torch.isnan(rows[1]).all() and not torch.isnan(rows[[0, 2]]).any()
    assert_bitwise_equal(batchinv.embedding(ids, weight), weight[ids])  # checked: no stale flag
    with pytest.raises(IndexError, match="ids"):
        batchinv.embedding(bad, weight)


def test_no_grad_calls_replay_in_a_cuda_graph():
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(8, 4096, device=DEVICE, generator=gen).bfloat16()
    residual = torch.randn(8, 4096, device=DEVICE, generator=gen).bfloat16()
    weight = torch.randn(4096, device=DEVICE, generator=gen).bfloat16()
    gate_up = torch.randn(8, 2 * 12288, device=DEVICE, generator=gen).bfloat16()

    def step():
        y, h = batchinv.fused_add_rms_norm(x, residual, weight, EPS)
        return batchinv.rms_norm(y, weight, EPS), h, batchinv.silu_mul_fused(gate_up)

    with torch.no_grad():
        eager = [t.clone() for t in step()]
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for source in (x, residual, gate_up):
            source.normal_(generator=gen)
        graph.replay()
        new_eager = step()
    torch.cuda.synchronize()
    assert_bitwise_equal(list(captured), list(new_eager), name="replay")
    assert not all(torch.equal(a, b) for a, b in zip(eager, new_eager, strict=True))
