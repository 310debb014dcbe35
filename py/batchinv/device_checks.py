"""Value checks that run on the device and raise later: what a CUDA-graph capture allows.

An op that must check values only the GPU holds (embedding ids, RoPE positions, token-logprob
targets) reads a flag its kernel wrote; that read is a host sync, which a CUDA-graph capture
(``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``) forbids.  Under capture, or
inside ``deferred()``, the op instead marks its check failed on the device and returns; the
kernel has already made the bad rows harmless (NaN rows, nothing written out of bounds).

Each device holds one int64 status tensor, allocated outside any graph: a word of check bits
(``word()``, zero while every check passed), then one flag per check in ``FLAGGED``
(``flag()``, -1 while that check passed).  The embedding and RoPE kernels write their
first-bad flag with ``atomicMin`` of an unsigned position, preset to UINT64_MAX (-1): given
the persistent flag instead of a fresh one, a failed call leaves it below UINT64_MAX and no
later call raises it again, so the flag accumulates over calls at no launch cost
(token_logprobs' target-marking kernel writes its flag the same way).  Any other check ORs its
bit into the word (``record``).
``raise_device_errors()`` reads the whole status tensor (one sync), clears it and raises the
first failed check's error, naming the op and the argument.  Outside capture and
``deferred()``, ops check at once as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import NamedTuple

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

# Checks with a flag of their own in the status tensor, in its order after the word.
FLAGGED = (EMBEDDING_IDS, ROPE_POSITIONS, TOKEN_LOGPROBS_TARGETS)
_CLEAR = (0,) + (-1,) * len(FLAGGED)  # the word, then the flags (-1: UINT64_MAX)


class _Status(NamedTuple):
    values: Tensor  # int64 [1 + len(FLAGGED)]: the word, then the flags; read in one sync
    word: Tensor  # values[:1]
    flags: dict[int, Tensor]  # bit -> values[i:i + 1]: views made once, not per call


_status: dict[torch.device, _Status] = {}
_local = threading.local()


def _status_of(device: torch.device) -> _Status:
    found = _status.get(device)
    if found is not None:
        return found
    key = device
    if device.type == "cuda" and device.index is None:
        key = torch.device("cuda", torch.cuda.current_device())
    found = _status.get(key)
    if found is None:
        if key.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "batchinv.device_checks: call batchinv.device_checks.word(device) once before "
                "capturing (its word is allocated outside any graph)"
            )
        values = torch.tensor(_CLEAR, dtype=torch.int64, device=key)
        flags = {bit: values[i + 1 : i + 2] for i, bit in enumerate(FLAGGED)}
        found = _status[key] = _Status(values, values[:1], flags)
    return found


def word(device: torch.device) -> Tensor:
    """The device's status word (int64 ``[1]``, zero while every check passed); the first call
    also allocates the device's flags."""
    return _status_of(device).word


def flag(bit: int, device: torch.device) -> Tensor:
    """The device's persistent first-bad flag of check ``bit`` (one of ``FLAGGED``; int64
    ``[1]``, -1 = UINT64_MAX while every call passed): a deferred call's kernel ``atomicMin``s
    into it directly, so it stays failed until ``raise_device_errors()`` reads and clears it."""
    found = _status_of(device).flags.get(bit)
    if found is None:
        raise ValueError(f"device check bit {bit} has no flag (flagged: {FLAGGED})")
    return found


_unread: dict[torch.device, Tensor] = {}


def unread_flag(device: torch.device) -> Tensor:
    """A first-bad-position flag (int64 ``[1]``) that a kernel may write and nobody reads: for
    a call that skips its value check.  One per device, reused by every such call (no fill
    launch per call); one first asked for under CUDA-graph capture is a fresh one in the
    graph's pool and is not kept."""
    scratch = _unread.get(device)
    if scratch is None:
        scratch = torch.full((1,), -1, dtype=torch.int64, device=device)  # UINT64_MAX
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _unread[device] = scratch
    return scratch


def deferring(device: torch.device | None = None) -> bool:
    """Whether a value check must not sync now: under CUDA-graph capture or ``deferred()``.

    Given the op's ``device``, an eager call also allocates that device's word and flags:
    torch.compile's CUDA graphs (``mode="reduce-overhead"``) run each op eagerly before
    capturing it, and the capture then finds the status it cannot allocate itself.
    """
    # A CUDA device implies CUDA is available (is_available() reads the environment per call).
    cuda = (device is not None and device.type == "cuda") or torch.cuda.is_available()
    capturing = cuda and torch.cuda.is_current_stream_capturing()
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
    """Reads the status of ``device`` (default: every device with one; one host sync each),
    clears it and raises the first failed check's error."""
    if device is None:
        devices = list(_status)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    for key in devices:
        status = _status.get(key)
        if status is None:
            continue
        value, *flags = status.values.tolist()  # the word and every flag in one read
        for bit, first_bad in zip(FLAGGED, flags, strict=True):
            if first_bad != -1:
                value |= bit
        if value:
            status.values.copy_(torch.tensor(_CLEAR, dtype=torch.int64))
            for bit, (error, message) in CHECKS.items():
                if value & bit:
                    raise error(f"{message} (found on {key} by a deferred check)")
