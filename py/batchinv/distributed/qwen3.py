"""Qwen3 under tensor parallelism: the layout, the state-dict shard and the op tables.

A TP = T Qwen3 gives the bits of one GPU running ``tp_compatible_ops`` (prefill logits,
token logprobs, eager decode), because every step either does not depend on the split or
reproduces the single GPU's order:

- q/k/v and gate/up are column-parallel: a rank runs the plain ``linear`` on its rows of the
  weight; every output column is the same K chain whatever columns a rank holds, and the next
  op (q/k norm, RoPE, attention per head; SiLU-mul per column) consumes the local columns;
- o_proj and down_proj are row-parallel through the chain's ``row_parallel_linear`` hook:
  each rank holds whole K groups (``K_GROUPS``, ``k_group_width``), the group partials are
  combined in the fixed tree across ranks (``batchinv.distributed.row_parallel_linear``),
  so the output is ``linear_k_groups`` of the whole layer -- the row-parallel layers of
  ``tp_compatible_ops``, which is why a trainer must use that table, not ``BATCHINV_OPS``
  (its ``linear`` reduces K as one sequential chain, another order);
- the logits and the token logprobs are vocab-parallel over whole ``VOCAB_TILE`` tiles
  (``vocab_parallel_logits``, ``vocab_parallel_token_logprobs``): the single GPU's tile
  states, merged in the single GPU's order;
- embedding, norms, residual stream: replicated (each rank holds and computes them whole).

The head split follows the K groups of o_proj: rank ``r`` holds the heads whose o_proj
columns fall in its group range ``group_ranges(K_GROUPS, T)[r]``.  That range must start and
end on a kv-group boundary (a multiple of ``heads // kv_heads * head_dim`` columns, so each
rank's q heads use only its own kv heads) and hold at least one head; the intermediate split
follows down_proj's K groups the same way and must give every rank at least one column.
For ``T`` in {1, 2, 4, 8}, ``heads * head_dim`` a multiple of ``64 * K_GROUPS`` and
``kv_heads % T == 0`` this is the even split.  Other world sizes give uneven splits where the
boundaries allow it: at ``T = 3`` ranks hold 3, 3 and 2 of the 8 groups, so e.g. 16 q heads
/ 8 kv heads of ``head_dim`` 32 split 6 / 6 / 4 (3 / 3 / 2 kv heads).  A layout that does not
fit raises ``ValueError`` naming ``world``.

Supported under TP: ``Qwen3.forward`` (prefill, padded, packed, with KV caches),
``Qwen3.token_logprobs``, ``prefill_chunked`` and eager ``Qwen3.generate`` (greedy, or with
a ``generator`` seeded alike on every rank).  The decode runner (``seeds``, ``cuda_graph``,
``return_logprobs``) runs the single-GPU table and raises under TP.  Forward only: the
row-parallel and vocab-parallel steps do not take gradients.

The anchor that batchinv's TP is measured and compared against is ``stock_tensor_parallel_ops``
(Megatron-style, over ``STOCK_OPS``): the same shards, bf16 partials summed by the backend's
``all_reduce`` -- not one GPU's bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..ops.linear_k_groups import K_GROUPS, linear_k_groups
from ..reference.qwen3_chain import (
    Qwen3ChainConfig,
    Qwen3Ops,
    check_qwen3_state_dict,
    qwen3_state_dict_shapes,
)
from ..reference.token_logprobs import token_logprobs_tiled
from .all_reduce import backend_all_reduce, gather_stacked
from .linear import k_range, row_parallel_linear
from .lm_head import vocab_parallel_logits, vocab_parallel_token_logprobs, vocab_ranges

__all__ = [
    "Qwen3RankLayout",
    "qwen3_tp_layout",
    "shard_qwen3_state_dict",
    "stock_tensor_parallel_ops",
    "stock_tensor_parallel_qwen3",
    "tensor_parallel_ops",
    "tensor_parallel_qwen3",
    "tp_compatible_ops",
    "tp_compatible_qwen3",
]

# The chain's row-parallel layers, as its hook names them.
ROW_PARALLEL_LAYERS = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Qwen3RankLayout:
    """What one rank of a TP Qwen3 holds: half-open ranges over the full model's axes."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def _k_column_ranges(in_features: int, world: int) -> list[tuple[int, int]]:
    """The K columns each rank's whole groups cover (the last group may be partial)."""
    return [k_range(in_features, rank, world) for rank in range(world)]


def _check_world(world: object, rank: object | None = None) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= K_GROUPS:
        raise ValueError(
            f"world must be an int in [1, {K_GROUPS}] (each rank holds whole K groups of the "
            f"row-parallel layers), got {world!r}"
        )
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world
    ):
        raise ValueError(f"rank must be an int in [0, world={world}), got {rank!r}")


def qwen3_tp_layout(config: Qwen3ChainConfig, world: int) -> list[Qwen3RankLayout]:
    """Every rank's heads, intermediate columns and vocabulary range at TP = ``world``.

    Raises ``ValueError`` naming ``world`` when the K-group boundaries of o_proj do not fall
    on kv-group boundaries, or a rank would hold no head or no intermediate column."""
    _check_world(world)
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    group_heads = heads // kv_heads  # q heads per kv head
    block = group_heads * head_dim  # o_proj columns per kv head
    attn = _k_column_ranges(heads * head_dim, world)
    for r, (lo, hi) in enumerate(attn):
        if lo % block or hi % block or hi == lo:
            raise ValueError(
                f"world={world} does not fit the attention heads: rank {r}'s K groups of "
                f"o_proj cover columns [{lo}, {hi}) of {heads * head_dim}, which is not a "
                f"non-empty whole number of kv-head blocks ({group_heads} q heads x head_dim "
                f"{head_dim} = {block} columns); a world dividing 8 and num_key_value_heads "
                "fits whenever heads*head_dim is a multiple of 512"
            )
    inter = _k_column_ranges(config.intermediate_size, world)
    for r, (lo, hi) in enumerate(inter):
        if hi == lo:
            raise ValueError(
                f"world={world} leaves rank {r} no intermediate column: down_proj's K groups "
                f"(intermediate_size={config.intermediate_size}) cover only the first ranks"
            )
    vocab = vocab_ranges(config.vocab_size, world)
    return [
        Qwen3RankLayout(
            rank=r,
            world=world,
            q_heads=(attn[r][0] // head_dim, attn[r][1] // head_dim),
            kv_heads=(attn[r][0] // block, attn[r][1] // block),
            intermediate=inter[r],
            vocab=tuple(vocab[r]),
        )
        for r in range(world)
    ]


def shard_qwen3_state_dict(
    state_dict: Mapping[str, Tensor], config: Qwen3ChainConfig, rank: int, world: int
) -> tuple[dict[str, Tensor], Qwen3ChainConfig]:
    """Rank ``rank``'s weights at TP = ``world`` and the config its chain runs with.

    q/k/v (and their biases) and gate/up: the rank's output rows; o_proj and down_proj: the
    rank's K columns (contiguous copies); the o_proj bias, the embedding, the norms and the
    lm_head: whole (the bias is added once, after the tree; the vocab-parallel ops slice the
    lm_head).  The config keeps ``hidden_size`` and ``vocab_size`` and holds the rank's
    ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size``."""
    _check_world(world, rank)
    check_qwen3_state_dict(state_dict, config)
    layout = qwen3_tp_layout(config, world)[rank]
    head_dim = config.head_dim
    q_lo, q_hi = (h * head_dim for h in layout.q_heads)
    kv_lo, kv_hi = (h * head_dim for h in layout.kv_heads)
    i_lo, i_hi = layout.intermediate
    shard_config = replace(
        config,
        num_attention_heads=layout.q_heads[1] - layout.q_heads[0],
        num_key_value_heads=layout.kv_heads[1] - layout.kv_heads[0],
        intermediate_size=i_hi - i_lo,
    )
    rows = {
        "self_attn.q_proj": (q_lo, q_hi),
        "self_attn.k_proj": (kv_lo, kv_hi),
        "self_attn.v_proj": (kv_lo, kv_hi),
        "mlp.gate_proj": (i_lo, i_hi),
        "mlp.up_proj": (i_lo, i_hi),
    }
    columns = {"self_attn.o_proj.weight": (q_lo, q_hi), "mlp.down_proj.weight": (i_lo, i_hi)}
    shard: dict[str, Tensor] = {}
    for name in qwen3_state_dict_shapes(config):
        t = state_dict[name]
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        module = suffix.rpartition(".")[0]
        if module in rows:
            lo, hi = rows[module]
            t = t[lo:hi]
        elif suffix in columns:
            lo, hi = columns[suffix]
            t = t[:, lo:hi].contiguous()
        shard[name] = t
    return shard, shard_config


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_ops needs an initialised torch.distributed process group "
            "(dist.init_process_group)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _vocab_rows(weight: Tensor, vocab: int, rows: tuple[int, int]) -> Tensor:
    """This rank's ``rows`` of the whole lm_head ``weight`` (checked to be whole)."""
    lo, hi = rows
    if weight.shape[0] != vocab:
        raise ValueError(
            f"lm_head_weight must be the whole [{vocab}, hidden] weight (every rank holds "
            f"it; the vocab-parallel ops take rows [{lo}, {hi})), got shape "
            f"{tuple(weight.shape)}"
        )
    return weight[lo:hi]


def tensor_parallel_ops(base_ops: Qwen3Ops, config: Qwen3ChainConfig, group=None) -> Qwen3Ops:
    """This rank's op table for the chain over its shard (``shard_qwen3_state_dict``).

    ``config`` is the full model's config (the row-parallel layers need the full K, the
    vocab-parallel steps the full vocabulary).  ``base_ops`` runs every per-rank step; the
    table adds ``row_parallel_linear`` (o_proj, down_proj), ``logits`` and
    ``token_logprobs`` (vocab-parallel), which communicate over ``group`` (default: the
    world).  Every rank must run the same calls in the same order (collectives)."""
    rank, world = _rank_world(group)
    layout = qwen3_tp_layout(config, world)[rank]
    in_features = {
        "self_attn.o_proj": config.num_attention_heads * config.head_dim,
        "mlp.down_proj": config.intermediate_size,
    }
    vocab = config.vocab_size

    def row_parallel(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: str) -> Tensor:
        return row_parallel_linear(x, weight, bias, in_features=in_features[layer], group=group)

    def local_rows(weight: Tensor) -> Tensor:
        return _vocab_rows(weight, vocab, layout.vocab)

    def logits(hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        return vocab_parallel_logits(hidden, local_rows(lm_head_weight), vocab=vocab, group=group)

    def token_logprobs(
        hidden: Tensor, lm_head_weight: Tensor, target_ids: Tensor, ignore_index: int
    ) -> Tensor:
        return vocab_parallel_token_logprobs(
            hidden,
            local_rows(lm_head_weight),
            target_ids,
            ignore_index,
            vocab=vocab,
            group=group,
        )

    return replace(
        base_ops,
        name=f"{base_ops.name}-tp{world}",
        row_parallel_linear=row_parallel,
        logits=logits,
        token_logprobs=token_logprobs,
    )


def tp_compatible_ops(base_ops: Qwen3Ops) -> Qwen3Ops:
    """The single-GPU table whose bits a TP sampler over ``base_ops`` reproduces.

    ``base_ops`` with ``row_parallel_linear = linear_k_groups`` (o_proj and down_proj in the
    K-group order).  Logits are ``base_ops.linear`` (column-parallel is exact).  Token
    logprobs: ``base_ops.token_logprobs`` on CUDA (the vocab-parallel op merges its tiles);
    on the CPU the tiled reference (``VOCAB_TILE`` tiles in the same fixed order), whose
    bits are what the vocab-parallel CPU path gives -- not the strict reference's."""

    def row_parallel(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: str) -> Tensor:
        if layer not in ROW_PARALLEL_LAYERS:
            raise ValueError(f"layer must be one of {ROW_PARALLEL_LAYERS}, got {layer!r}")
        return linear_k_groups(x, weight, bias)

    def token_logprobs(
        hidden: Tensor, lm_head_weight: Tensor, target_ids: Tensor, ignore_index: int
    ) -> Tensor:
        if hidden.is_cuda:
            return base_ops.token_logprobs(hidden, lm_head_weight, target_ids, ignore_index)
        return token_logprobs_tiled(hidden, lm_head_weight, target_ids, ignore_index)

    return replace(
        base_ops,
        name=f"{base_ops.name}-tp-compatible",
        row_parallel_linear=row_parallel,
        token_logprobs=token_logprobs,
    )


def tensor_parallel_qwen3(model, group=None, *, ops: Qwen3Ops | None = None):
    """This rank's ``Qwen3`` of the TP model built from a whole ``model`` (every rank passes
    the same weights): its shard of the weights, the per-rank config, and
    ``tensor_parallel_ops`` over ``ops`` (default: the model's table).  The result's
    ``forward``, ``token_logprobs`` and eager ``generate`` give, on every rank, the bits of
    ``tp_compatible_qwen3(model)`` on one device."""
    from ..models.qwen3 import Qwen3

    rank, world = _rank_world(group)
    table = tensor_parallel_ops(model.ops if ops is None else ops, model.config, group)
    with torch.no_grad():  # the shard's copies are weights, not part of a graph
        shard, shard_config = shard_qwen3_state_dict(
            model.hf_state_dict(), model.config, rank, world
        )
        return Qwen3(shard_config, shard, ops=table)


def tp_compatible_qwen3(model, *, ops: Qwen3Ops | None = None):
    """A single-device ``Qwen3`` with ``model``'s weights and ``tp_compatible_ops`` over
    ``ops`` (default: the model's table): the bits every TP degree reproduces."""
    from ..models.qwen3 import Qwen3

    table = tp_compatible_ops(model.ops if ops is None else ops)
    with torch.no_grad():
        return Qwen3(model.config, model.hf_state_dict(), ops=table)


def stock_tensor_parallel_ops(config: Qwen3ChainConfig, group=None) -> Qwen3Ops:
    """This rank's stock (Megatron-style) TP table over ``STOCK_OPS``, for the shard of
    ``shard_qwen3_state_dict``: the anchor a batchinv TP model is compared and timed against.

    - o_proj, down_proj (``row_parallel_linear``): ``F.linear`` of the rank's K shard, the
      backend's ``all_reduce`` of the partials in the model dtype (NCCL picks the order, bf16
      partials are rounded before the sum), then the bias;
    - logits: ``F.linear`` of the rank's vocabulary rows (``vocab_ranges``, the batchinv
      table's split), gathered in rank order (``all_gather``, bytes only);
    - token logprobs: ``STOCK_OPS``' on the whole lm_head, on every rank.
    Not bitwise one GPU's.  ``config`` is the full model's; every rank must run the same
    calls in the same order (collectives)."""
    from ..models.qwen3.ops import STOCK_OPS

    rank, world = _rank_world(group)
    vocab = config.vocab_size
    ranges = vocab_ranges(vocab, world)
    widest = max(hi - lo for lo, hi in ranges)

    def row_parallel(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: str) -> Tensor:
        del layer  # the stock layer needs no K layout: the backend sums whatever arrives
        partial = F.linear(x, weight)
        backend_all_reduce(partial, group)
        return partial if bias is None else partial + bias

    def logits(hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        local = F.linear(hidden, _vocab_rows(lm_head_weight, vocab, ranges[rank]))
        if local.shape[-1] != widest:  # all_gather takes equal shapes: pad the short ranges
            local = F.pad(local, (0, widest - local.shape[-1]))
        stacked = gather_stacked(local, group)
        return torch.cat([stacked[r, ..., : hi - lo] for r, (lo, hi) in enumerate(ranges)], -1)

    return replace(
        STOCK_OPS, name=f"stock-tp{world}", row_parallel_linear=row_parallel, logits=logits
    )


def stock_tensor_parallel_qwen3(model, group=None):
    """This rank's ``Qwen3`` of the stock TP model (``stock_tensor_parallel_ops`` over
    ``group``) built from a whole ``model`` (every rank passes the same weights): the same
    shards as ``tensor_parallel_qwen3``."""
    from ..models.qwen3 import Qwen3

    rank, world = _rank_world(group)
    table = stock_tensor_parallel_ops(model.config, group)
    with torch.no_grad():
        shard, shard_config = shard_qwen3_state_dict(
            model.hf_state_dict(), model.config, rank, world
        )
        return Qwen3(shard_config, shard, ops=table)
