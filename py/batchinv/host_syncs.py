"""Counting the host syncs a piece of GPU work makes (PyTorch's sync debug mode).

A decode step or a training step that waits for the GPU cannot run ahead of it; these helpers
say how often that happens, which is what batchinv's "no host sync" claims are tested with.
"""

from __future__ import annotations

import contextlib
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
