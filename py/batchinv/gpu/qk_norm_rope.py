"""q/k RMSNorm + RoPE + the KV-cache append in one launch: ``kernels_cu/qk_norm_rope.cu``.

What ``rms_norm(q)``, ``rms_norm(k)``, ``rope(q, k)`` and the two ``index_copy_`` appends of
a decode step compute, in one kernel with their bits: the norm of a head runs rms_norm.cu's
forward in the geometry ``batchinv.gpu.rms_norm.geometry`` picks for ``head_dim`` (t4 or t16
for every supported head_dim), and the rotation reads the rounded normed values with rope.cu's
table and products (both through shared headers).  Nothing here checks values on the device
or synchronises; the caller (``batchinv.static_kv_cache``) validated shapes, dtypes and
devices, and the plan's rows already point a failed step at the scratch row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import backend_of
from ..runtime import kernel_for, launch
from . import rms_norm as gpu_rms_norm
from .rope import inv_freq_on

THREADS = 128  # kThreads in kernels_cu/qk_norm_rope.cu
# rms_norm.cu's forward geometries that have a fused entry (BATCHINV_QK_NORM_ROPE_KERNELS).
GEOMETRIES = ("t4", "t16")
_MAX_GRID_X = 2**31 - 1
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_INDEX_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}


def geometry(head_dim: int, dtype: torch.dtype) -> str | None:
    """rms_norm's forward geometry for heads of ``head_dim`` elements, or None where the
    fused kernel has no entry for it (the caller then runs the unfused ops)."""
    if dtype not in _SUFFIX:
        return None
    name, _, _ = gpu_rms_norm.geometry(head_dim, dtype)
    return name if name in GEOMETRIES else None


def supports(q: Tensor) -> bool:
    """Whether the fused kernel takes heads like ``q``'s (a CUDA/HIP tensor of a geometry
    with an entry)."""
    return (
        q.device.type == "cuda"
        and backend_of(q.device) in ("cuda", "hip")
        and geometry(q.shape[-1], q.dtype) is not None
    )


def _token_heads(t: Tensor, tokens: int) -> Tensor:
    """``[tokens, heads, head_dim]`` with unit stride along head_dim (a copy only if needed)."""
    view = t.reshape(tokens, t.shape[-2], t.shape[-1])
    if view.shape[-1] > 1 and view.stride(-1) != 1:
        view = view.contiguous()
    return view


def qk_norm_rope_append(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    position_ids: Tensor,
    theta: float,
    max_position: int,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor,
    first_bad: Tensor | None = None,
) -> Tensor:
    """Returns ``rope(rms_norm(q, q_weight))`` (a new tensor of q's shape, contiguous) and
    writes ``rope(rms_norm(k, k_weight))`` and ``v`` into storage rows ``rows`` of
    ``k_cache`` / ``v_cache`` (``[storage rows, Hkv, head_dim]``, contiguous).

    ``q [..., Hq, d]``, ``k, v [..., Hkv, d]`` with the same leading shape, one token per
    entry of ``position_ids`` (int32/int64) and of ``rows`` (int64).  ``first_bad``: an int64
    ``[1]`` flag preset to -1 that receives the first token whose position is outside
    ``[0, max_position)`` (those tokens' q and k are NaN, as rope gives); None: not recorded.
    """
    head_dim = q.shape[-1]
    tokens = position_ids.numel()
    q3, k3, v3 = (_token_heads(t, tokens) for t in (q, k, v))
    q_out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out.reshape(q.shape)
    if tokens > _MAX_GRID_X:
        raise ValueError(f"position_ids has {tokens} tokens; at most {_MAX_GRID_X} are supported")
    name = geometry(head_dim, q.dtype)
    if name is None:
        raise ValueError(f"qk_norm_rope has no kernel for head_dim {head_dim} in {q.dtype}")
    positions = position_ids.reshape(-1)
    if not positions.is_contiguous():
        positions = positions.contiguous()
    rows = rows.reshape(-1)
    kernel = f"qk_norm_rope_{_SUFFIX[q.dtype]}_{name}_{_INDEX_SUFFIX[positions.dtype]}"
    launch(
        kernel_for("qk_norm_rope", kernel, q.device),
        q.device,
        grid=(tokens,),
        block=(THREADS,),
        args=(
            q_out,
            k_cache,
            v_cache,
            q3,
            k3,
            v3,
            q_weight if q_weight.is_contiguous() else q_weight.contiguous(),
            k_weight if k_weight.is_contiguous() else k_weight.contiguous(),
            positions,
            rows if rows.is_contiguous() else rows.contiguous(),
            inv_freq_on(q.device, head_dim, float(theta)),
            first_bad if first_bad is not None else 0,
            tokens,
            q3.shape[1],
            k3.shape[1],
            head_dim,
            q3.stride(0),
            q3.stride(1),
            k3.stride(0),
            k3.stride(1),
            v3.stride(0),
            v3.stride(1),
            max_position,
            float(eps),
        ),
        shared_mem=2 * (head_dim // 2) * 4,
    )
    return q_out.reshape(q.shape)
