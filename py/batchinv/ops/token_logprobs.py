"""``batchinv.token_logprobs``: target-token logprobs through the lm_head, never holding
the ``[tokens, vocab]`` logits.

On the CPU the op is the reference (``batchinv.reference.token_logprobs``: vocabulary chunks
of ``vocab_chunk`` columns merged left to right); on CUDA it is
``kernels_cu/token_logprobs.cu``: 256-column tiles reduced in the GEMM's epilogue and merged
in a fixed order.  Both are batch-invariant; they agree within the contract's logprob
tolerance, not bitwise (different fixed orders).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..gpu import token_logprobs as gpu
from ..gpu import token_logprobs_portable as portable
from ..reference import token_logprobs as reference
from ..reference.token_logprobs import DEFAULT_IGNORE_INDEX, VOCAB_CHUNK
from ..validation import check_token_logprobs_args
from ._checked import CheckedCalls
from ._custom_op import CustomOp, empty_grad


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
    *,
    vocab_chunk: int = VOCAB_CHUNK,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(hidden @ lm_head_weight.T)[target_ids]`` in fp32, without the logits.

    ``hidden [..., H]`` and ``lm_head_weight [V, H]`` share a dtype (bf16/fp16 on the GPU,
    also fp32 on the CPU); ``target_ids [...]`` is int32/int64.  Returns fp32 logprobs of
    ``target_ids.shape`` (and the fp32 entropy of each token's distribution with
    ``return_entropy=True``).  Tokens whose target is ``ignore_index`` give 0.0 and zero
    gradient; any other target outside ``[0, V)`` raises ``IndexError`` naming its position
    (on the GPU after one read back from the device).  ``vocab_chunk`` sets the CPU
    reference's order and is validated but unused on the GPU.  Differentiable in ``hidden``
    (per token, batch-invariant) and ``lm_head_weight`` (tokens reduced in a fixed order).
    """
    if torch.compiler.is_compiling():  # one opaque node (the custom op below)
        args = (ignore_index, vocab_chunk, bool(return_entropy))
        logprobs, entropy, _lse = torch.ops.batchinv.token_logprobs(
            hidden, lm_head_weight, target_ids, *args
        )
        return (logprobs, entropy) if return_entropy else logprobs
    args = (hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk)
    signature = _signature(*args)
    if signature is None:
        check_token_logprobs_args(
            hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
        )
        run = registry.lookup("token_logprobs", hidden.device)
    elif torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
        run = _WITH_GRAD.lookup(signature, *args)
    else:
        run = _NO_GRAD.lookup(signature, *args)
    return run(
        hidden,
        lm_head_weight,
        target_ids,
        ignore_index,
        vocab_chunk=vocab_chunk,
        return_entropy=return_entropy,
    )


def _signature(
    hidden: Tensor, lm_head_weight: Tensor, target_ids: Tensor, ignore_index: int, vocab_chunk: int
) -> tuple | None:
    """What ``check_token_logprobs_args`` reads without ``check_values`` (``_checked``), or
    None where the full checks must run (arguments of other types than the op takes)."""
    if not (ignore_index.__class__ is int and vocab_chunk.__class__ is int):
        return None
    try:
        return (
            hidden.__class__,
            hidden.shape,
            hidden.dtype,
            hidden.device,
            lm_head_weight.__class__,
            lm_head_weight.shape,
            lm_head_weight.dtype,
            lm_head_weight.device,
            target_ids.__class__,
            target_ids.shape,
            target_ids.dtype,
            target_ids.device,
            vocab_chunk,
        )
    except AttributeError:
        return None


def _resolver(entry: str):
    def resolve(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk):
        check_token_logprobs_args(
            hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
        )
        return registry.lookup(entry, hidden.device)

    return resolve


# The custom op (below) saves the log-sum-exp instead of recomputing the forward in its
# backward: each route's saving forward and saved backward run the eager autograd's forward
# and backward kernels on the same tensors, hence its bits.  GPU only; the CPU op recomputes.
# The CUDA and portable (HIP) routes share the autograd op and these entries
# (``gpu.registry_entries``); vocab_chunk defines the CPU reference's order only.
_gpu_token_logprobs, _gpu_saving_forward, _gpu_saved_backward = gpu.registry_entries(gpu)


def _gpu_token_logprobs_no_grad(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    *,
    vocab_chunk: int,
    return_entropy: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    # The autograd op's forward kernels without its node: the lean path of gpu.forward_no_grad.
    return gpu.forward_no_grad(
        hidden, lm_head_weight, target_ids, ignore_index, bool(return_entropy)
    )


registry.register("token_logprobs", "cuda")(_gpu_token_logprobs)
registry.register("token_logprobs", "cpu")(reference.token_logprobs)
registry.register("token_logprobs", "hip")(portable.token_logprobs)
registry.register("token_logprobs.no_grad", "cuda")(_gpu_token_logprobs_no_grad)
registry.register("token_logprobs.no_grad", "cpu")(reference.token_logprobs)
registry.register("token_logprobs.no_grad", "hip")(portable.token_logprobs)
registry.register("token_logprobs.saving_forward", "cuda")(_gpu_saving_forward)
registry.register("token_logprobs.saving_forward", "hip")(portable.saving_forward)
registry.register("token_logprobs.saved_backward", "cuda")(_gpu_saved_backward)
registry.register("token_logprobs.saved_backward", "hip")(portable.saved_backward)


# Checks and lookups once per signature (``_checked``); a call that records a gradient takes
# the autograd op, one that does not the CUDA route's kept launches.
_WITH_GRAD = CheckedCalls(_resolver("token_logprobs"))
_NO_GRAD = CheckedCalls(_resolver("token_logprobs.no_grad"))


# ----------------------------------------------------------------------------- custom op


def _eager(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, entropy):
    # A custom op has a fixed number of outputs: (logprobs, entropy, lse), the entropy empty
    # when not requested, the lse empty on the CPU (whose backward recomputes the forward).
    if hidden.device.type == "cpu":
        out = token_logprobs(
            hidden,
            lm_head_weight,
            target_ids,
            ignore_index,
            vocab_chunk=vocab_chunk,
            return_entropy=entropy,
        )
        lse = hidden.new_empty((0,), dtype=torch.float32)
        return (*out, lse) if entropy else (out, torch.empty_like(lse), lse)
    check_token_logprobs_args(
        hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
    )
    saving_forward = registry.lookup("token_logprobs.saving_forward", hidden.device)
    return saving_forward(hidden, lm_head_weight, target_ids, ignore_index, entropy)


def _fake(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, entropy):
    check_token_logprobs_args(
        hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
    )
    logprobs = hidden.new_empty(target_ids.shape, dtype=torch.float32)
    lse = logprobs.new_empty((0,) if hidden.device.type == "cpu" else target_ids.shape)
    return logprobs, torch.empty_like(logprobs) if entropy else logprobs.new_empty((0,)), lse


def _custom_backward(grads, needs, outputs, *args):
    hidden, lm_head_weight, target_ids, ignore_index, _vocab_chunk, entropy = args
    if hidden.device.type == "cpu":
        return _CUSTOM_OP.recompute_backward(grads, needs, outputs, *args)
    grad_logprob, grad_entropy, _grad_lse = grads  # the lse carries no gradient
    _logprobs, entropy_out, lse = outputs
    saved_backward = registry.lookup("token_logprobs.saved_backward", hidden.device)
    got = saved_backward(
        grad_logprob,
        grad_entropy if entropy else None,
        hidden,
        lm_head_weight,
        target_ids,
        ignore_index,
        lse,
        entropy_out if entropy else None,
        tuple(needs),
    )
    return [empty_grad(lse) if g is None else g for g in got]


_CUSTOM_OP = CustomOp(
    "token_logprobs",
    "(Tensor hidden, Tensor lm_head_weight, Tensor target_ids, int ignore_index, "
    "int vocab_chunk, bool entropy) -> (Tensor, Tensor, Tensor)",
    _eager,
    _fake,
    (0, 1),
    backward=_custom_backward,
    saves_outputs=True,
)
