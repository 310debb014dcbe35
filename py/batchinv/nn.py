"""``torch.nn`` modules over batchinv's ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops.embedding import embedding
from .ops.linear import linear


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
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
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
        reference_layer = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
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
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
