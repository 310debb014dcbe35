"""Which implementation runs an op on which device.

An op registers one function per backend (``cpu``, ``cuda``, ``hip``).  A call looks up
the backend of its tensors' device and runs that implementation or raises: a GPU op
never falls back to the CPU reference, and an unknown op or backend is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

BACKENDS = ("cpu", "cuda", "hip")

F = TypeVar("F", bound=Callable)

_IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {}


class UnknownOpError(KeyError):
    """No op of that name is registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BackendNotImplementedError(NotImplementedError):
    """The op exists, but has no implementation for the device's backend."""


def backend_of(device: torch.device) -> str:
    """``cpu`` for CPU tensors; ``cuda`` or ``hip`` for GPU tensors (by the torch build)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    raise BackendNotImplementedError(f"batchinv has no backend for device type '{device.type}'")


def register(op: str, backend: str) -> Callable[[F], F]:
    """Decorator: ``fn`` implements ``op`` on ``backend``.  Registering twice is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def decorate(fn: F) -> F:
        per_backend = _IMPLEMENTATIONS.setdefault(op, {})
        if backend in per_backend:
            raise ValueError(f"op {op!r} already has a {backend} implementation")
        per_backend[backend] = fn
        return fn

    return decorate


def lookup(op: str, device: torch.device) -> Callable:
    """The implementation of ``op`` for ``device``'s backend, or an error saying what exists."""
    per_backend = _IMPLEMENTATIONS.get(op)
    if per_backend is None:
        known = ", ".join(sorted(_IMPLEMENTATIONS)) or "none"
        raise UnknownOpError(f"unknown op {op!r} (registered ops: {known})")
    backend = backend_of(device)
    fn = per_backend.get(backend)
    if fn is None:
        have = ", ".join(sorted(per_backend))
        raise BackendNotImplementedError(
            f"op {op!r} has no {backend} implementation (it has: {have}); "
            "batchinv does not fall back to another backend"
        )
    return fn


def registered_ops() -> dict[str, tuple[str, ...]]:
    """Every registered op and the backends it has."""
    return {op: tuple(sorted(b)) for op, b in sorted(_IMPLEMENTATIONS.items())}
