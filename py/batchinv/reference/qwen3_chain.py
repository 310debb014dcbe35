"""The Qwen3 dense model as a chain of batchinv references (Hugging Face weight names).

::

    h = embedding(input_ids)
    for each layer:
        x = rms_norm(h, input_layernorm)
        q, k, v = linear(x, q_proj), linear(x, k_proj), linear(x, v_proj)   # per-head views
        q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)                     # over head_dim
        q, k = rope(q, k, position_ids)
        h = h + linear(attention(q, k, v, causal), o_proj)
        x = rms_norm(h, post_attention_layernorm)
        h = h + linear(silu_mul(linear(x, gate_proj), linear(x, up_proj)), down_proj)
    logits = linear(rms_norm(h, norm), lm_head)        # lm_head = embed_tokens when tied

Every step is a batchinv reference with a fixed per-row order (see each module), the residual
adds are elementwise (fp32 add, one rounding to the model dtype), and position ids are
absolute.  So a sequence's logits are the same bits whatever batch, padding or schedule it
is computed in: prefill, or token by token against per-layer ``KVCache``s.

Padding: ``input_ids [B, S]`` with ``seqlens [B]`` holds sequence ``b`` in
``input_ids[b, :seqlens[b]]`` (right padding).  Padded positions must hold valid token ids;
their logits are computed but meaningless (their attention output is zero and no real
token attends to them).

Varlen: ``input_ids [T]`` with ``cu_seqlens [n+1]`` holds ``n`` sequences packed back to back;
positions restart at 0 for each sequence and attention is ``attention_varlen``.

One chain, several backends: every step goes through an op table (``Qwen3Ops``).  The default,
``REFERENCE_OPS``, is the strict references; ``batchinv.models.qwen3.ops`` defines the batchinv
table (public ops: CPU references, CUDA kernels) and the stock PyTorch table the audit compares
against, so the model, the audit and these references share this one implementation.
A table may route o_proj and down_proj through its ``row_parallel_linear`` and the logits
through its ``logits`` (``batchinv.distributed.qwen3`` does, for tensor parallelism).
Where no gradient is needed, the projections of one ``x`` (q/k/v, gate/up) go through the
table's optional ``linear_group`` (batchinv's: one launch at decode sizes, the same bits).

Precision: ``forward`` keeps the weights' dtype between ops (each op computes in fp32 and
rounds once, as its module documents); ``forward_fp32`` upcasts the weights and runs the same
chain in fp32 inside ``deterministic_context``.  The chain is differentiable through each
op's fixed-order backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from ..kv_cache import KVCache, host_index_copies
from ..validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MAX_EXACT_POSITION,
    MAX_HEAD_DIM,
    check_tensor,
    is_supported_head_dim,
)
from .attention import attention, attention_varlen, attention_with_kv_cache
from .embedding import embedding_with_grad
from .linear import linear
from .log_softmax import log_softmax as reference_log_softmax
from .rms_norm import rms_norm
from .rope import rope
from .silu_mul import silu_mul
from .token_logprobs import token_logprobs as reference_token_logprobs

__all__ = [
    "REFERENCE_OPS",
    "add_then_rms_norm",
    "Qwen3ChainConfig",
    "Qwen3Ops",
    "Qwen3Reference",
    "check_kv_caches",
    "check_qwen3_state_dict",
    "lm_head_weight",
    "make_kv_caches",
    "qwen3_final_hidden",
    "qwen3_forward",
    "qwen3_forward_fp32",
    "qwen3_logits",
    "qwen3_state_dict_shapes",
]


@dataclass(frozen=True)
class Qwen3ChainConfig:
    """The fields of a Hugging Face ``Qwen3Config`` that the dense chain uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int",) and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"Qwen3ChainConfig.{f.name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        # What would otherwise fail at the first forward fails here, where the config is made.
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"Qwen3ChainConfig.{name} must be a float, got {value!r}")
            # rms_norm divides by sqrt(mean + eps) in fp32: eps must stay > 0 there.
            if not math.isfinite(value) or float(torch.tensor(value, dtype=torch.float32)) <= 0:
                raise ValueError(
                    f"Qwen3ChainConfig.{name} must be a finite number > 0 (in float32), "
                    f"got {value!r}"
                )
        if self.max_position_embeddings > MAX_EXACT_POSITION:
            raise ValueError(
                f"Qwen3ChainConfig.max_position_embeddings must be at most {MAX_EXACT_POSITION} "
                f"(positions exact in float32), got {self.max_position_embeddings}"
            )
        if not is_supported_head_dim(self.head_dim):
            raise ValueError(
                f"Qwen3ChainConfig.head_dim must be even with 2 <= head_dim <= {MAX_HEAD_DIM}, "
                f"got {self.head_dim}"
            )

    @classmethod
    def from_hf(cls, config: Mapping | object) -> Qwen3ChainConfig:
        """From a Hugging Face config dict (``config.json``) or a ``Qwen3Config`` object.

        Reads ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta`` (4.x).
        Raises ``ValueError`` for what the dense chain does not implement: another
        ``model_type``, an activation other than SiLU, a RoPE type other than default, or
        sliding-window layers.
        """
        d = dict(config) if isinstance(config, Mapping) else config.to_dict()
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"config model_type must be 'qwen3', got {model_type!r}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config hidden_act must be 'silu', got {act!r}")
        rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"only the default RoPE is implemented, got rope_type={rope_type!r}")
        theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
        layer_types = d.get("layer_types") or []
        if d.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError("sliding-window attention layers are not implemented")
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
        )


def qwen3_state_dict_shapes(config: Qwen3ChainConfig) -> dict[str, tuple[int, ...]]:
    """The expected Hugging Face names and shapes (``lm_head.weight`` only when untied)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "self_attn.q_norm.weight": (config.head_dim,),
            p + "self_attn.k_norm.weight": (config.head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.bias": (hidden,),
            }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _is_ignorable(name: str) -> bool:
    # Non-persistent buffers some versions save, and the tied lm_head copy.
    return name.endswith("rotary_emb.inv_freq")


def check_qwen3_state_dict(state_dict: Mapping[str, Tensor], config: Qwen3ChainConfig) -> None:
    """Every expected name present with its shape, one float dtype, nothing unexpected."""
    expected = qwen3_state_dict_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise KeyError(f"state_dict is missing {len(missing)} weights, first: {missing[:3]}")
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [
        n
        for n in state_dict
        if n not in expected and n not in allowed_extra and not _is_ignorable(n)
    ]
    if unexpected:
        raise ValueError(
            f"state_dict has {len(unexpected)} weights the Qwen3 dense chain does not use, "
            f"first: {unexpected[:3]}"
        )
    dtype = state_dict["model.embed_tokens.weight"].dtype
    for name, shape in expected.items():
        t = check_tensor(name, state_dict[name], dtypes=FLOAT_DTYPES)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but model.embed_tokens.weight has {dtype}; "
                "all weights must share one dtype"
            )


def make_kv_caches(
    config: Qwen3ChainConfig,
    batch: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One ``KVCache`` per layer, for ``qwen3_forward(..., caches=...)``."""
    return [
        KVCache(
            batch,
            max_len,
            config.num_key_value_heads,
            config.head_dim,
            dtype,
            device,
            name=f"layer {i} kv_cache",
        )
        for i in range(config.num_hidden_layers)
    ]


def _residual_add(h: Tensor, delta: Tensor) -> Tensor:
    """``h + delta`` in fp32, one rounding to the model dtype (elementwise, no reduction)."""
    return (h.float() + delta.float()).to(h.dtype)


@dataclass(frozen=True)
class Qwen3Ops:
    """The ops one Qwen3 forward is written in, so one chain runs on several backends.

    ``REFERENCE_OPS`` (below) are the strict references; ``batchinv.models.qwen3.ops`` adds
    batchinv's public ops and stock PyTorch ops (what the audit compares).  Signatures:

    - ``embedding(ids, weight)``; ``linear(x, weight, bias)``; ``rms_norm(x, weight, eps)``;
      ``silu_mul(gate, up)``; ``residual_add(h, delta)``;
    - ``rope(q, k, position_ids, theta=, head_dim=, max_position=) -> (q, k)``;
    - ``attention(q, k, v, causal=, seqlens_q=, seqlens_k=)`` (padded),
      ``attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=)`` (packed),
      ``attention_with_kv_cache(q, k_new, v_new, cache, seq_ids, seqlens_new=, causal=)``;
    - ``log_softmax(x) -> fp32`` over the last dim;
    - ``token_logprobs(hidden, lm_head_weight, target_ids, ignore_index) -> fp32``.

    Optional fused steps, which the chain calls only where no gradient is needed (a fused
    op's backward may round differently from the unfused graph) and which must give the bits
    of the steps they replace; None: the chain runs those steps:

    - ``add_rms_norm(h, delta, weight, eps) -> (rms_norm(h + delta), h + delta)``, for
      ``residual_add`` followed by ``rms_norm``;
    - ``qk_norm_rope_attention_with_kv_cache(q, k_new, v_new, q_norm_weight, k_norm_weight,
      eps, position_ids, cache, seq_ids, theta=, head_dim=, max_position=, seqlens_new=,
      causal=)``, for the per-head q/k ``rms_norm``, ``rope`` and ``attention_with_kv_cache``
      (q, k_new, v_new as projected, ``[..., heads, head_dim]``);
    - ``linear_group(x, weights, biases) -> tuple | None``, for ``linear`` of one ``x`` by
      several weights (q/k/v, gate/up): the outputs ``linear(x, weights[i], biases[i])`` (views
      of one tensor are fine), or None where it does not apply (the chain then calls
      ``linear`` for each weight, so a table's ``linear`` serves every product it does not).

    Tensor-parallel hooks (``batchinv.distributed.qwen3`` fills them; None: the chain runs
    ``linear``):

    - ``row_parallel_linear(x, weight, bias, *, layer) -> x.dtype``, for the two projections
      whose K is split across ranks: ``layer`` is ``"self_attn.o_proj"`` or
      ``"mlp.down_proj"``, so the table knows which full K a shard belongs to.  A
      single-GPU table sets it too, to ``linear_k_groups``, to give the bits of the
      sharded layer;
    - ``logits(hidden, lm_head_weight) -> the weights' dtype``, for the final projection
      (a vocab-parallel table computes its vocabulary range and gathers the rest).
    """

    name: str
    embedding: Callable
    linear: Callable
    rms_norm: Callable
    rope: Callable
    attention: Callable
    attention_varlen: Callable
    attention_with_kv_cache: Callable
    silu_mul: Callable
    residual_add: Callable
    log_softmax: Callable
    token_logprobs: Callable
    add_rms_norm: Callable | None = None
    qk_norm_rope_attention_with_kv_cache: Callable | None = None
    linear_group: Callable | None = None
    row_parallel_linear: Callable | None = None
    logits: Callable | None = None


def add_then_rms_norm(residual_add: Callable, rms_norm: Callable) -> Callable:
    """An ``add_rms_norm`` entry made of a table's own ``residual_add`` and ``rms_norm``."""

    def add_rms_norm(h: Tensor, delta: Tensor, weight: Tensor, eps: float):
        h = residual_add(h, delta)
        return rms_norm(h, weight, eps), h

    return add_rms_norm


def _reference_log_softmax(x: Tensor) -> Tensor:
    return reference_log_softmax(x, -1, torch.float32)


REFERENCE_OPS = Qwen3Ops(
    name="reference",
    embedding=embedding_with_grad,
    linear=linear,
    rms_norm=rms_norm,
    rope=rope,
    attention=attention,
    attention_varlen=attention_varlen,
    attention_with_kv_cache=attention_with_kv_cache,
    silu_mul=silu_mul,
    residual_add=_residual_add,
    log_softmax=_reference_log_softmax,
    token_logprobs=reference_token_logprobs,
    add_rms_norm=add_then_rms_norm(_residual_add, rms_norm),
)


def _check_forward_args(
    input_ids: Tensor,
    config: Qwen3ChainConfig,
    seqlens: Tensor | None,
    caches: Sequence[KVCache] | None,
    cu_seqlens: Tensor | None = None,
) -> None:
    if cu_seqlens is not None:
        check_tensor("input_ids", input_ids, dtypes=INDEX_DTYPES, ndim=1)
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if seqlens is not None or caches is not None:
            raise ValueError("cu_seqlens (packed varlen) cannot be combined with seqlens or caches")
        if input_ids.shape[0] == 0:
            raise ValueError("empty batch: input_ids has no tokens")
        return
    check_tensor("input_ids", input_ids, dtypes=INDEX_DTYPES, ndim=2)
    if input_ids.shape[0] == 0:
        raise ValueError(f"empty batch: input_ids has shape {tuple(input_ids.shape)}")
    if seqlens is not None:
        check_tensor("seqlens", seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if seqlens.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"seqlens must have one entry per row of input_ids ({input_ids.shape[0]}), "
                f"got shape {tuple(seqlens.shape)}"
            )
    if caches is not None and len(caches) != config.num_hidden_layers:
        raise ValueError(
            f"caches must hold one KVCache per layer ({config.num_hidden_layers}), "
            f"got {len(caches)}"
        )


def check_kv_caches(
    input_ids: Tensor,
    config: Qwen3ChainConfig,
    seqlens: Tensor | None,
    caches: Sequence[KVCache],
    seq_ids: Tensor | None,
    weight: Tensor,
) -> None:
    """Every layer's cache can take this step, checked before layer 0 appends anything, so a
    forward that raises leaves every cache as it was: one layout, dtype and device per cache,
    the same slots and lengths in every layer, and room for the new tokens everywhere.

    Runs for ``KVCache``s; other cache objects (the decode runner's device-side layers) are
    checked by their own plan.  Reads ``seq_ids`` / ``seqlens`` to the host (one device sync
    when either is on a GPU; none for CPU tensors or None)."""
    if not any(isinstance(c, KVCache) for c in caches):
        return
    for i, cache in enumerate(caches):
        if not isinstance(cache, KVCache):
            raise TypeError(f"caches[{i}] must be a KVCache, got {type(cache).__name__}")
        layout = (cache.num_kv_heads, cache.head_dim)
        if layout != (config.num_key_value_heads, config.head_dim):
            raise ValueError(
                f"caches[{i}] ({cache.name}) stores [{cache.num_kv_heads}, {cache.head_dim}] "
                f"heads x head_dim but the model needs [{config.num_key_value_heads}, "
                f"{config.head_dim}]"
            )
        if cache.dtype != weight.dtype or cache.device != weight.device:
            raise TypeError(
                f"caches[{i}] ({cache.name}) holds {cache.dtype} on {cache.device} but the "
                f"model runs {weight.dtype} on {weight.device}"
            )
        if cache.batch != caches[0].batch:
            raise ValueError(
                f"caches[{i}] ({cache.name}) has {cache.batch} slots but caches[0] has "
                f"{caches[0].batch}"
            )
    ids, counts = host_index_copies(seq_ids=seq_ids, seqlens=seqlens)
    ids = caches[0]._checked_ids(ids)
    rows, width = input_ids.shape
    if ids.numel() != rows:
        raise ValueError(
            f"seq_ids names {ids.numel()} slots but input_ids has {rows} rows "
            f"(shape {tuple(input_ids.shape)})"
        )
    if counts is None:
        counts = torch.full((rows,), width, dtype=torch.int64)
    bad = (counts < 0) | (counts > width)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise ValueError(f"seqlens[{j}] = {int(counts[j])} is outside [0, {width}]")
    lengths = caches[0].host_lengths(ids)
    for i, cache in enumerate(caches):
        own = cache.host_lengths(ids)
        if not torch.equal(own, lengths):
            raise ValueError(
                f"caches[{i}] ({cache.name}) holds lengths {own.tolist()} for slots "
                f"{ids.tolist()} but caches[0] holds {lengths.tolist()}; every layer's cache "
                "must hold the same tokens"
            )
        over = (own + counts) > cache.max_len
        if bool(over.any()):
            j = int(over.nonzero()[0, 0])
            raise ValueError(
                f"caches[{i}] ({cache.name}): appending {int(counts[j])} keys to slot "
                f"{int(ids[j])} (length {int(own[j])}) would pass its capacity "
                f"max_len={cache.max_len}"
            )


def _position_ids(
    input_ids: Tensor,
    caches: Sequence[KVCache] | None,
    seq_ids: Tensor | None,
    cu_seqlens: Tensor | None,
) -> Tensor:
    """Absolute positions: from 0 in a prefill, after the cached prefix with caches."""
    device = input_ids.device
    if cu_seqlens is not None:
        total = input_ids.shape[0]
        cu = cu_seqlens.to(device, torch.int64)
        owner = torch.searchsorted(cu[1:], torch.arange(total, device=device), right=True)
        return torch.arange(total, device=device) - cu[owner.clamp(max=cu.numel() - 1)]
    batch, seq = input_ids.shape
    offsets = torch.arange(seq, device=device)
    if caches is None:
        return offsets.expand(batch, seq)
    start = caches[0].slot_lengths(seq_ids)  # from the cache's host lengths: no device sync
    return start[:, None] + offsets[None, :]


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _add_rms_norm(
    ops: Qwen3Ops, h: Tensor, delta: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(h + delta), h + delta)``, or ``(rms_norm(h), h)`` without a delta: the
    table's fused ``add_rms_norm`` where no gradient is needed."""
    if delta is None:
        return ops.rms_norm(h, weight, eps), h
    if ops.add_rms_norm is not None and not _needs_grad(h, delta, weight):
        return ops.add_rms_norm(h, delta, weight, eps)
    h = ops.residual_add(h, delta)
    return ops.rms_norm(h, weight, eps), h


def _row_parallel_linear(
    ops: Qwen3Ops, x: Tensor, weight: Tensor, bias: Tensor | None, layer: str
) -> Tensor:
    if ops.row_parallel_linear is None:
        return ops.linear(x, weight, bias)
    return ops.row_parallel_linear(x, weight, bias, layer=layer)


def qwen3_logits(ops: Qwen3Ops, hidden: Tensor, lm_head: Tensor) -> Tensor:
    """The logits of the final-normed ``hidden``: the table's ``logits`` hook, else
    ``linear(hidden, lm_head, None)``."""
    if ops.logits is None:
        return ops.linear(hidden, lm_head, None)
    return ops.logits(hidden, lm_head)


def _linear_group(
    ops: Qwen3Ops, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]
) -> tuple[Tensor, ...]:
    """``linear(x, weights[i], biases[i])`` for each weight: the table's ``linear_group`` where
    no gradient is needed and it applies, else one ``linear`` per weight."""
    if ops.linear_group is not None:
        tensors = [b for b in biases if b is not None]
        if not _needs_grad(x, *weights, *tensors):
            outputs = ops.linear_group(x, weights, biases)
            if outputs is not None:
                return tuple(outputs)
    return tuple(ops.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def lm_head_weight(state_dict: Mapping[str, Tensor], config: Qwen3ChainConfig) -> Tensor:
    """The lm_head weight (``embed_tokens`` when the embeddings are tied)."""
    tied = config.tie_word_embeddings
    return state_dict["model.embed_tokens.weight" if tied else "lm_head.weight"]


def qwen3_final_hidden(
    input_ids: Tensor,
    state_dict: Mapping[str, Tensor],
    config: Qwen3ChainConfig,
    *,
    seqlens: Tensor | None = None,
    caches: Sequence[KVCache] | None = None,
    seq_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    check_weights: bool = True,
    ops: Qwen3Ops = REFERENCE_OPS,
) -> Tensor:
    """The final-normed hidden states ``[*input_ids.shape, hidden]``: ``qwen3_forward``
    without the lm_head (what ``token_logprobs`` consumes).  Arguments as there."""
    _check_forward_args(input_ids, config, seqlens, caches, cu_seqlens)
    if check_weights:
        check_qwen3_state_dict(state_dict, config)
    if caches is not None:
        check_kv_caches(
            input_ids, config, seqlens, caches, seq_ids, state_dict["model.embed_tokens.weight"]
        )
    w = state_dict
    tokens = tuple(input_ids.shape)
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    eps = config.rms_norm_eps
    position_ids = _position_ids(input_ids, caches, seq_ids, cu_seqlens)

    def bias(name: str) -> Tensor | None:
        return w[name] if config.attention_bias else None

    rope_params = dict(
        theta=config.rope_theta, head_dim=head_dim, max_position=config.max_position_embeddings
    )
    h = ops.embedding(input_ids, w["model.embed_tokens.weight"])
    delta = None  # the last MLP output, added to h together with the next norm
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x, h = _add_rms_norm(ops, h, delta, w[p + "input_layernorm.weight"], eps)
        projections = [p + f"self_attn.{name}_proj" for name in "qkv"]
        q, k, v = _linear_group(
            ops,
            x,
            [w[name + ".weight"] for name in projections],
            [bias(name + ".bias") for name in projections],
        )
        q = q.reshape(*tokens, heads, head_dim)
        k = k.reshape(*tokens, kv_heads, head_dim)
        v = v.reshape(*tokens, kv_heads, head_dim)
        q_norm, k_norm = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        fused = ops.qk_norm_rope_attention_with_kv_cache
        if caches is not None and fused is not None and not _needs_grad(q, k, v, q_norm, k_norm):
            attn = fused(
                q, k, v, q_norm, k_norm, eps, position_ids, caches[i], seq_ids,
                **rope_params, seqlens_new=seqlens, causal=True,
            )  # fmt: skip
        else:
            q, k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
            q, k = ops.rope(q, k, position_ids, **rope_params)
            if cu_seqlens is not None:
                attn = ops.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=True)
            elif caches is None:
                attn = ops.attention(q, k, v, causal=True, seqlens_q=seqlens, seqlens_k=seqlens)
            else:
                attn = ops.attention_with_kv_cache(
                    q, k.detach(), v.detach(), caches[i], seq_ids, seqlens_new=seqlens, causal=True
                )
        o = _row_parallel_linear(
            ops,
            attn.reshape(*tokens, heads * head_dim),
            w[p + "self_attn.o_proj.weight"],
            bias(p + "self_attn.o_proj.bias"),
            "self_attn.o_proj",
        )
        x, h = _add_rms_norm(ops, h, o, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = _linear_group(
            ops, x, [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], [None, None]
        )
        delta = _row_parallel_linear(
            ops, ops.silu_mul(gate, up), w[p + "mlp.down_proj.weight"], None, "mlp.down_proj"
        )
    return _add_rms_norm(ops, h, delta, w["model.norm.weight"], eps)[0]


def qwen3_forward(
    input_ids: Tensor,
    state_dict: Mapping[str, Tensor],
    config: Qwen3ChainConfig,
    *,
    seqlens: Tensor | None = None,
    caches: Sequence[KVCache] | None = None,
    seq_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    check_weights: bool = True,
    ops: Qwen3Ops = REFERENCE_OPS,
) -> Tensor:
    """Logits ``[B, S, vocab]`` in the weights' dtype for ``input_ids [B, S]``.

    Without ``caches``: a prefill, token ``i`` at position ``i``.  With ``caches`` (one
    ``KVCache`` per layer, see ``make_kv_caches``): ``input_ids`` are the next tokens of
    cache slots ``seq_ids`` (default all); token ``i`` of row ``b`` sits at position
    ``cache length of b + i`` and its keys/values are appended to the caches.  With
    ``cu_seqlens [n+1]``: ``input_ids [T]`` holds ``n`` sequences packed back to back
    (varlen), and the logits are ``[T, vocab]``.  ``ops`` picks the implementation of
    every step (default: the strict references).
    """
    h = qwen3_final_hidden(
        input_ids,
        state_dict,
        config,
        seqlens=seqlens,
        caches=caches,
        seq_ids=seq_ids,
        cu_seqlens=cu_seqlens,
        check_weights=check_weights,
        ops=ops,
    )
    return qwen3_logits(ops, h, lm_head_weight(state_dict, config))


def qwen3_forward_fp32(
    input_ids: Tensor,
    state_dict: Mapping[str, Tensor],
    config: Qwen3ChainConfig,
    **kwargs,
) -> Tensor:
    """Strict fp32 chain: weights upcast, same ops, inside ``deterministic_context``."""
    from ..contract import deterministic_context

    check_qwen3_state_dict(state_dict, config)
    weights32 = {name: t.float() for name, t in state_dict.items()}
    with deterministic_context():
        return qwen3_forward(input_ids, weights32, config, check_weights=False, **kwargs)


class Qwen3Reference(nn.Module):
    """The chain as a module holding the weights as parameters (dots become ``__``)."""

    def __init__(self, state_dict: Mapping[str, Tensor], config: Qwen3ChainConfig):
        super().__init__()
        check_qwen3_state_dict(state_dict, config)
        self.config = config
        self._names = list(qwen3_state_dict_shapes(config))
        for name in self._names:
            self.register_parameter(
                name.replace(".", "__"), nn.Parameter(state_dict[name].detach().clone())
            )

    def hf_state_dict(self) -> dict[str, Tensor]:
        return {name: getattr(self, name.replace(".", "__")) for name in self._names}

    def forward(self, input_ids: Tensor, **kwargs) -> Tensor:
        return qwen3_forward(input_ids, self.hf_state_dict(), self.config, **kwargs)

    def forward_fp32(self, input_ids: Tensor, **kwargs) -> Tensor:
        return qwen3_forward_fp32(input_ids, self.hf_state_dict(), self.config, **kwargs)
