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

import torch
from torch import Tensor

from ..runtime import kernel_for, launch
from .token_logprobs import (
    GRAD_VOCAB_CHUNK,
    VOCAB_TILE,
    _weight_gradient_rows,
    check_gpu_inputs,
    mark_targets,
    raise_bad_targets,
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
    vocab, hidden_size = weight.shape
    rows = hidden.reshape(-1, hidden_size).contiguous()
    tokens = rows.shape[0]
    device = hidden.device
    logprob = torch.zeros(tokens, dtype=torch.float32, device=device)
    lse = torch.zeros(tokens, dtype=torch.float32, device=device)
    entropy = torch.zeros(tokens, dtype=torch.float32, device=device) if with_entropy else None
    targets32 = torch.empty(0, dtype=torch.int32, device=device)
    if tokens == 0:
        return logprob, lse, entropy, targets32
    targets32, bad = mark_targets(target_ids, ignore_index, vocab)
    tiles = -(-vocab // VOCAB_TILE)
    part_m = torch.empty(tokens, tiles, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    part_s = torch.empty_like(part_m) if with_entropy else None
    target_logit = torch.zeros(tokens, dtype=torch.float32, device=device)
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
    del logits
    launch(
        kernel_for("token_logprobs", "token_logprobs_finalize", device),
        device,
        grid=(-(-tokens // 4),),
        block=(128,),
        args=(
            part_m,
            part_l,
            0 if part_s is None else part_s,
            target_logit,
            targets32,
            tiles,
            tokens,
            logprob,
            lse,
            0 if entropy is None else entropy,
        ),
    )
    if check_targets:
        raise_bad_targets(bad, target_ids, vocab)
    return logprob, lse, entropy, targets32


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


class _TokenLogprobsPortable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head_weight, target_ids, ignore_index, with_entropy):
        logprob, lse, entropy, targets32 = forward(
            hidden, lm_head_weight, target_ids, ignore_index, with_entropy
        )
        ctx.save_for_backward(hidden, lm_head_weight, targets32, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused entropy adds no term to the gradient
        logprob = logprob.reshape(target_ids.shape)
        if with_entropy:
            return logprob, entropy.reshape(target_ids.shape)
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        hidden, lm_head_weight, targets32, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight = backward(
            grad_logprob,
            grad_entropy,
            hidden,
            lm_head_weight,
            targets32,
            lse,
            entropy,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    *,
    vocab_chunk: int,
    return_entropy: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The registry's ``token_logprobs`` on HIP (after the op's checks), differentiable in
    ``hidden`` and ``lm_head_weight``; ``vocab_chunk`` orders the CPU reference only."""
    return _TokenLogprobsPortable.apply(
        hidden, lm_head_weight, target_ids, ignore_index, bool(return_entropy)
    )


def saving_forward(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The registry's ``token_logprobs.saving_forward`` on HIP: ``(logprobs, entropy or an
    empty tensor, lse)``, each fp32 of ``target_ids.shape``; the eager forward's bits."""
    logprob, lse, entropy, _ = forward(
        hidden, lm_head_weight, target_ids, ignore_index, with_entropy
    )
    shape = target_ids.shape
    entropy = entropy.reshape(shape) if with_entropy else logprob.new_empty((0,))
    return logprob.reshape(shape), entropy, lse.reshape(shape)


def saved_backward(
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    lse: Tensor,
    entropy: Tensor | None,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """The registry's ``token_logprobs.saved_backward`` on HIP: ``(d_hidden, d_weight)`` from
    ``saving_forward``'s outputs (None where ``needs`` is False); the eager backward's bits."""
    targets32, _ = mark_targets(target_ids, ignore_index, lm_head_weight.shape[0])
    return backward(
        grad_logprob,
        grad_entropy,
        hidden,
        lm_head_weight,
        targets32,
        lse.reshape(-1),
        None if entropy is None else entropy.reshape(-1),
        needs[0],
        needs[1],
    )
