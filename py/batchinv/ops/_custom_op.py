"""The shared machinery of the public ops' ``torch.library`` custom ops (``batchinv`` namespace).

Each ``batchinv/ops/<op>.py`` declares its custom op(s) with ``CustomOp``, next to the op:
importing the op module registers them.  ``torch.ops.batchinv.<op>`` runs the same eager
implementation as ``batchinv.<op>`` (the public function, validation included), so it gives the
same bits; ``torch.compile`` sees one opaque node per op instead of tracing the registry, the
CPU references' loops or the kernel launches.  The public functions call these ops when
``torch.compiler.is_compiling()``.

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
  its backward anyway).  ``fused_add_rms_norm`` recomputes too, then copies the residual's
  gradient where the eager node gave x and residual one tensor (a custom op's outputs may not
  alias).

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

NAMESPACE = "batchinv"

__all__ = ["NAMESPACE", "OPS", "CustomOp", "empty_grad", "recompute_grads"]

# Every declared op by name (filled as the op modules are imported).
OPS: dict[str, CustomOp] = {}


def empty_grad(like: Tensor) -> Tensor:
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


def recompute_grads(
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
    return [next(got).detach() if want else empty_grad(grads[0]) for want in wanted]


class CustomOp:
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
        backward_impl = backward or self.recompute_backward
        args = schema.split(") ->")[0].removeprefix("(")
        self.backward_op = torch.library.custom_op(
            f"{NAMESPACE}::{name}_backward",
            backward_impl,
            mutates_args=(),
            schema=f"(Tensor?[] grads, bool[] needs, Tensor[] outputs, {args}) -> Tensor[]",
        )
        self.backward_op.register_fake(self._backward_fake)
        self.op.register_autograd(self._backward, setup_context=self._setup_context)
        OPS[name] = self

    def recompute_backward(self, grads, needs, outputs, *args):
        return recompute_grads(self.eager, args, self.differentiable, needs, grads)

    def _backward_fake(self, grads, needs, outputs, *args):
        like = next(g for g in grads if g is not None)
        return [
            torch.empty_like(args[i]) if need and args[i] is not None else empty_grad(like)
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
