"""Token logprobs from portable kernels: HIP's ``token_logprobs`` (``kernels_cu/
token_logprobs_portable.cu``, no tensor cores, TMA or matrix cores).

Forward, per vocabulary chunk of ``LOGITS_CHUNK`` columns: fp32 logits ``[T, chunk]`` from the
portable GEMM (one FMA chain per logit over H in increasing order, the SIMT loop of
``linear_simt_*``), then each 256-column tile's online log-sum-exp state, the tiles of the
CUDA forward; ``token_logprobs_finalize`` (``kernels_cu/token_logprobs.cu``, the CUDA
forward's own) merges the states in its fixed order.  The chunk only bounds the logits'
memory: every tile state is the same whatever the chunk.  Backward, per chunk of
``GRAD_VOCAB_CHUNK`` columns (the CUDA backward's): the logits again, ``d_z`` rounded once to
the input dtype, ``d_hidden += d_z · W_chunk`` (one chain per chunk, one fp32 add) and
``d_W_chunk = d_zᵀ · hidden`` (tokens in increasing order, rounded once), the transposed
operands read through strides.

Each token's chain never involves another row, so a row's results do not depend on the
batch; d_W is bitwise identical run to run.  The bits are not the CUDA kernels' (another
GEMM order); both are within the contract's tolerance of the reference.

Nothing here asks which backend the device has: the CUDA build holds the same kernels, so
``token_logprobs`` below (the registry's ``hip`` entry) runs on an NVIDIA GPU too, which is
how the tests run HIP's arithmetic (tests/gpu/test_portable_cuda.py).  Never run on AMD
hardware (docs/amd.md).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from ..runtime import kernel_for, launch
from .token_logprobs import (
    GRAD_VOCAB_CHUNK,
    VOCAB_TILE,
    _weight_gradient_rows,
    check_gpu_inputs,
    registry_entries,
    run_forward,
)

LOGITS_CHUNK = 16 * VOCAB_TILE  # forward logits per step: memory only, never the bits
_GEMM_TILE = 16  # kGemmTile: outputs per CTA side
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_MODULE = "token_logprobs_portable"


def _gemm(kind: str, a, a_strides, b, b_strides, out: Tensor, m: int, n: int, k: int) -> None:
    """``out[m, n] (=, +=, = rounded) sum_k A(m, k) · B(n, k)``: ``kind`` is ``f32``, ``acc`` or
    ``store``; ``x_strides`` are (row, k) element strides of each operand; ``out`` row-major."""
    if m == 0 or n == 0:
        return
    launch(
        kernel_for(_MODULE, f"token_logprobs_gemm_{kind}_{_DTYPE_NAMES[a.dtype]}", a.device),
        a.device,
        grid=(-(-m // _GEMM_TILE), -(-n // _GEMM_TILE)),
        block=(_GEMM_TILE, _GEMM_TILE),
        args=(a, *a_strides, b, *b_strides, out, out.stride(0), m, n, k),
    )


def forward(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    with_entropy: bool,
    check_targets: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``(logprob [T], lse [T], entropy [T] or None, targets32 [T])``, fp32, flat over tokens:
    ``batchinv.gpu.token_logprobs.forward``'s contract on the portable kernels."""
    check_gpu_inputs(hidden, weight)
    return run_forward(
        _launch_partials, hidden, weight, target_ids, ignore_index, with_entropy, check_targets
    )


def _launch_partials(
    rows: Tensor,
    weight: Tensor,
    targets32: Tensor,
    target_logit: Tensor,
    part_m: Tensor,
    part_l: Tensor,
    part_s: Tensor | None,
) -> None:
    """``run_forward``'s ``partials`` on the portable kernels: per chunk of ``LOGITS_CHUNK``
    columns, the fp32 logits, then their tiles' states."""
    rows = rows.contiguous()
    tokens, hidden_size = rows.shape
    vocab, tiles, device = weight.shape[0], part_m.shape[1], rows.device
    chunk = min(LOGITS_CHUNK, tiles * VOCAB_TILE)
    logits = torch.empty(tokens, chunk, dtype=torch.float32, device=device)
    states = kernel_for(_MODULE, "token_logprobs_tile_states", device)
    for start in range(0, vocab, chunk):
        width = min(chunk, vocab - start)
        _gemm(
            "f32",
            rows,
            (hidden_size, 1),
            weight[start : start + width],
            (hidden_size, 1),
            logits,
            tokens,
            width,
            hidden_size,
        )
        chunk_tiles = -(-width // VOCAB_TILE)
        launch(
            states,
            device,
            grid=(-(-tokens * chunk_tiles // 128),),
            block=(128,),
            args=(
                logits,
                chunk,
                tokens,
                width,
                start,
                targets32,
                target_logit,
                part_m,
                part_l,
                0 if part_s is None else part_s,
                tiles,
            ),
        )


def backward(
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    targets32: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    needs_hidden: bool,
    needs_weight: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(d_hidden like hidden, d_weight like weight)``, either None when not needed:
    ``batchinv.gpu.token_logprobs.backward``'s contract on the portable kernels."""
    vocab, hidden_size = weight.shape
    rows = hidden.reshape(-1, hidden_size).contiguous()
    tokens, device, dtype = rows.shape[0], hidden.device, hidden.dtype
    if tokens == 0 or not (needs_hidden or needs_weight):
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        return grad_hidden, torch.zeros_like(weight) if needs_weight else None
    # An ignored row's d_z is 0, but 0 * inf is NaN: d_W reads such rows zeroed.
    weight_rows = _weight_gradient_rows(rows, targets32) if needs_weight else None
    grad_hidden = (
        torch.zeros(tokens, hidden_size, dtype=torch.float32, device=device)
        if needs_hidden
        else None
    )
    grad_weight = torch.empty_like(weight) if needs_weight else None  # every row is written
    zero = torch.zeros(tokens, dtype=torch.float32, device=device)
    g = zero if grad_logprob is None else grad_logprob.reshape(-1).float().contiguous()
    g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).float().contiguous()
    chunk = min(GRAD_VOCAB_CHUNK, vocab)
    logits = torch.empty(tokens, chunk, dtype=torch.float32, device=device)
    grad_z = torch.empty(tokens, chunk, dtype=dtype, device=device)
    grad_logits = kernel_for(_MODULE, f"token_logprobs_grad_logits_{_DTYPE_NAMES[dtype]}", device)
    for start in range(0, vocab, chunk):
        width = min(chunk, vocab - start)
        weight_chunk = weight[start : start + width]
        _gemm(
            "f32",
            rows,
            (hidden_size, 1),
            weight_chunk,
            (hidden_size, 1),
            logits,
            tokens,
            width,
            hidden_size,
        )
        launch(
            grad_logits,
            device,
            grid=(tokens, -(-width // 256)),
            block=(256,),
            args=(
                logits,
                chunk,
                targets32,
                lse,
                g,
                0 if g_ent is None else g_ent,
                0 if g_ent is None else entropy,
                grad_z,
                chunk,
                width,
                start,
            ),
        )
        if needs_hidden:
            # A(t, v) = d_z[t, v]; B(h, v) = W_chunk[v, h]: W read along its columns.
            _gemm(
                "acc",
                grad_z,
                (chunk, 1),
                weight_chunk,
                (1, hidden_size),
                grad_hidden,
                tokens,
                hidden_size,
                width,
            )
        if needs_weight:
            # A(v, t) = d_z[t, v]; B(h, t) = hidden[t, h]: the tokens are the reduction.
            _gemm(
                "store",
                grad_z,
                (1, chunk),
                weight_rows,
                (1, hidden_size),
                grad_weight[start : start + width],
                width,
                hidden_size,
                tokens,
            )
    del logits, grad_z, weight_rows
    if grad_hidden is None:
        return None, grad_weight
    return grad_hidden.to(dtype).reshape(hidden.shape), grad_weight


# The registry's hip entries: the autograd op and the custom op's saving forward and saved
# backward, shared with the CUDA route.
token_logprobs, saving_forward, saved_backward = registry_entries(sys.modules[__name__])
