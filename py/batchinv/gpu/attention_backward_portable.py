"""Attention backward from a portable kernel: HIP's gradients of ``attention`` and
``attention_varlen`` (``kernels_cu/attention_backward_portable.cu``; no tensor cores or matrix
cores, no atomics).

``backward(q, k, v, out, lse, grad_out, layout, causal, scale) -> (dq, dk, dv)`` on the forward's
canonical layout (``q, out, grad_out [Tq, Hq, d]``, ``k, v [Tk, Hkv, d]``, ``lse [Hq, Tq]`` fp32
natural log) of a ``batchinv.gpu.attention.Layout`` whose lengths were checked: the same
arguments as ``batchinv.gpu.attention.backward_rows``, so the entry points take either.  Three
launches: ``delta = rowsum(dO * O)`` (one thread per query row and head), dQ (one CTA per query
row and head, keys in increasing order) and dK/dV (one CTA per key and kv head, the group's
heads, then the queries that see the key, in increasing order).  Every gradient element is one
thread's fixed chain, so the bits do not depend on the batch and repeat run to run; they are
not ``attention_backward.cu``'s (mma k16 chains there).  Rows covered by no sequence get zero
gradients.  No host synchronisation.

Like the portable forward, nothing here asks which backend the device has: the CUDA build
holds the same kernels, which is how tests/gpu/test_portable_cuda.py runs them.  Never run on
AMD hardware (docs/amd.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime import kernel_for, launch

_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16"}
THREADS = 128  # kThreads: rows per delta CTA; keys or queries per block; columns (d <= 128)
_MAX_GRID_YZ = 65535
_MODULE = "attention_backward_portable"


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    layout,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the input dtype (fp32 sums); see the module docstring.  The forward
    checked dtypes, head dim and lengths; strided views are copied to dense rows here."""
    q, k, v, out, grad_out = (t.contiguous() for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    batch = layout.batch
    if batch == 0 or (layout.max_q_len == 0 and layout.max_k_len == 0):
        return dq, dk, dv
    if batch > _MAX_GRID_YZ or hq > _MAX_GRID_YZ:
        raise ValueError(
            f"attention backward launch too large: {batch} sequences x {hq} heads "
            f"(at most {_MAX_GRID_YZ} each)"
        )
    delta = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    args = (
        *(q, k, v, out, grad_out, lse, delta),
        *layout.pointers,
        *(dq, dk, dv),
        *(tq, hq, hkv, d, int(causal), float(scale)),
    )
    suffix = _SUFFIX[q.dtype]

    def run(stage: str, grid: tuple[int, int, int]) -> None:
        kernel = kernel_for(_MODULE, f"attn_bwd_portable_{stage}_{suffix}", q.device)
        launch(kernel, q.device, grid=grid, block=(THREADS,), args=args)

    if layout.max_q_len > 0:
        run("delta", (-(-layout.max_q_len // THREADS), hq, batch))
    if layout.max_k_len > 0:
        run("dkdv", (layout.max_k_len, hkv, batch))
    if layout.max_q_len > 0:
        run("dq", (layout.max_q_len, hq, batch))
    return dq, dk, dv
