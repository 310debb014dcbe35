"""Value checks that run on the device and raise later: what a CUDA-graph capture allows.

An op that must check values only the GPU holds (embedding ids, RoPE positions, token-logprob
targets) reads a flag its kernel wrote; that read is a host sync, which a CUDA-graph capture
(``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) forbids.  Under capture, or
inside ``deferred()``, the op instead ORs its check's bit into a per-device word with one small
device op and returns; the kernel has already made the bad rows harmless (NaN rows, nothing
written out of bounds).  ``raise_device_errors()`` reads the word (one sync), clears it and
raises the first failed check's error, naming the op and the argument.  Outside capture and
``deferred()``, ops check at once as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

# bit -> (error type, message): one per (op, argument) checked on the device.
CHECKS: dict[int, tuple[type[Exception], str]] = {
    1 << 0: (IndexError, "embedding: ids holds an id outside [0, num_embeddings)"),
    1 << 1: (IndexError, "rope: position_ids holds a position outside [0, max_position)"),
    1 << 2: (IndexError, "token_logprobs: target_ids holds an id outside [0, vocab)"),
    1 << 3: (
        ValueError,
        "attention: attention_mask of a decode row is not one run of visible keys in a 0/-inf "
        "mask shared by all heads, which a captured decode step needs (the row's output was "
        "set to zeros; eager calls take the packed route for such a mask)",
    ),
}
EMBEDDING_IDS, ROPE_POSITIONS, TOKEN_LOGPROBS_TARGETS, DECODE_ATTENTION_MASK = CHECKS

_words: dict[torch.device, Tensor] = {}
_local = threading.local()


def word(device: torch.device) -> Tensor:
    """The device's status word (int64 ``[1]``, zero while every check passed)."""
    key = device
    if device.type == "cuda" and device.index is None:
        key = torch.device("cuda", torch.cuda.current_device())
    found = _words.get(key)
    if found is None:
        if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "batchinv.device_checks: call batchinv.device_checks.word(device) once before "
                "capturing (its word is allocated outside any graph)"
            )
        found = _words[key] = torch.zeros(1, dtype=torch.int64, device=key)
    return found


_unread: dict[torch.device, Tensor] = {}


def unread_flag(device: torch.device) -> Tensor:
    """A first-bad-position flag (int64 ``[1]``) that a kernel may write and nobody reads: for
    a call that skips its value check.  One per device, reused by every such call (no fill
    launch per call); one first asked for under CUDA-graph capture is a fresh one in the
    graph's pool and is not kept."""
    flag = _unread.get(device)
    if flag is None:
        flag = torch.full((1,), -1, dtype=torch.int64, device=device)  # UINT64_MAX
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _unread[device] = flag
    return flag


def deferring(device: torch.device | None = None) -> bool:
    """Whether a value check must not sync now: under CUDA-graph capture or ``deferred()``.

    Given the op's ``device``, an eager call also allocates that device's word: torch.compile's
    CUDA graphs (``mode="reduce-overhead"``) run each op eagerly before capturing it, and the
    capture then finds the word it cannot allocate itself.
    """
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if device is not None and not capturing:
        word(device)
    return capturing or getattr(_local, "deferred", 0) > 0


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Eager calls inside defer their value checks too (no sync per call); call
    ``raise_device_errors()`` where a sync is acceptable."""
    _local.deferred = getattr(_local, "deferred", 0) + 1
    try:
        yield
    finally:
        _local.deferred -= 1


def record(bit: int, failed: Tensor) -> None:
    """ORs ``bit`` into the word of ``failed``'s device where the bool tensor has any True."""
    if bit not in CHECKS:
        raise ValueError(f"unknown device check bit {bit}")
    target = word(failed.device)
    target.bitwise_or_(failed.any().to(torch.int64) * bit)


def raise_device_errors(device: torch.device | str | None = None) -> None:
    """Reads the status word of ``device`` (default: every device with one; a host sync),
    clears it and raises the first failed check's error."""
    if device is None:
        devices = list(_words)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    for key in devices:
        status = _words.get(key)
        if status is None:
            continue
        value = int(status.item())
        if value:
            status.zero_()
            for bit, (error, message) in CHECKS.items():
                if value & bit:
                    raise error(f"{message} (found on {key} by a deferred check)")
