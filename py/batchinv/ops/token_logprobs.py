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
from ..reference import token_logprobs as reference
from ..reference.token_logprobs import DEFAULT_IGNORE_INDEX, VOCAB_CHUNK


class _TokenLogprobsGPU(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        ignore_index: int,
        with_entropy: bool,
    ):
        logprob, lse, entropy, targets32 = gpu.forward(
            hidden, lm_head_weight, target_ids, ignore_index, with_entropy
        )
        ctx.save_for_backward(hidden, lm_head_weight, targets32, lse, entropy)
        # Unused outputs give None, so an unused entropy adds no term to the gradient.
        ctx.set_materialize_grads(False)
        logprob = logprob.reshape(target_ids.shape)
        if with_entropy:
            return logprob, entropy.reshape(target_ids.shape)
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob: Tensor | None, grad_entropy: Tensor | None = None):
        hidden, lm_head_weight, targets32, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight = gpu.backward(
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


def _gpu_token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    *,
    vocab_chunk: int,
    return_entropy: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    # vocab_chunk defines the CPU reference's order; the kernel's tiles are its own constant.
    return _TokenLogprobsGPU.apply(
        hidden, lm_head_weight, target_ids, ignore_index, bool(return_entropy)
    )


registry.register("token_logprobs", "cuda")(_gpu_token_logprobs)
registry.register("token_logprobs", "cpu")(reference.token_logprobs)


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
    if torch.compiler.is_compiling():  # one opaque node (integrations/torch_library.py)
        args = (ignore_index, vocab_chunk, bool(return_entropy))
        logprobs, entropy = torch.ops.batchinv.token_logprobs(
            hidden, lm_head_weight, target_ids, *args
        )
        return (logprobs, entropy) if return_entropy else logprobs
    reference.check_token_logprobs_args(
        hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
    )
    return registry.lookup("token_logprobs", hidden.device)(
        hidden,
        lm_head_weight,
        target_ids,
        ignore_index,
        vocab_chunk=vocab_chunk,
        return_entropy=return_entropy,
    )
