"""Counting the host syncs a piece of GPU work makes (PyTorch's sync debug mode), and timing
whether a loop of it is host-bound.

A decode step or a training step that waits for the GPU cannot run ahead of it; these helpers
say how often that happens, which is what batchinv's "no host sync" claims are tested with.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

# The text of the warning PyTorch emits for each synchronizing CUDA call in mode "warn".
_SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block ("error" raises on a sync),
    the previous mode restored after it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def count_host_syncs(fn: Callable[[], T]) -> tuple[T, int]:
    """``(fn(), the number of synchronizing CUDA calls it made)``; the device is synchronized
    first so that earlier work cannot be counted."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug_mode("warn"):
            result = fn()
    return result, sum(_SYNC_WARNING in str(w.message) for w in caught)


def host_and_wall_seconds(
    fn: Callable[[], object], calls: int, warmup: int = 0
) -> tuple[float, float]:
    """Seconds per call of ``calls`` calls of ``fn`` (after ``warmup`` untimed ones): until the
    calls return (host) and until the GPU has finished them (wall).  Equal numbers mean the
    loop is host-bound: the GPU waited for the host."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    returned = time.perf_counter()
    torch.cuda.synchronize()
    finished = time.perf_counter()
    return (returned - start) / calls, (finished - start) / calls
