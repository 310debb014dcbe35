"""CPU checks of the HIP entries of ``lm_head`` and ``token_logprobs`` (no AMD GPU exists for
this project: docs/amd.md).

A ROCm build of torch is pretended (``torch.version.hip`` set).  ``lm_head`` must dispatch to
linear's portable loop.  ``token_logprobs`` runs its host code for real with every launch
handed to a CPU emulation of the kernel it names (the definitions in
``kernels_cu/token_logprobs_portable.cu`` and ``token_logprobs_finalize``, in plain fp32
torch): that checks the launch geometry, strides, offsets and the chunk loops against the
strict reference, not the kernels' bits (tests/gpu/test_portable_cuda.py runs the kernels).
"""

from __future__ import annotations

import pytest
import torch

import batchinv
from batchinv import registry
from batchinv.contract import assert_bitwise_equal, assert_within_tolerance
from batchinv.gpu import linear as gpu_linear
from batchinv.gpu import token_logprobs as gpu_token_logprobs
from batchinv.gpu import token_logprobs_portable as portable
from batchinv.ops import lm_head as lm_head_op
from batchinv.ops import token_logprobs as token_logprobs_op
from batchinv.reference.token_logprobs import token_logprobs_fp32

IGNORE = -100
TILE = 256


@pytest.fixture
def rocm(monkeypatch):
    """A ROCm build of torch whose CUDA-only token_logprobs steps raise."""
    monkeypatch.setattr(torch.version, "hip", "6.2")

    def cuda_only(*args, **kwargs):
        raise AssertionError("token_logprobs asked for a CUDA-only path on HIP")

    for name in ("uses_hopper", "tensor_map_2d", "allow_dynamic_shared"):
        monkeypatch.setattr(gpu_token_logprobs, name, cuda_only)


def test_lm_head_and_token_logprobs_have_hip_entries(rocm):
    device = torch.device("cuda", 0)
    assert registry.lookup("lm_head", device) is lm_head_op.checked_linear
    assert registry.lookup("token_logprobs", device) is portable.token_logprobs
    assert registry.lookup("token_logprobs.saving_forward", device) is portable.saving_forward
    assert registry.lookup("token_logprobs.saved_backward", device) is portable.saved_backward
    ops = registry.registered_ops()
    for op in ("lm_head", "lm_head.fp32", "token_logprobs", "token_logprobs.saving_forward"):
        assert "hip" in ops[op], op


def test_lm_head_on_hip_is_one_launch_of_the_portable_loop(rocm, monkeypatch):
    recorded = []
    monkeypatch.setattr(gpu_linear, "kernel_for", lambda module, kernel, device: (module, kernel))
    monkeypatch.setattr(gpu_linear, "launch", lambda kernel, *a, **k: recorded.append(kernel))
    # CPU tensors stand for a ROCm build's GPU tensors: every lookup answers for HIP.
    monkeypatch.setattr(registry, "backend_of", lambda device: "hip")
    hidden = torch.randn(5, 16, dtype=torch.bfloat16)
    weight = torch.randn(300, 16, dtype=torch.bfloat16)
    logits = batchinv.lm_head(hidden, weight)
    assert logits.shape == (5, 300) and recorded == [("linear", "linear_simt_bf16")]


# ---- a CPU emulation of the portable kernels -------------------------------------------------


def _operand(t: torch.Tensor, rows: int, k: int, row_stride: int, k_stride: int) -> torch.Tensor:
    return torch.as_strided(t, (rows, k), (row_stride, k_stride), t.storage_offset()).float()


def _gemm(kind, args):
    a, a_row, a_k, b, b_row, b_k, out, ld, m, n, k = args
    result = _operand(a, m, k, a_row, a_k) @ _operand(b, n, k, b_row, b_k).t()
    target = torch.as_strided(out, (m, n), (ld, 1), out.storage_offset())
    if kind == "acc":
        target.add_(result)
    else:
        target.copy_(result.to(out.dtype))


def _tile_states(args):
    logits, ld, rows, width, offset, targets, target_logit, part_m, part_l, part_s, tiles = args
    assert ld == logits.stride(0) and offset % TILE == 0
    for local in range(-(-width // TILE)):
        begin, end = local * TILE, min(local * TILE + TILE, width)
        z = logits[:rows, begin:end]
        m = z.max(dim=1).values + 0.0
        weight = torch.exp(z - m[:, None])
        part_m[:rows, offset // TILE + local] = m
        part_l[:rows, offset // TILE + local] = weight.sum(1)
        if not isinstance(part_s, int):
            part_s[:rows, offset // TILE + local] = (weight * (z - m[:, None])).sum(1)
        for row in range(rows):
            column = int(targets[row]) - offset
            if begin <= column < end:
                target_logit[row] = z[row, column - begin]


def _grad_logits(args):
    logits, ld, targets, lse, g, g_ent, entropy, grad_z, stride, width, offset = args
    rows = targets.numel()
    z = logits[:rows, :width]
    log_p = z - lse[:, None]
    p = torch.exp(log_p)
    columns = torch.arange(width) + offset
    onehot = (columns[None, :] == targets[:, None].long()).float()
    d = g[:, None] * (onehot - p)
    if not isinstance(g_ent, int):
        d = d - g_ent[:, None] * (p * (log_p + entropy[:, None]))
    d = torch.where(targets[:, None] >= 0, d, 0.0)
    grad_z.view(-1)[: rows * stride].view(rows, stride)[:, :width] = d.to(grad_z.dtype)


def _finalize(args):
    part_m, part_l, part_s, target_logit, targets, tiles, rows, logprob, lse, entropy = args
    m = part_m.max(dim=1).values
    scale = torch.exp(part_m - m[:, None])
    total = (part_l * scale).sum(1)
    row_lse = m + torch.log(total)
    valid = targets >= 0
    lse.copy_(row_lse)
    logprob.copy_(torch.where(valid, target_logit - row_lse, 0.0))
    if not isinstance(entropy, int):
        s = (scale * (part_s + (part_m - m[:, None]) * part_l)).sum(1)
        entropy.copy_(torch.where(valid, torch.log(total) - s / total, 0.0))


def _mark_targets(args):
    ids, _count, vocab, ignore_index, targets32, first_bad = args
    marked, bad = gpu_token_logprobs.mark_targets_reference(ids, ignore_index, vocab)
    targets32.copy_(marked)
    if bad.any() and (first_bad.item() == -1 or bad.nonzero()[0, 0] < first_bad.item()):
        first_bad.fill_(int(bad.nonzero()[0, 0]))


@pytest.fixture
def emulated(rocm, monkeypatch):
    """Runs the portable host code with each launch emulated on the CPU; records the names."""
    names = []

    def kernel_for(module, kernel, device):
        assert module in ("token_logprobs_portable", "token_logprobs"), module
        return kernel

    def launch(kernel, device, grid, block, args, **options):
        names.append(kernel)
        if kernel.startswith("token_logprobs_gemm_"):
            _gemm(kernel.split("_")[3], args)
            assert block == (16, 16)
            assert grid == (-(-args[8] // 16), -(-args[9] // 16))
        elif kernel == "token_logprobs_tile_states":
            _tile_states(args)
        elif kernel.startswith("token_logprobs_grad_logits_"):
            _grad_logits(args)
        elif kernel == "token_logprobs_finalize":
            _finalize(args)
        elif kernel.startswith("token_logprobs_mark_targets_"):
            _mark_targets(args)
        else:
            raise AssertionError(f"unexpected kernel {kernel}")

    # The portable route's kernels launch from its module; the forward's target marking and
    # finalize from the frame it shares with the CUDA route (gpu_token_logprobs.run_forward).
    for module in (portable, gpu_token_logprobs):
        monkeypatch.setattr(module, "kernel_for", kernel_for)
        monkeypatch.setattr(module, "launch", launch)
    return names


def _inputs(tokens, hidden_size, vocab, dtype, seed=0, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.25).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    for position in ignored:
        targets[position] = IGNORE
    return hidden, weight, targets


def _portable_grads(hidden, weight, targets, g, g_ent):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    out = portable.token_logprobs(
        hidden, weight, targets, IGNORE, vocab_chunk=1, return_entropy=True
    )
    torch.autograd.backward(out, (g, g_ent))
    return out, hidden.grad, weight.grad


# (tokens, H, V): one tile short, forward chunks with a short last one (LOGITS_CHUNK = 4096),
# backward chunks with a short last one (GRAD_VOCAB_CHUNK = 4096).
@pytest.mark.parametrize("case", [(3, 16, 200), (7, 24, 9000)])
def test_emulated_portable_path_matches_the_reference(emulated, case):
    dtype = torch.bfloat16
    hidden, weight, targets = _inputs(*case, dtype, ignored=(1,))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(case[0], generator=gen)
    g_ent = torch.randn(case[0], generator=gen)
    (logprob, entropy), grad_h, grad_w = _portable_grads(hidden, weight, targets, g, g_ent)

    ref_hidden = hidden.clone().requires_grad_(True)
    ref_weight = weight.clone().requires_grad_(True)
    ref = token_logprobs_fp32(ref_hidden, ref_weight, targets, IGNORE, return_entropy=True)
    torch.autograd.backward(ref, (g, g_ent))
    opts = {"op_class": "logprob", "dtype": dtype}
    assert_within_tolerance(logprob, ref[0].detach(), name="logprob", **opts)
    assert_within_tolerance(entropy, ref[1].detach(), name="entropy", **opts)
    grad_opts = {**opts, "kind": "grad"}
    assert_within_tolerance(grad_h.float(), ref_hidden.grad.float(), name="d_hidden", **grad_opts)
    assert_within_tolerance(grad_w.float(), ref_weight.grad.float(), name="d_weight", **grad_opts)
    assert_bitwise_equal(logprob[1:2], torch.zeros(1))
    assert_bitwise_equal(grad_h[1:2], torch.zeros_like(grad_h[1:2]))
    vocab = case[2]
    forward_chunks = -(-vocab // portable.LOGITS_CHUNK)
    backward_chunks = -(-vocab // gpu_token_logprobs.GRAD_VOCAB_CHUNK)
    assert emulated.count("token_logprobs_tile_states") == forward_chunks
    assert emulated.count("token_logprobs_grad_logits_bf16") == backward_chunks
    assert emulated.count("token_logprobs_gemm_store_bf16") == backward_chunks


def test_emulated_bad_target_raises_and_names_its_position(emulated):
    hidden, weight, targets = _inputs(4, 16, 300, torch.float16)
    targets[2] = 300
    with pytest.raises(IndexError, match="target_ids"):
        portable.forward(hidden, weight, targets, IGNORE, False)


def test_portable_path_checks_inputs_like_the_cuda_path(rocm):
    hidden, weight, targets = _inputs(4, 12, 300, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        portable.forward(hidden, weight, targets, IGNORE, False)
    hidden, weight, targets = _inputs(4, 16, 300, torch.float32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        portable.forward(hidden, weight, targets, IGNORE, False)


def test_the_op_reaches_the_portable_entry_on_hip(emulated, monkeypatch):
    # batchinv.token_logprobs on a CPU tensor takes the cpu entry; pretend its device is a GPU
    # of the ROCm build, so the op's own checks and lookup run and land on the hip entry.
    monkeypatch.setattr(registry, "backend_of", lambda device: "hip")
    hidden, weight, targets = _inputs(3, 16, 200, torch.bfloat16)
    logprob = batchinv.token_logprobs(hidden, weight, targets, IGNORE)
    expected = portable.token_logprobs(
        hidden, weight, targets, IGNORE, vocab_chunk=1, return_entropy=False
    )
    assert_bitwise_equal(logprob, expected)
    assert "token_logprobs_finalize" in emulated
    assert token_logprobs_op.portable is portable
