"""``torch.nn`` modules over batchinv's ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.embedding import embedding
from .ops.linear import linear
from .ops.log_softmax import log_softmax
from .ops.rms_norm import fused_add_rms_norm, rms_norm
from .ops.rope import rope
from .ops.silu_mul import silu_mul, silu_mul_fused
from .ops.token_logprobs import token_logprobs
from .validation import check_eps, check_rope_params


class Embedding(nn.Module):
    """A drop-in for ``nn.Embedding`` (no padding_idx, max_norm or sparse gradients)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if num_embeddings <= 0:
            raise ValueError(f"num_embeddings must be positive, got {num_embeddings}")
        if embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        )
        nn.init.normal_(self.weight)

    @classmethod
    def from_pretrained(cls, weight: Tensor, *, freeze: bool = True) -> Embedding:
        """Wraps an existing ``[vocab, hidden]`` table (shared, not copied)."""
        if weight.dim() != 2:
            raise ValueError(f"weight must have 2 dimensions, got shape {tuple(weight.shape)}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.num_embeddings, module.embedding_dim = weight.shape
        module.weight = nn.Parameter(weight, requires_grad=not freeze)
        return module

    def forward(self, ids: Tensor) -> Tensor:
        return embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Linear(nn.Module):
    """A drop-in for ``nn.Linear`` whose rows do not depend on the batch."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        reference_layer = nn.Linear(
            in_features, out_features, bias=bias, device=device, dtype=dtype
        )
        self.in_features, self.out_features = in_features, out_features
        self.weight = reference_layer.weight
        self.bias = reference_layer.bias

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Linear:
        """Shares the parameters of an existing ``nn.Linear``."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = layer.in_features, layer.out_features
        module.weight, module.bias = layer.weight, layer.bias
        return module

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (Qwen3RMSNorm's formula, batch invariant on GPUs).

    ``forward(x)`` is ``batchinv.rms_norm``; ``forward(x, residual)`` is the fused residual
    add and returns ``(y, new_residual)``.  For the per-head q/k norm use ``RMSNorm(head_dim)``
    on ``[..., heads, head_dim]``.  The weight starts at ones.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        check_eps(eps)
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class SiluMul(nn.Module):
    """SwiGLU's activation: ``forward(gate, up) = silu(gate) * up``; ``forward(gate_up)`` takes
    the merged ``[..., 2I]`` projection (gate first) and returns ``[..., I]``."""

    def forward(self, gate: Tensor, up: Tensor | None = None) -> Tensor:
        return silu_mul_fused(gate) if up is None else silu_mul(gate, up)


class RotaryEmbedding(nn.Module):
    """Qwen3 RoPE (rotate-half) by absolute position ids; no parameters, no cached tables
    (the GPU kernel computes cos/sin per token)."""

    def __init__(self, head_dim: int, theta: float = 1_000_000.0, max_position: int = 40960):
        super().__init__()
        check_rope_params(head_dim, theta, max_position)
        self.head_dim = head_dim
        self.theta = theta
        self.max_position = max_position

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return rope(
            q,
            k,
            position_ids,
            theta=self.theta,
            head_dim=self.head_dim,
            max_position=self.max_position,
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, max_position={self.max_position}"


class LogSoftmax(nn.Module):
    """Log-softmax over the last dim with fp32 statistics; output in ``out_dtype`` (fp32)."""

    def __init__(self, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_dtype = out_dtype

    def forward(self, x: Tensor) -> Tensor:
        return log_softmax(x, -1, self.out_dtype)

    def extra_repr(self) -> str:
        return f"out_dtype={self.out_dtype}"


class TokenLogprobs(nn.Module):
    """Target-token logprobs through an lm_head (``nn.Linear`` or ``batchinv.nn.Linear``
    without bias, whose weight is shared, not copied): ``forward(hidden, target_ids)``."""

    def __init__(self, lm_head: nn.Module, ignore_index: int = -100):
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("lm_head must have no bias (token_logprobs has no bias term)")
        if not isinstance(getattr(lm_head, "weight", None), Tensor):
            raise TypeError(f"lm_head must have a weight tensor, got {type(lm_head).__name__}")
        self.lm_head = lm_head
        self.ignore_index = ignore_index

    def forward(
        self, hidden: Tensor, target_ids: Tensor, *, return_entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        return token_logprobs(
            hidden,
            self.lm_head.weight,
            target_ids,
            self.ignore_index,
            return_entropy=return_entropy,
        )

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}"
