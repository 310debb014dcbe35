"""Tensor parallelism on ``torch.distributed`` whose results are bitwise the single GPU's.

What is invariant (bitwise, for every world size that divides the layer):
- ``column_parallel_linear`` (gathered): ``batchinv.linear`` of the full weight.  Splitting
  the output features leaves every column's K reduction as it is.
- ``row_parallel_linear``: ``batchinv.linear_k_groups`` of the full layer (not
  ``batchinv.linear``: the K-group tree is the K order a split K can reproduce), for world
  sizes 1 to ``K_GROUPS``.  Ranks exchange fp32 node sums of the fixed tree; no backend adds.
- ``vocab_parallel_logits``: ``batchinv.lm_head``; ``vocab_parallel_token_logprobs``:
  ``batchinv.token_logprobs`` on CUDA (the CPU form equals its own TP = 1, the tiled
  reference, not the CPU op's default chunking).
- ``invariant_all_reduce``: the same bits on every rank, whatever the arrival order.
- A Qwen3 (``tensor_parallel_qwen3``, ``batchinv.distributed.qwen3``): logits, token
  logprobs and eager decode of ``tp_compatible_qwen3`` on one GPU.

What is not: ``invariant_all_reduce`` alone is not a single GPU's sum (the single GPU adds
in another order); a stock row-parallel layer (``torch.mm`` per rank and
``dist.all_reduce`` of bf16 partials) differs from one GPU.  The layers are forward-only.

Transport is ``torch.distributed`` only (gloo on the CPU, NCCL on CUDA): ``all_gather``
copies bytes, every add happens in a fixed order on every rank.
"""

from .all_reduce import backend_all_reduce, gather_stacked, gather_variable, invariant_all_reduce
from .linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    column_range,
    k_range,
    row_parallel_linear,
    shard_columns,
    shard_k,
)
from .lm_head import vocab_parallel_logits, vocab_parallel_token_logprobs, vocab_ranges
from .qwen3 import (
    Qwen3RankLayout,
    qwen3_tp_layout,
    shard_qwen3_state_dict,
    stock_tensor_parallel_ops,
    stock_tensor_parallel_qwen3,
    tensor_parallel_ops,
    tensor_parallel_qwen3,
    tp_compatible_ops,
    tp_compatible_qwen3,
)
from .tree import (
    canonical_nodes,
    finish_tree,
    group_ranges,
    node_counts,
    rank_tree_sum,
    reduce_range,
)

__all__ = [
    "ColumnParallelLinear",
    "Qwen3RankLayout",
    "RowParallelLinear",
    "backend_all_reduce",
    "canonical_nodes",
    "column_parallel_linear",
    "column_range",
    "finish_tree",
    "gather_stacked",
    "gather_variable",
    "group_ranges",
    "invariant_all_reduce",
    "k_range",
    "node_counts",
    "qwen3_tp_layout",
    "rank_tree_sum",
    "reduce_range",
    "row_parallel_linear",
    "shard_columns",
    "shard_k",
    "shard_qwen3_state_dict",
    "stock_tensor_parallel_ops",
    "stock_tensor_parallel_qwen3",
    "tensor_parallel_ops",
    "tensor_parallel_qwen3",
    "tp_compatible_ops",
    "tp_compatible_qwen3",
    "vocab_parallel_logits",
    "vocab_parallel_token_logprobs",
    "vocab_ranges",
]
