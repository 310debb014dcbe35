"""``batchinv.attention`` and friends: padded, varlen and KV-cache attention.

Each public function validates its arguments once and dispatches through the registry.  The
values of the length tensors (``seqlens``, ``cu_seqlens``) are read and checked once, by the
implementation the call dispatches to: the CPU reference in its own check, the CUDA backend
here, with one host sync for GPU lengths and none for CPU lengths, handing the host copies
that passed to ``batchinv.gpu.attention``, which builds its layout from them.  The CPU
implementation is the strict reference (``batchinv.reference.attention``, fixed 128-key
blocks at absolute positions); on CUDA, ``kernels_cu/attention.cu`` (mma.sync, fixed 128-key
blocks and 2048-key splits at absolute positions; decode equals prefill bit for bit) with its
own autograd (below); on HIP, the portable forward ``kernels_cu/attention_portable.cu`` and
backward ``kernels_cu/attention_backward_portable.cu`` with their own autograd
(``batchinv.gpu.attention_portable``).  There is no fallback from a GPU tensor to the
reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import registry
from ..gpu import attention as gpu
from ..gpu import attention_portable as portable
from ..kv_cache import KVCache, host_index_copies
from ..reference import attention as reference
from ..validation import (
    check_attention_args,
    check_kv_cache_attention_args,
    check_length_values,
    check_seqlens_new,
    check_tensor,
)
from ._checked import CheckedCalls
from ._custom_op import CustomOp

# The custom ops' arguments after q, k, v (their schemas below), which are also the keyword
# arguments of the registry's ``<op>.saved_backward``.
_PADDED_OPTIONS = ("causal", "softmax_scale", "seqlens_q", "seqlens_k", "key_padding_mask")
_VARLEN_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "causal", "softmax_scale")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Padded attention: ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]`` -> ``[B, Sq, Hq, d]``.

    GQA when ``Hkv`` divides ``Hq``.  Queries are the last tokens of their sequence
    (bottom-right causal alignment).  ``seqlens_q/k [B]`` give per-sequence lengths (right
    padding; padded query rows give zeros and LSE ``-inf``), ``key_padding_mask [B, Sk]``
    (True = keep) drops keys.  With ``return_lse``: ``(out, lse [B, Hq, Sq] fp32)``.
    The full definition and its fixed order: ``batchinv.reference.attention``.
    """
    options = (causal, softmax_scale, seqlens_q, seqlens_k, key_padding_mask)
    if torch.compiler.is_compiling():  # one opaque node (the custom ops below)
        out, lse = torch.ops.batchinv.attention(q, k, v, *options)
        return (out, lse) if return_lse else out
    signature = None
    if seqlens_q is None and seqlens_k is None and key_padding_mask is None:
        signature = _signature(q, k, v, causal, softmax_scale)
    if signature is not None:
        if not (return_lse or _needs_grad(q, k, v)):
            run = _PADDED_WITHOUT_LENGTHS.lookup(signature, q, k, v, causal, softmax_scale)
            return run(q, k, v, causal, softmax_scale)
        run = _PADDED_FULL.lookup(signature, q, k, v, *options)
    else:
        _check_padded(q, k, v, *options)
        run = registry.lookup("attention", q.device)
    keywords = dict(zip(_PADDED_OPTIONS, options, strict=True))
    return run(q, k, v, **keywords, return_lse=return_lse)


# A padded call without length or mask tensors reads nothing but metadata and plain values in
# its checks, so they run once per signature (``_checked``); calls with lengths check them
# every time (their values are read).  Two tables: ``_PADDED_WITHOUT_LENGTHS`` for calls that
# need neither a gradient nor the lse (inference), ``_PADDED_FULL`` for the others.


def _signature(q, k, v, causal, softmax_scale) -> tuple | None:
    """What ``_check_padded`` reads when no length or mask tensor is given, or None where the
    full checks must run (arguments of other types than the op takes)."""
    if causal.__class__ is not bool or softmax_scale.__class__ not in (float, type(None)):
        return None
    try:
        return (
            q.__class__, q.shape, q.dtype, q.device,
            k.__class__, k.shape, k.dtype, k.device,
            v.__class__, v.shape, v.dtype, v.device,
            causal, softmax_scale,
        )  # fmt: skip
    except AttributeError:
        return None


def _resolve_padded(q, k, v, *options):
    _check_padded(q, k, v, *options)
    return registry.lookup("attention", q.device)


_PADDED_FULL = CheckedCalls(_resolve_padded)


def _needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


# A call that needs neither a gradient nor the lse runs, where the registry names the CUDA
# implementation, batchinv.gpu.attention's eager no-grad path (launch plans kept per shape),
# elsewhere the registry's implementation itself: asking the registry for the op keeps a
# swapped or missing implementation what the call sees.


def _resolve_padded_no_grad(q, k, v, causal, softmax_scale):
    _check_padded(q, k, v, causal, softmax_scale, None, None, None)
    run = registry.lookup("attention", q.device)
    if run is _gpu_attention:
        return gpu.attention_no_grad

    def no_grad(q, k, v, causal, softmax_scale):
        return run(q, k, v, causal=causal, softmax_scale=softmax_scale, **_NO_LENGTHS)

    return no_grad


_NO_LENGTHS = {"seqlens_q": None, "seqlens_k": None, "key_padding_mask": None}
_PADDED_WITHOUT_LENGTHS = CheckedCalls(_resolve_padded_no_grad)


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Packed attention: ``q [Tq, Hq, d]``, ``k, v [Tk, Hkv, d]`` -> ``[Tq, Hq, d]``.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  With ``return_lse``: ``(out, lse [Hq, Tq])``.
    """
    if torch.compiler.is_compiling():  # cu_seqlens values are checked when the op runs
        args = (cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        out, lse = torch.ops.batchinv.attention_varlen(q, k, v, *args)
        return (out, lse) if return_lse else out
    if not return_lse:
        signature = _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        if signature is not None and not _needs_grad(q, k, v):
            args = (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
            return _VARLEN_NO_GRAD.lookup(signature, *args)(*args, signature[-1])
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return registry.lookup("attention_varlen", q.device)(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
    )


def _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    """What the checks of a varlen call read, the values of ``cu_seqlens`` included (as a
    tuple of ints, its last item), or None where they must run in full: lengths on a GPU
    (reading them is the call's one host sync either way), arguments of other types."""
    if causal.__class__ is not bool or softmax_scale.__class__ not in (float, type(None)):
        return None
    try:
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        if cu_q.device.type != "cpu" or cu_k.device.type != "cpu" or cu_q.dim() != 1:
            return None
        if cu_k.dim() != 1:
            return None
        return (
            q.__class__, q.shape, q.dtype, q.device,
            k.__class__, k.shape, k.dtype, k.device,
            v.__class__, v.shape, v.dtype, v.device,
            cu_q.__class__, cu_q.dtype, cu_k.__class__, cu_k.dtype,
            causal, softmax_scale,
            (tuple(cu_q.tolist()), tuple(cu_k.tolist())),
        )  # fmt: skip
    except AttributeError:
        return None


def _resolve_varlen_no_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    """The static and value checks of a varlen call (its signature holds the values)."""
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    run = registry.lookup("attention_varlen", q.device)
    if run is _gpu_attention_varlen:
        check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return gpu.attention_varlen_no_grad

    def no_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, lengths):
        options = {"causal": causal, "softmax_scale": softmax_scale}
        return run(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    return no_grad


_VARLEN_NO_GRAD = CheckedCalls(_resolve_varlen_no_grad)


def attention_with_kv_cache(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache: KVCache,
    seq_ids: Tensor | None = None,
    *,
    seqlens_new: Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Decode / chunked-prefill step: append ``k_new, v_new`` to ``cache``, then attend.

    ``q [n, S_new, Hq, d]`` are the newest tokens of cache slots ``seq_ids`` (default all).
    The cache is mutated (that is its job); nothing else is.  Returns what ``attention``
    returns for ``q`` against the cached keys.  On CUDA the call makes no host sync when
    ``seq_ids`` and ``seqlens_new`` are CPU tensors or None, one when either is on the GPU.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a batchinv KVCache, got {type(cache).__name__}")
    check_tensor("q", q)  # the dispatch reads q.device
    # The rest is checked by the implementation, all of it before the append (a call that
    # raises leaves the cache as it was): check_kv_cache_attention_args, then the append's
    # own checks of ids, lengths and capacity.
    return registry.lookup("attention_with_kv_cache", q.device)(
        q,
        k_new,
        v_new,
        cache,
        seq_ids,
        seqlens_new=seqlens_new,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
    )


def _check_padded(q, k, v, causal, softmax_scale, seqlens_q, seqlens_k, key_padding_mask):
    """The checks of a padded call that read no tensor values (see the module docstring)."""
    check_attention_args(
        q,
        k,
        v,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        key_padding_mask=key_padding_mask,
        softmax_scale=softmax_scale,
        causal=causal,
        check_values=False,
    )


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    """The checks of a varlen call that read no tensor values."""
    check_attention_args(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
        check_values=False,
    )


# ----------------------------------------------------------------------------- CUDA


class _AttentionGPU(torch.autograd.Function):
    """Forward on the canonical layout; backward by ``attention_backward``'s kernels."""

    @staticmethod
    def forward(ctx, q, k, v, layout: gpu.Layout, causal: bool, scale: float, prefill_zero: bool):
        out, lse = gpu.forward(q, k, v, layout, causal, scale, prefill_zero=prefill_zero)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        ctx.causal = causal
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        # The forward's layout owns its tensors and was checked before the forward ran: the
        # backward trusts it (no second range check, no host sync).
        dq, dk, dv = gpu.backward_rows(
            q, k, v, out, lse, grad_out, ctx.layout, ctx.causal, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def _run(q, k, v, layout: gpu.Layout, causal: bool, scale: float, prefill_zero: bool, **tuning):
    """The canonical-layout forward, through ``_AttentionGPU`` when a gradient is wanted."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        if tuning:
            raise ValueError("mode/warps overrides are for the no-grad path")
        q, k, v = (gpu.as_rows(t.contiguous()) for t in (q, k, v))
        return _AttentionGPU.apply(q, k, v, layout, causal, scale, prefill_zero)
    return gpu.forward(q, k, v, layout, causal, scale, prefill_zero=prefill_zero, **tuning)


# The CUDA implementations read and check the length values here (check_length_values: one
# host sync when they are on the GPU, none for CPU tensors) and hand the host copies that
# passed to batchinv.gpu.attention; what only the kernels lack (dtype, head dim, capability)
# is gpu.check_supported.  The custom ops' backward (``*_saved_backward``) checks the values
# again: the op saved the caller's length tensors, which the caller may have edited since.


def _gpu_attention(q, k, v, *, seqlens_q, seqlens_k, **options):
    lengths = check_length_values(q, k, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    gpu.check_supported(q, k, v)
    host = {"seqlens_q": lengths.seqlens_q, "seqlens_k": lengths.seqlens_k}
    return gpu.attention(q, k, v, **host, run=_run, **options)


def _gpu_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    lengths = check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    gpu.check_supported(q, k, v)
    cu_q, cu_k = lengths.cu_seqlens_q, lengths.cu_seqlens_k
    return gpu.attention_varlen(q, k, v, cu_q, cu_k, run=_run, **options)


def _gpu_attention_saved_backward(grad_out, q, k, v, out, lse, *, seqlens_q, seqlens_k, **options):
    lengths = check_length_values(q, k, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
    host = {"seqlens_q": lengths.seqlens_q, "seqlens_k": lengths.seqlens_k}
    return gpu.attention_saved_backward(grad_out, q, k, v, out, lse, **host, **options)


def _gpu_attention_varlen_saved_backward(
    grad_out, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, **options
):
    lengths = check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    host = {"cu_seqlens_q": lengths.cu_seqlens_q, "cu_seqlens_k": lengths.cu_seqlens_k}
    return gpu.attention_varlen_saved_backward(grad_out, q, k, v, out, lse, **host, **options)


def _gpu_attention_with_kv_cache(
    q, k_new, v_new, cache, seq_ids, *, seqlens_new, causal, softmax_scale, return_lse
):
    """Every check of a CUDA KV-cache call, before anything is appended; ``seq_ids`` and
    ``seqlens_new`` are read to the host together (one host sync when either is on a GPU)."""
    check_kv_cache_attention_args(
        q, k_new, v_new, cache, seqlens_new=seqlens_new, causal=causal, softmax_scale=softmax_scale
    )
    seq_ids, seqlens_new = host_index_copies(seq_ids=seq_ids, seqlens_new=seqlens_new)
    check_seqlens_new(seqlens_new, q.shape[1])
    gpu.check_supported(q, k_new, v_new)
    gpu.scale_of(softmax_scale, q.shape[-1])  # a bad scale raises before the append
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_new, v_new)):
        raise RuntimeError(
            "attention_with_kv_cache on CUDA is inference-only: call it under torch.no_grad() "
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
    )


registry.register("attention", "cpu")(reference.attention)
registry.register("attention_varlen", "cpu")(reference.attention_varlen)
registry.register("attention_with_kv_cache", "cpu")(reference.attention_with_kv_cache)
registry.register("attention", "cuda")(_gpu_attention)
registry.register("attention_varlen", "cuda")(_gpu_attention_varlen)
registry.register("attention_with_kv_cache", "cuda")(_gpu_attention_with_kv_cache)
registry.register("attention.saved_backward", "cuda")(_gpu_attention_saved_backward)
registry.register("attention_varlen.saved_backward", "cuda")(_gpu_attention_varlen_saved_backward)
registry.register("attention", "hip")(portable.attention)
registry.register("attention_varlen", "hip")(portable.attention_varlen)
registry.register("attention_with_kv_cache", "hip")(portable.attention_with_kv_cache)
registry.register("attention.saved_backward", "hip")(portable.attention_saved_backward)
registry.register("attention_varlen.saved_backward", "hip")(
    portable.attention_varlen_saved_backward
)


# ----------------------------------------------------------------------------- custom ops


def _attention_eager(q, k, v, *options):
    keywords = dict(zip(_PADDED_OPTIONS, options, strict=True))
    return attention(q, k, v, **keywords, return_lse=True)


def _attention_varlen_eager(q, k, v, *options):
    keywords = dict(zip(_VARLEN_OPTIONS, options, strict=True))
    cu_seqlens_q, cu_seqlens_k = keywords.pop("cu_seqlens_q"), keywords.pop("cu_seqlens_k")
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **keywords, return_lse=True)


def _attention_fake(q, k, v, *options):
    _check_padded(q, k, v, *options)
    batch, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, hq, sq), dtype=torch.float32)


def _attention_varlen_fake(q, k, v, *options):
    _check_varlen(q, k, v, *options)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _output_grad(grad: Tensor | None, output: Tensor) -> Tensor:
    return torch.zeros_like(output) if grad is None else grad


def _backward_of(name: str, options: tuple[str, ...]) -> Callable:
    """The backward op body of ``attention`` or ``attention_varlen``, whose arguments after
    ``q, k, v`` are the keyword ``options`` of the registry's ``<name>.saved_backward``."""

    def backward(grads, needs, outputs, *args):
        q, k, v, *rest = args
        if q.device.type == "cpu":
            return _CUSTOM_OPS[name].recompute_backward(grads, needs, outputs, *args)
        saved_backward = registry.lookup(f"{name}.saved_backward", q.device)
        grad_out = _output_grad(grads[0], outputs[0])  # the lse carries no gradient
        keywords = dict(zip(options, rest, strict=True))
        return list(saved_backward(grad_out, q, k, v, *outputs, **keywords))

    return backward


_CUSTOM_OPS = {
    "attention": CustomOp(
        "attention",
        "(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, Tensor? seqlens_q, "
        "Tensor? seqlens_k, Tensor? key_padding_mask) -> (Tensor, Tensor)",
        _attention_eager,
        _attention_fake,
        (0, 1, 2),
        backward=_backward_of("attention", _PADDED_OPTIONS),
        saves_outputs=True,
    ),
    "attention_varlen": CustomOp(
        "attention_varlen",
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, "
        "float? softmax_scale) -> (Tensor, Tensor)",
        _attention_varlen_eager,
        _attention_varlen_fake,
        (0, 1, 2),
        backward=_backward_of("attention_varlen", _VARLEN_OPTIONS),
        saves_outputs=True,
    ),
}
