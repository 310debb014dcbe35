"""``batchinv.lm_head``: vocabulary logits ``hidden · weightᵀ (+ bias)``, in three forms.

- ``lm_head``: logits in ``hidden``'s dtype.  It is ``batchinv.linear`` with one weight row
  per vocabulary entry (the same kernels and bits), under its own registry entry so a
  caller can ask for it by name and see which backends have it.
- ``lm_head_fp32``: fp32 logits from the strict reference (inputs upcast, K reduced in
  order, ``deterministic_context``).  It is the same reference on the CPU and on a CUDA
  device (it runs on the tensors where they are); it is the ground truth, not a fast path.
- The fused path, ``batchinv.token_logprobs``: target-token logprobs through the lm_head
  without materialising the ``[tokens, vocab]`` logits.

On HIP ``lm_head`` is linear's portable loop (``linear_simt_*``, docs/amd.md) and
``lm_head_fp32`` the same reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..reference import linear as reference
from ..validation import check_linear_args
from ._custom_op import CustomOp
from .linear import _custom_backward, _fake, checked_linear


def lm_head(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``hidden [..., H] · weight[V, H]ᵀ (+ bias[V])`` -> logits ``[..., V]`` in ``hidden``'s
    dtype, fp32 accumulation, one rounding.

    The same op and bits as ``batchinv.linear(hidden, weight, bias)``: a row's logits do not
    depend on the other rows.  GPU: bf16/fp16; CPU: the strict reference (also fp32).
    Differentiable in all three inputs.
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        return torch.ops.batchinv.lm_head(hidden, weight, bias)
    check_linear_args(hidden, weight, bias)
    return registry.lookup("lm_head", hidden.device)(hidden, weight, bias)


def lm_head_fp32(hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The strict fp32 logits: inputs upcast to fp32, the K loop of
    ``batchinv.reference.linear`` in order, fp32 result (differentiable).

    This is the Axis-B reference of ``lm_head``; on a GPU it runs the reference's loop on
    the GPU tensors (slow by design: one elementwise step per hidden unit)."""
    check_linear_args(hidden, weight, bias)
    return registry.lookup("lm_head.fp32", hidden.device)(hidden, weight, bias)


# The input-dtype form is batchinv.linear past its checks (it dispatches to its own registry
# entries); the fp32 form is the reference on the devices it is meant to serve as ground
# truth on.
for _backend in ("cpu", "cuda"):
    registry.register("lm_head", _backend)(checked_linear)
    registry.register("lm_head.fp32", _backend)(reference.linear_fp32)
registry.register("lm_head", "hip")(checked_linear)
registry.register("lm_head.fp32", "hip")(reference.linear_fp32)


# ----------------------------------------------------------------------------- custom op

# linear's: the same shapes, and its fixed-order backward directly (recomputing a
# vocabulary-sized forward to get the gradients would double the model's largest GEMM).
CustomOp(
    "lm_head",
    "(Tensor hidden, Tensor weight, Tensor? bias) -> Tensor",
    lm_head,
    _fake,
    (0, 1, 2),
    backward=_custom_backward,
)
