"""Shapes that tests and benchmarks share, kept as data in one place."""

from __future__ import annotations

# Qwen3-8B's configuration but its layer count (``Qwen3Config`` / transformers' ``Qwen3Config``
# keyword arguments): the production shapes of the audit and the model benchmarks.
QWEN3_8B_CONFIG = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)

# Qwen3-8B linear layers as (name, in_features K, out_features N).
QWEN3_8B_LINEAR = (
    ("qkv_proj", 4096, 6144),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 4096, 24576),
    ("down_proj", 12288, 4096),
    ("lm_head", 4096, 151936),
)

# Token counts of the bitwise M sweep: 1, 2, 3, 17, 64, 65, 257, 1024, 4096, 8191, plus 9 and
# 16, which sit on either side of the small-M kernel's switches (gpu/linear.py).
LINEAR_M_SWEEP = (1, 2, 3, 9, 16, 17, 64, 65, 257, 1024, 4096, 8191)

# Batches of the large-M invariance tests, up to the 16-64k rows a trainer recomputes: the
# first batch on the pinned cuBLASLt path, then sizes that are no multiple of any tile.  Each
# batch is compared at the rows below (both ends, tile and MIN_ROWS boundaries), not everywhere.
LINEAR_LARGE_M = (1024, 4099, 16411, 32768)
LINEAR_LARGE_M_ROWS = (0, 1, 127, 1023, 1024, 4098, 8191, 16410, 32767)

# Token counts the linear benchmark reports (decode, small batch, prefill).
LINEAR_BENCH_M = (1, 16, 64, 4096)
