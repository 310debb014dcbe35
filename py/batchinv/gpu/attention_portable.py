"""Attention forward from a portable kernel: HIP's ``attention``, ``attention_varlen`` and
``attention_with_kv_cache`` (``kernels_cu/attention_portable.cu``: one CTA per query row and
head, 128-key blocks and 2048-key splits at absolute positions, merged left to right with
attention.cu's shared functions; no tensor cores or matrix cores), with gradients from the
portable backward (``batchinv.gpu.attention_backward_portable``).

The entry points are CUDA's (``batchinv.gpu.attention``: the same validation, layouts, KV-cache
append and output shapes) with this module's ``run`` for the canonical-layout forward (through
``_AttentionPortable`` when a gradient is wanted) and ``backward_rows`` for the custom ops'
saved backward.  ``attention_with_kv_cache`` is inference only, as on CUDA.  A row's bits do
not depend on the batch, its position in it or the other rows; they are not the CUDA kernels'
bits (another order inside a block).

Nothing here asks which backend the device has: the CUDA build holds the same kernel, so these
functions run on an NVIDIA GPU too, which is how the tests run HIP's arithmetic
(tests/gpu/test_portable_cuda.py).  Never run on AMD hardware (docs/amd.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_cache import host_index_copies
from ..runtime import kernel_for, launch
from ..validation import check_kv_cache_attention_args, check_length_values, check_seqlens_new
from . import attention as gpu
from . import attention_backward_portable

_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16"}
_LOG2E = 1.4426950408889634
_BLOCK_THREADS = 128  # kBlockKeys: one thread per key of a block, per output column
_MAX_GRID_YZ = 65535


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: gpu.Layout,
    causal: bool,
    scale: float,
    prefill_zero: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(out [Tq, Hq, d], lse [Hq, Tq] fp32)`` on attention.cu's canonical layout; rows of no
    sequence get 0 / -inf when ``prefill_zero``."""
    gpu.check_dtypes_and_head_dim(q, k, v)
    # The kernel reads elements one at a time: any row and head strides, unit stride along d.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    if prefill_zero:
        out = q.new_zeros((tq, hq, d))
        lse = q.new_full((hq, tq), float("-inf"), dtype=torch.float32)
    else:
        out = q.new_empty((tq, hq, d))
        lse = q.new_empty((hq, tq), dtype=torch.float32)
    if tq == 0 or layout.batch == 0 or layout.max_q_len == 0:
        return out, lse
    if layout.batch > _MAX_GRID_YZ or hq > _MAX_GRID_YZ:
        raise ValueError(
            f"attention launch too large: {layout.batch} sequences x {hq} heads "
            f"(at most {_MAX_GRID_YZ} each)"
        )
    launch(
        kernel_for("attention_portable", f"attn_portable_{_SUFFIX[q.dtype]}", q.device),
        q.device,
        grid=(layout.max_q_len, hq, layout.batch),
        block=(_BLOCK_THREADS,),
        args=(
            q,
            k,
            v,
            out,
            lse,
            *layout.pointers,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            tq,
            hq,
            hkv,
            d,
            int(causal),
            float(scale) * _LOG2E,
        ),
    )
    return out, lse


def backward_rows(q, k, v, out, lse, grad_out, layout: gpu.Layout, causal: bool, scale: float):
    """``(dq, dk, dv)`` by the portable backward kernels; ``gpu.backward_rows``'s arguments."""
    return attention_backward_portable.backward(q, k, v, out, lse, grad_out, layout, causal, scale)


class _AttentionPortable(torch.autograd.Function):
    """The portable forward on the canonical layout; backward by the portable kernels from the
    saved ``(out, lse)``, on the forward's layout (checked once, reused without a host sync)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: gpu.Layout, causal: bool, scale: float, prefill_zero: bool):
        out, lse = forward(q, k, v, layout, causal, scale, prefill_zero)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        ctx.causal = causal
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_rows(q, k, v, out, lse, grad_out, ctx.layout, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


def run(q, k, v, layout: gpu.Layout, causal: bool, scale: float, prefill_zero: bool, **tuning):
    """The ``run`` the CUDA entry points take: the portable forward, through
    ``_AttentionPortable`` when a gradient is wanted; no tuning."""
    if tuning:
        raise ValueError(f"the portable attention has no tuning options, got {sorted(tuning)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _AttentionPortable.apply(q, k, v, layout, causal, scale, prefill_zero)
    return forward(q, k, v, layout, causal, scale, prefill_zero)


def attention(q, k, v, *, seqlens_q, seqlens_k, **options):
    """The registry's ``attention`` on HIP (arguments checked by the op)."""
    lengths = check_length_values(q, k, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    gpu.check_dtypes_and_head_dim(q, k, v)
    host = {"seqlens_q": lengths.seqlens_q, "seqlens_k": lengths.seqlens_k}
    return gpu.attention(q, k, v, **host, run=run, **options)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """The registry's ``attention_varlen`` on HIP (arguments checked by the op)."""
    lengths = check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    gpu.check_dtypes_and_head_dim(q, k, v)
    cu_q, cu_k = lengths.cu_seqlens_q, lengths.cu_seqlens_k
    return gpu.attention_varlen(q, k, v, cu_q, cu_k, run=run, **options)


# The custom ops' backward on HIP (the registry's ``<op>.saved_backward``): the length values
# are checked again (the op saved the caller's tensors, which may have been edited since), then
# CUDA's entry with the portable kernels, hence the eager autograd's bits.


def attention_saved_backward(grad_out, q, k, v, out, lse, *, seqlens_q, seqlens_k, **options):
    """The registry's ``attention.saved_backward`` on HIP."""
    lengths = check_length_values(q, k, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    host = {"seqlens_q": lengths.seqlens_q, "seqlens_k": lengths.seqlens_k}
    return gpu.attention_saved_backward(
        grad_out, q, k, v, out, lse, **host, **options, backward=backward_rows
    )


def attention_varlen_saved_backward(
    grad_out, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, **options
):
    """The registry's ``attention_varlen.saved_backward`` on HIP."""
    lengths = check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    host = {"cu_seqlens_q": lengths.cu_seqlens_q, "cu_seqlens_k": lengths.cu_seqlens_k}
    return gpu.attention_varlen_saved_backward(
        grad_out, q, k, v, out, lse, **host, **options, backward=backward_rows
    )


def attention_with_kv_cache(
    q, k_new, v_new, cache, seq_ids, *, seqlens_new, causal, softmax_scale, return_lse
):
    """The registry's ``attention_with_kv_cache`` on HIP: every check before the append, as on
    CUDA (one host sync when ``seq_ids`` or ``seqlens_new`` is on the GPU); inference only."""
    check_kv_cache_attention_args(
        q, k_new, v_new, cache, seqlens_new=seqlens_new, causal=causal, softmax_scale=softmax_scale
    )
    seq_ids, seqlens_new = host_index_copies(seq_ids=seq_ids, seqlens_new=seqlens_new)
    check_seqlens_new(seqlens_new, q.shape[1])
    gpu.check_dtypes_and_head_dim(q, k_new, v_new)
    gpu.scale_of(softmax_scale, q.shape[-1])  # a bad scale raises before the append
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_new, v_new)):
        raise RuntimeError(
            "attention_with_kv_cache on HIP is inference-only: call it under torch.no_grad() "
            "or with inputs that do not require grad"
        )
    return gpu.attention_with_kv_cache(
        q,
        k_new,
        v_new,
        cache,
        seq_ids,
        seqlens_new,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        run=run,
    )
