"""RL-Kernel's op API on batchinv's ops: ``NativeEmbeddingOp``, ``NativeLMHeadOp``,
``NativeAttentionOp``, ``OpBackend``, the per-platform priority maps and ``get_op``.

Each op is a stateless ``nn.Module`` with RL-Kernel's contract: ``forward`` returns the
stock op's dtype, ``forward_fp32`` the strict fp32 result (TF32 and autocast off), and the
argument names and layouts are RL-Kernel's (attention head-major ``[B, H, S, D]``,
``key_padding_mask [B, Skv]`` True = valid, ``scale`` with an explicit 0.0 kept).  An op
runs on one ``OpBackend``:

- ``OpBackend.BATCHINV``: batchinv's public ops (``batchinv.embedding``, ``batchinv.lm_head``,
  ``batchinv.token_logprobs``, ``batchinv.attention``).  They dispatch by the tensors'
  device through ``batchinv.registry``: the kernels on CUDA and HIP, the strict references on
  the CPU, and ``BackendNotImplementedError`` where batchinv has no kernel (on HIP,
  attention's backward).  Nothing falls back.
- ``OpBackend.REFERENCE``: the strict references (``batchinv.reference``) on whatever
  device the tensors are on.  A GPU gets them only when the caller asks by name.

``forward_fp32`` is the strict fp32 reference on both backends (batchinv has no fp32-input
kernels; the reference is the ground truth RL-Kernel's ``forward_fp32`` stands for); on
``BATCHINV`` it still raises where batchinv has no implementation of the op.

``get_op(name)`` takes the first backend of the platform's priority map that is available
and says which (``get_op(name).backend``).  The maps are data (``DEFAULT_PRIORITY_MAPS``);
a ``KernelRegistry`` built with other maps is the way to configure them.  Where batchinv's
semantics differ from RL-Kernel's (key positions under ``key_padding_mask``, fully masked
rows, GPU dtypes), batchinv's hold: docs/migrating-from-rl-kernel.md lists each case.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor, nn

from .. import registry
from ..contract import deterministic_context
from ..ops.attention import attention as bi_attention
from ..ops.embedding import embedding as bi_embedding
from ..ops.lm_head import lm_head as bi_lm_head
from ..ops.lm_head import lm_head_fp32 as bi_lm_head_fp32
from ..ops.token_logprobs import token_logprobs as bi_token_logprobs
from ..reference import attention as ref_attention
from ..reference import embedding as ref_embedding
from ..reference import linear as ref_linear
from ..reference import token_logprobs as ref_token_logprobs
from ..reference.token_logprobs import DEFAULT_IGNORE_INDEX
from ..registry import BackendNotImplementedError, UnknownOpError

__all__ = [
    "ALIASES",
    "DEFAULT_PRIORITY_MAPS",
    "OP_NAMES",
    "PLATFORMS",
    "KernelRegistry",
    "NativeAttentionOp",
    "NativeEmbeddingOp",
    "NativeLMHeadOp",
    "NativeOp",
    "OpBackend",
    "current_platform",
    "get_op",
    "kernel_registry",
]


class OpBackend(enum.StrEnum):
    """Where a compat op runs: batchinv's ops (dispatched by device) or the strict references."""

    BATCHINV = "batchinv"
    REFERENCE = "reference"


PLATFORMS = ("cuda", "rocm", "cpu")
OP_NAMES = ("embedding", "lm_head", "attention")
# RL-Kernel's registry calls attention "attn".
ALIASES = MappingProxyType({"attn": "attention"})

# The batchinv registry entries an op's BATCHINV backend runs on, and the registry backend
# of each platform: BATCHINV is available on a platform where all of them are registered.
_REGISTRY_ENTRIES = {
    "embedding": ("embedding.forward",),
    "lm_head": ("lm_head",),
    "attention": ("attention",),
}
_REGISTRY_BACKEND = {"cuda": "cuda", "rocm": "hip", "cpu": "cpu"}


def _priority_map(*backends: OpBackend) -> Mapping[str, tuple[OpBackend, ...]]:
    return MappingProxyType(dict.fromkeys(OP_NAMES, backends))


# GPUs get batchinv's kernels and nothing else (no silent fallback to the reference); the
# CPU gets the strict references, which is also what batchinv's ops run there.
DEFAULT_PRIORITY_MAPS: Mapping[str, Mapping[str, tuple[OpBackend, ...]]] = MappingProxyType(
    {
        "cuda": _priority_map(OpBackend.BATCHINV),
        "rocm": _priority_map(OpBackend.BATCHINV),
        "cpu": _priority_map(OpBackend.REFERENCE),
    }
)


def current_platform() -> str:
    """``rocm`` or ``cuda`` when torch sees a GPU (by the torch build), else ``cpu``."""
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def _as_backend(backend: OpBackend | str) -> OpBackend:
    if isinstance(backend, OpBackend):
        return backend
    try:
        return OpBackend(backend)
    except ValueError:
        names = ", ".join(b.value for b in OpBackend)
        raise ValueError(f"unknown backend {backend!r}; expected one of {names}") from None


def _canonical_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in OP_NAMES:
        known = ", ".join(OP_NAMES + tuple(ALIASES))
        raise UnknownOpError(f"unknown op {name!r} (compat ops: {known})")
    return name


# ----------------------------------------------------------------------------- ops


class NativeOp(nn.Module):
    """Base of the compat ops: stateless, bound to one ``OpBackend`` (``.backend``)."""

    op_name = ""

    def __init__(self, backend: OpBackend | str = OpBackend.BATCHINV):
        super().__init__()
        self.backend = _as_backend(backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend.value}"

    def _check_batchinv_has(self, device: torch.device) -> None:
        """On ``BATCHINV``, raise where batchinv has no implementation for ``device``: the
        strict-fp32 path would otherwise run the reference where the kernels cannot."""
        if self.backend is OpBackend.BATCHINV:
            for entry in _REGISTRY_ENTRIES[self.op_name]:
                registry.lookup(entry, device)


class NativeEmbeddingOp(NativeOp):
    """``weight[token_ids]``: a gather, bitwise ``weight[token_ids]`` on every backend."""

    op_name = "embedding"

    def forward(self, token_ids: Tensor, weight: Tensor) -> Tensor:
        """Rows of ``weight [V, H]`` in its dtype; ``token_ids`` int32/int64, any shape."""
        if self.backend is OpBackend.BATCHINV:
            return bi_embedding(token_ids, weight)
        return ref_embedding.embedding_with_grad(token_ids, weight)

    def forward_fp32(self, token_ids: Tensor, weight: Tensor) -> Tensor:
        """The gathered rows upcast to fp32 (exact: a gather rounds nothing)."""
        return self.forward(token_ids, weight).float()


class NativeLMHeadOp(NativeOp):
    """``hidden @ weight.T (+ bias)``: vocabulary logits, ``weight [V, H]`` (``nn.Linear``
    layout)."""

    op_name = "lm_head"

    def forward(self, hidden: Tensor, weight: Tensor, *, bias: Tensor | None = None) -> Tensor:
        """Logits in ``hidden``'s dtype, fp32 accumulation in a fixed K order."""
        if self.backend is OpBackend.BATCHINV:
            return bi_lm_head(hidden, weight, bias)
        return ref_linear.linear(hidden, weight, bias)

    def forward_fp32(self, hidden: Tensor, weight: Tensor, *, bias: Tensor | None = None) -> Tensor:
        """Strict fp32 logits (inputs upcast, the reference's K loop)."""
        if self.backend is OpBackend.BATCHINV:
            return bi_lm_head_fp32(hidden, weight, bias)
        return ref_linear.linear_fp32(hidden, weight, bias)

    def token_logprobs(
        self,
        hidden: Tensor,
        weight: Tensor,
        target_ids: Tensor,
        ignore_index: int = DEFAULT_IGNORE_INDEX,
        *,
        return_entropy: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The fused path: fp32 ``log_softmax(hidden @ weight.T)[target_ids]`` without the
        logits (``batchinv.token_logprobs``; it has no bias term)."""
        if self.backend is OpBackend.BATCHINV:
            fn = bi_token_logprobs
        else:
            fn = ref_token_logprobs.token_logprobs
        return fn(hidden, weight, target_ids, ignore_index, return_entropy=return_entropy)


def _check_head_major(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be head-major [B, H, S, D], got {got}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")


class NativeAttentionOp(NativeOp):
    """``softmax(q kᵀ * scale + masks) v`` in head-major layout: ``q [B, Hq, Sq, D]``,
    ``k, v [B, Hkv, Skv, D]`` (GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``).

    ``causal``: query ``i`` is the ``(Skv - Sq + i)``-th key position (bottom-right
    alignment, so decode and prefill agree).  ``key_padding_mask [B, Skv]`` (bool, True =
    valid) drops keys, which batchinv renumbers: kept keys count as positions 0, 1, ...,
    and the queries are the last ``Sq`` positions of the kept keys (left padding is bitwise
    the unpadded sequence; right padding and holes shift positions, see
    docs/migrating-from-rl-kernel.md).  A row with no visible key gives 0.
    """

    op_name = "attention"

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``[B, Hq, Sq, D]`` in ``q``'s dtype (fp32 softmax and accumulation)."""
        _check_head_major(q, k, v)
        fn = bi_attention if self.backend is OpBackend.BATCHINV else ref_attention.attention
        return self._run(fn, q, k, v, causal, scale, key_padding_mask)

    def forward_fp32(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The strict fp32 reference, ``[B, Hq, Sq, D]`` fp32."""
        _check_head_major(q, k, v)
        self._check_batchinv_has(q.device)
        with deterministic_context():
            q, k, v = q.float(), k.float(), v.float()
            return self._run(ref_attention.attention, q, k, v, causal, scale, key_padding_mask)

    @staticmethod
    def _run(fn, q, k, v, causal, scale, key_padding_mask) -> Tensor:
        # batchinv's layout is [B, S, H, D]; the kernels take strided views as they are.
        out = fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            causal=causal,
            softmax_scale=scale,  # None only when the caller passed None: 0.0 stays 0.0
            key_padding_mask=key_padding_mask,
        )
        return out.transpose(1, 2).contiguous()


_OP_CLASSES: dict[str, type[NativeOp]] = {
    "embedding": NativeEmbeddingOp,
    "lm_head": NativeLMHeadOp,
    "attention": NativeAttentionOp,
}


# ----------------------------------------------------------------------------- registry


class KernelRegistry:
    """Hands out compat ops by name, on the first available backend of the platform's map."""

    def __init__(
        self, priority_maps: Mapping[str, Mapping[str, tuple[OpBackend, ...]]] | None = None
    ):
        maps = DEFAULT_PRIORITY_MAPS if priority_maps is None else priority_maps
        frozen = {}
        for platform, per_op in maps.items():
            if platform not in PLATFORMS:
                raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
            frozen[platform] = MappingProxyType(
                {
                    _canonical_name(name): tuple(_as_backend(b) for b in backends)
                    for name, backends in per_op.items()
                }
            )
        self._maps = MappingProxyType(frozen)

    @property
    def priority_maps(self) -> Mapping[str, Mapping[str, tuple[OpBackend, ...]]]:
        """The maps this registry uses (read-only)."""
        return self._maps

    @staticmethod
    def is_available(name: str, backend: OpBackend | str, platform: str) -> bool:
        """Whether ``backend`` can run op ``name`` on ``platform``: the references run
        anywhere; batchinv's ops where the registry has their implementations."""
        name, backend = _canonical_name(name), _as_backend(backend)
        if backend is OpBackend.REFERENCE:
            return True
        have = registry.registered_ops()
        target = _REGISTRY_BACKEND[_check_platform(platform)]
        return all(target in have.get(entry, ()) for entry in _REGISTRY_ENTRIES[name])

    def get_op(
        self, name: str, backend: OpBackend | str | None = None, *, platform: str | None = None
    ) -> NativeOp:
        """The op ``name`` (``embedding``, ``lm_head``, ``attention`` or ``attn``) on
        ``backend``, or on the first available backend of ``platform``'s map (default: this
        machine's, ``current_platform()``).  Raises ``UnknownOpError`` for an unknown name and
        ``BackendNotImplementedError`` when no backend asked for is available."""
        name = _canonical_name(name)
        platform = _check_platform(current_platform() if platform is None else platform)
        if backend is not None:
            candidates: tuple[OpBackend, ...] = (_as_backend(backend),)
        else:
            candidates = self._maps.get(platform, {}).get(name, ())
        for candidate in candidates:
            if self.is_available(name, candidate, platform):
                return _OP_CLASSES[name](candidate)
        tried = ", ".join(c.value for c in candidates) or "none (not in the priority map)"
        raise BackendNotImplementedError(
            f"op {name!r} has no available backend on {platform} (tried: {tried}); "
            f"batchinv does not fall back: get_op({name!r}, backend=OpBackend.REFERENCE) "
            "runs the strict reference on request"
        )


def _check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
    return platform


kernel_registry = KernelRegistry()
get_op = kernel_registry.get_op
