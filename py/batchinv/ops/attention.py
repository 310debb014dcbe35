"""``batchinv.attention`` and friends: padded, varlen and KV-cache attention.

Each public function validates its arguments once and dispatches through the registry
(the values of the length tensors are read and checked by the implementation it dispatches
to, once: the reference in its own check, the CUDA backend with one host sync for GPU
lengths and none for CPU lengths, from the copies that also build its layout):
the CPU implementation is the strict reference (``batchinv.reference.attention``, fixed
128-key blocks at absolute positions); a GPU backend registers its own implementation of
the same three entry points, with its own autograd.  There is no fallback from a GPU
tensor to the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import attention as gpu
from ..kv_cache import KVCache
from ..reference import attention as reference
from ..validation import check_attention_args

registry.register("attention", "cpu")(reference.attention)
registry.register("attention_varlen", "cpu")(reference.attention_varlen)
registry.register("attention_with_kv_cache", "cpu")(reference.attention_with_kv_cache)
# CUDA: kernels_cu/attention.cu (mma.sync, fixed 128-key blocks and 2048-key splits at absolute
# positions; decode equals prefill bit for bit).  Not built for HIP.
registry.register("attention", "cuda")(gpu.attention)
registry.register("attention_varlen", "cuda")(gpu.attention_varlen)
registry.register("attention_with_kv_cache", "cuda")(gpu.attention_with_kv_cache)
# The torch.library ops' backward from saved outputs (integrations/torch_library.py).
registry.register("attention.saved_backward", "cuda")(gpu.attention_saved_backward)
registry.register("attention_varlen.saved_backward", "cuda")(gpu.attention_varlen_saved_backward)


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
    if torch.compiler.is_compiling():  # one opaque node (integrations/torch_library.py)
        args = (causal, softmax_scale, seqlens_q, seqlens_k, key_padding_mask)
        out, lse = torch.ops.batchinv.attention(q, k, v, *args)
        return (out, lse) if return_lse else out
    check_attention_args(
        q,
        k,
        v,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        key_padding_mask=key_padding_mask,
        softmax_scale=softmax_scale,
        causal=causal,
        check_values=False,  # read once by the implementation (module docstring)
    )
    return registry.lookup("attention", q.device)(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        key_padding_mask=key_padding_mask,
        return_lse=return_lse,
    )


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
    check_attention_args(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
        check_values=False,  # read once by the implementation (module docstring)
    )
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
