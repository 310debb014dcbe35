"""Argument checks done once per signature: the host-light path of the public ops.

A public op's checks read its arguments' metadata (class, shape, dtype, device) and its plain
Python arguments, never a tensor's contents, so whether a call passes them, and which
backend's implementation it runs, is a function of that *signature*.  An op keeps a
``CheckedCalls`` and hands it the signature of each call: the first call with a signature runs
the checks and the registry lookup (``resolve``), every later one goes straight to the
implementation they chose.  At decode shapes this is most of an eager call's host time.

What a signature must hold is the op's business: every value its checks read.  Building one
must not read tensor contents (no synchronisation); an op whose arguments are not what it
takes (no tensor attributes, an unexpected type) builds none and runs its full checks, which
raise its own error.

Here only checks and lookups are remembered.  ``attention``, ``attention_varlen``, ``linear``,
``log_softmax`` and ``token_logprobs`` also keep a launch plan per signature in their GPU
modules; each plan's key holds the value of every run-time switch it follows, so a switch
changed at run time takes effect at the next call.  A registry lookup is remembered: code that
swaps what the registry returns (tests do) calls ``clear_all()`` after the swap.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

__all__ = ["CheckedCalls", "clear_all"]

_TABLES: list[CheckedCalls] = []


def clear_all() -> None:
    """Forgets every op's signatures and kept launch plans: each next call runs its checks,
    lookup and planning again (after a change of anything a plan's key does not hold)."""
    for table in _TABLES:
        table.clear()
    # Imported here: the GPU modules import the ops.
    from ..gpu import attention, linear, log_softmax, rms_norm, token_logprobs

    for module in (attention, linear, log_softmax, token_logprobs):
        module._LEAN.clear()
    linear._LEAN_BACKWARD.clear()
    linear._LEAN_GROUPED.clear()
    rms_norm._LEAN_BACKWARD.clear()


class CheckedCalls:
    """The implementation each signature of one op resolved to, after its checks passed.

    ``resolve(*args)`` checks the arguments (raising the op's error) and returns the callable
    to run; ``lookup(signature, *args)`` returns it, calling ``resolve`` for a signature it has
    not seen.  A failing call is never remembered.  At most ``limit`` signatures are kept
    (then the table starts again: a training loop with a new token count per batch keeps
    adding signatures)."""

    __slots__ = ("_resolve", "_known", "limit")

    def __init__(self, resolve: Callable[..., Callable], limit: int = 4096):
        self._resolve = resolve
        self._known: dict[Hashable, Callable] = {}
        self.limit = limit
        _TABLES.append(self)

    def lookup(self, signature: Hashable, *args) -> Callable:
        run = self._known.get(signature)
        if run is None:
            run = self._resolve(*args)
            if len(self._known) >= self.limit:
                self._known.clear()
            self._known[signature] = run
        return run

    def clear(self) -> None:
        """Forgets every signature (the next call of each runs its checks again)."""
        self._known.clear()

    def __len__(self) -> int:
        return len(self._known)
