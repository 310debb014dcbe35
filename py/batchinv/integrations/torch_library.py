"""The public ops as ``torch.library`` custom ops in the ``batchinv`` namespace.

``torch.ops.batchinv.<op>`` runs the same eager implementation as ``batchinv.<op>`` (the public
function, validation included), so it gives the same bits; ``torch.compile`` sees one opaque
node per op instead of tracing the registry, the CPU references' loops or the kernel launches.
The public functions call these ops when ``torch.compiler.is_compiling()``.

What each op gives the compiler:

- a fake implementation that checks dtypes and shapes (the checks that read no tensor values)
  and returns outputs of the right shape and dtype;
- autograd through a ``batchinv::<op>_backward`` custom op, told which inputs need a
  gradient (the others are not computed where the backward can skip them).  ``linear``
  calls the registry's backward (the fixed-order kernels) directly.  On the GPU, ``attention``,
  ``attention_varlen`` and ``token_logprobs`` save their outputs (``token_logprobs`` returns
  its fp32 log-sum-exp as a third output for this, empty on the CPU) and their backward calls
  the registry's ``<op>.saved_backward``: the eager autograd's backward kernels on the same
  tensors, without running the forward again.  The other ops, and these on the CPU, recompute
  their forward with autograd inside the backward op and take the registered autograd's
  gradients: the same functions, hence the same bits as eager autograd, at the cost of one
  extra forward (cheap for the memory-bound ops; the CPU attention reference recomputes P in
  its backward anyway).

Checks that read tensor values (id and position ranges, ``cu_seqlens`` / ``seqlens``
contents) need a host sync, so under ``torch.compile`` they do not run at trace time: they run
when the op executes, inside its implementation, with the eager messages.  Nothing is
skipped; only the moment of the error moves.

``attention_with_kv_cache`` mutates a ``KVCache`` (a Python object) and is not a custom op.
``attention`` / ``attention_varlen`` return ``(out, lse)``; ``lse`` carries no gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .. import registry
from ..ops import attention as attention_ops
from ..ops import embedding as embedding_ops
from ..ops import linear as linear_ops
from ..ops import log_softmax as log_softmax_ops
from ..ops import rms_norm as rms_norm_ops
from ..ops import rope as rope_ops
from ..ops import silu_mul as silu_mul_ops
from ..ops import token_logprobs as token_logprobs_ops
from ..validation import (
    check_attention_args,
    check_embedding_args,
    check_fused_add_rms_norm_args,
    check_linear_args,
    check_log_softmax_args,
    check_rms_norm_args,
    check_rope_args,
    check_silu_mul_args,
    check_silu_mul_fused_args,
    check_token_logprobs_args,
)

NAMESPACE = "batchinv"

__all__ = ["NAMESPACE", "OPS"]


def _empty_grad(like: Tensor) -> Tensor:
    """Stands for "no gradient" in a ``Tensor[]`` result (custom ops cannot return None)."""
    return like.new_empty((0,))


# A custom op's implementation runs below the autograd dispatch keys (torch excludes them
# while it redispatches), so ``enable_grad`` alone would not record the recomputed forward.
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    for key in _AUTOGRAD_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for key, was in zip(_AUTOGRAD_KEYS, excluded, strict=True):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _recompute_grads(
    forward: Callable,
    args: Sequence,
    differentiable: Sequence[int],
    needs: Sequence[bool],
    grads: Sequence,
) -> list[Tensor]:
    """Gradients of ``forward(*args)`` for ``args[i], i in differentiable`` where ``needs``
    says so, by running it again with autograd: the eager op's own backward, so the eager
    bits.  An input that needs no gradient gets an empty tensor."""
    wanted = [need and args[i] is not None for i, need in zip(differentiable, needs, strict=True)]
    with _autograd_dispatch():
        inputs = list(args)
        leaves = []
        for i, want in zip(differentiable, wanted, strict=True):
            if want:
                inputs[i] = inputs[i].detach().requires_grad_()
                leaves.append(inputs[i])
        outputs = forward(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs],
                leaves,
                [g for _, g in pairs],
                allow_unused=True,
                materialize_grads=True,
            )
            if pairs
            else [torch.zeros_like(leaf) for leaf in leaves]
        )
    return [next(got).detach() if want else _empty_grad(grads[0]) for want in wanted]


class _OpSpec:
    """One custom op: its schema, eager function, fake, and differentiable inputs.

    ``backward(grads, needs, outputs, *args)`` (default: recompute the forward with autograd)
    returns one tensor per differentiable input, empty where ``needs`` is False; ``outputs``
    are the forward's outputs where ``saves_outputs``, else empty."""

    def __init__(
        self,
        name: str,
        schema: str,
        eager: Callable,
        fake: Callable,
        differentiable: tuple[int, ...],
        backward: Callable | None = None,
        saves_outputs: bool = False,
    ):
        self.name = name
        self.eager = eager
        self.differentiable = differentiable
        self.saves_outputs = saves_outputs
        self.op = torch.library.custom_op(
            f"{NAMESPACE}::{name}", eager, mutates_args=(), schema=schema
        )
        self.op.register_fake(fake)
        backward_impl = backward or self._recompute_backward
        args = schema.split(") ->")[0].removeprefix("(")
        self.backward_op = torch.library.custom_op(
            f"{NAMESPACE}::{name}_backward",
            backward_impl,
            mutates_args=(),
            schema=f"(Tensor?[] grads, bool[] needs, Tensor[] outputs, {args}) -> Tensor[]",
        )
        self.backward_op.register_fake(self._backward_fake)
        self.op.register_autograd(self._backward, setup_context=self._setup_context)

    def _recompute_backward(self, grads, needs, outputs, *args):
        return _recompute_grads(self.eager, args, self.differentiable, needs, grads)

    def _backward_fake(self, grads, needs, outputs, *args):
        like = next(g for g in grads if g is not None)
        return [
            torch.empty_like(args[i]) if need and args[i] is not None else _empty_grad(like)
            for i, need in zip(self.differentiable, needs, strict=True)
        ]

    def _setup_context(self, ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        saved_outputs = outputs if self.saves_outputs else ()
        ctx.save_for_backward(
            *(a if isinstance(a, Tensor) else None for a in inputs), *saved_outputs
        )
        ctx.constants = [None if isinstance(a, Tensor) else a for a in inputs]

    def _backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        count = len(ctx.constants)
        args = [t if c is None else c for t, c in zip(saved[:count], ctx.constants, strict=True)]
        needs = [bool(ctx.needs_input_grad[i]) and args[i] is not None for i in self.differentiable]
        result: list[Tensor | None] = [None] * count
        if not any(needs):
            return tuple(result)
        got = self.backward_op(list(grads), needs, list(saved[count:]), *args)
        for i, need, grad in zip(self.differentiable, needs, got, strict=True):
            if need:
                result[i] = grad
        return tuple(result)


# ----------------------------------------------------------------------------- fakes


def _linear_fake(x, weight, bias):
    check_linear_args(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_backward(grads, needs, outputs, x, weight, bias):
    (grad_out,) = grads
    bias_dtype = None if bias is None else bias.dtype
    backward = registry.lookup("linear.backward", grad_out.device)
    got = backward(grad_out, x, weight, bias_dtype, tuple(needs))
    return [_empty_grad(grad_out) if g is None else g for g in got]


def _embedding_fake(ids, weight, check_ids):
    check_embedding_args(ids, weight, check_values=False)
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _rms_norm_fake(x, weight, eps):
    check_rms_norm_args(x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    check_fused_add_rms_norm_args(x, residual, weight, eps)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


def _rope_fake(q, k, position_ids, theta, head_dim, max_position, check_positions):
    # The validator wants a Python int; the head dim is a constant of the model.
    head_dim = int(q.shape[-1]) if head_dim is None else head_dim
    check_rope_args(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_values=False,
    )
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )


def _silu_mul_fake(gate, up):
    check_silu_mul_args(gate, up)
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _silu_mul_fused_fake(gate_up):
    check_silu_mul_fused_args(gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _log_softmax_fake(x, dim, out_dtype, chunk_size):
    check_log_softmax_args(x, dim, out_dtype, chunk_size)
    return x.new_empty(x.shape, dtype=out_dtype)


def _attention_fake(q, k, v, causal, softmax_scale, seqlens_q, seqlens_k, key_padding_mask):
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
    batch, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, hq, sq), dtype=torch.float32)


def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
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
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _token_logprobs_fake(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, entropy):
    check_token_logprobs_args(
        hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, check_values=False
    )
    logprobs = hidden.new_empty(target_ids.shape, dtype=torch.float32)
    lse = logprobs.new_empty((0,) if hidden.device.type == "cpu" else target_ids.shape)
    return logprobs, torch.empty_like(logprobs) if entropy else logprobs.new_empty((0,)), lse


# ----------------------------------------------------------------------------- eager bodies
# Each calls the public function outside of compilation: validation, registry dispatch and
# the eager autograd exactly as a direct call.  (Inside a custom op's forward, autograd is
# off, so the GPU paths take their no-autograd branch: the same kernels.)


def _embedding_eager(ids, weight, check_ids):
    return embedding_ops.embedding(ids, weight, check_ids=check_ids)


def _rope_eager(q, k, position_ids, theta, head_dim, max_position, check_positions):
    return rope_ops.rope(
        q,
        k,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_positions=check_positions,
    )


def _log_softmax_eager(x, dim, out_dtype, chunk_size):
    return log_softmax_ops.log_softmax(x, dim, out_dtype, chunk_size=chunk_size)


def _attention_eager(q, k, v, causal, softmax_scale, seqlens_q, seqlens_k, key_padding_mask):
    return attention_ops.attention(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
        key_padding_mask=key_padding_mask,
        return_lse=True,
    )


def _attention_varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    return attention_ops.attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=True,
    )


def _token_logprobs_eager(hidden, lm_head_weight, target_ids, ignore_index, vocab_chunk, entropy):
    # A custom op has a fixed number of outputs: (logprobs, entropy, lse), the entropy empty
    # when not requested, the lse empty on the CPU (whose backward recomputes the forward).
    if hidden.device.type == "cpu":
        out = token_logprobs_ops.token_logprobs(
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


def _token_logprobs_backward(grads, needs, outputs, *args):
    hidden, lm_head_weight, target_ids, ignore_index, _vocab_chunk, entropy = args
    if hidden.device.type == "cpu":
        return OPS["token_logprobs"]._recompute_backward(grads, needs, outputs, *args)
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
    return [_empty_grad(lse) if g is None else g for g in got]


def _output_grad(grad: Tensor | None, output: Tensor) -> Tensor:
    return torch.zeros_like(output) if grad is None else grad


def _attention_backward_of(name: str, options: tuple[str, ...]) -> Callable:
    """The backward op body of ``attention`` or ``attention_varlen``, whose arguments after
    ``q, k, v`` are the keyword ``options`` of the registry's ``<name>.saved_backward``."""

    def backward(grads, needs, outputs, *args):
        q, k, v, *rest = args
        if q.device.type == "cpu":
            return OPS[name]._recompute_backward(grads, needs, outputs, *args)
        saved_backward = registry.lookup(f"{name}.saved_backward", q.device)
        grad_out = _output_grad(grads[0], outputs[0])  # the lse carries no gradient
        keywords = dict(zip(options, rest, strict=True))
        return list(saved_backward(grad_out, q, k, v, *outputs, **keywords))

    return backward


_TOKEN_LOGPROBS_SCHEMA = (
    "(Tensor hidden, Tensor lm_head_weight, Tensor target_ids, int ignore_index, "
    "int vocab_chunk, bool entropy) -> (Tensor, Tensor, Tensor)"
)
_ATTENTION_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, Tensor? seqlens_q, "
    "Tensor? seqlens_k, Tensor? key_padding_mask) -> (Tensor, Tensor)"
)
_ATTENTION_VARLEN_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, "
    "float? softmax_scale) -> (Tensor, Tensor)"
)
_ROPE_SCHEMA = (
    "(Tensor q, Tensor k, Tensor position_ids, float theta, int? head_dim, int max_position, "
    "bool check_positions) -> (Tensor, Tensor)"
)

OPS: dict[str, _OpSpec] = {
    spec.name: spec
    for spec in (
        _OpSpec(
            "linear",
            "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
            linear_ops.linear,
            _linear_fake,
            (0, 1, 2),
            backward=_linear_backward,
        ),
        _OpSpec(
            "embedding",
            "(Tensor ids, Tensor weight, bool check_ids) -> Tensor",
            _embedding_eager,
            _embedding_fake,
            (1,),
        ),
        _OpSpec(
            "rms_norm",
            "(Tensor x, Tensor weight, float eps) -> Tensor",
            rms_norm_ops.rms_norm,
            _rms_norm_fake,
            (0, 1),
        ),
        _OpSpec(
            "fused_add_rms_norm",
            "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
            rms_norm_ops.fused_add_rms_norm,
            _fused_add_rms_norm_fake,
            (0, 1, 2),
        ),
        _OpSpec("rope", _ROPE_SCHEMA, _rope_eager, _rope_fake, (0, 1)),
        _OpSpec(
            "silu_mul",
            "(Tensor gate, Tensor up) -> Tensor",
            silu_mul_ops.silu_mul,
            _silu_mul_fake,
            (0, 1),
        ),
        _OpSpec(
            "silu_mul_fused",
            "(Tensor gate_up) -> Tensor",
            silu_mul_ops.silu_mul_fused,
            _silu_mul_fused_fake,
            (0,),
        ),
        _OpSpec(
            "log_softmax",
            "(Tensor x, int dim, ScalarType out_dtype, int chunk_size) -> Tensor",
            _log_softmax_eager,
            _log_softmax_fake,
            (0,),
        ),
        _OpSpec(
            "attention",
            _ATTENTION_SCHEMA,
            _attention_eager,
            _attention_fake,
            (0, 1, 2),
            backward=_attention_backward_of(
                "attention",
                ("causal", "softmax_scale", "seqlens_q", "seqlens_k", "key_padding_mask"),
            ),
            saves_outputs=True,
        ),
        _OpSpec(
            "attention_varlen",
            _ATTENTION_VARLEN_SCHEMA,
            _attention_varlen_eager,
            _attention_varlen_fake,
            (0, 1, 2),
            backward=_attention_backward_of(
                "attention_varlen", ("cu_seqlens_q", "cu_seqlens_k", "causal", "softmax_scale")
            ),
            saves_outputs=True,
        ),
        _OpSpec(
            "token_logprobs",
            _TOKEN_LOGPROBS_SCHEMA,
            _token_logprobs_eager,
            _token_logprobs_fake,
            (0, 1),
            backward=_token_logprobs_backward,
            saves_outputs=True,
        ),
    )
}
