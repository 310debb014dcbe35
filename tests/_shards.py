"""``pytest --shard K/N``: the K-th of N contiguous parts of the collected tests.

A parity run that one machine call cannot hold runs in parts (each call one shard, then
``tools/merge_parity_reports.py``).  Contiguous parts keep a file's tests, and its module-scoped
fixtures, together; collection order is deterministic for one tree and one machine, so the N
parts of one run cover every test exactly once.
"""

from __future__ import annotations


def parse_shard(spec: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``; ValueError naming the option otherwise."""
    parts = spec.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--shard must be K/N with whole numbers, got {spec!r}")
    k, n = (int(p) for p in parts)
    if not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N, got {spec!r}")
    return k, n


def shard_bounds(total: int, k: int, n: int) -> tuple[int, int]:
    """``[lo, hi)``: the indices of part ``k`` of ``n`` of ``total`` items."""
    return total * (k - 1) // n, total * k // n
