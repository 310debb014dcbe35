"""Running calls on side streams, interleaved, and capturing a call in a CUDA graph, for the
tests that check a GPU op's bits do not depend on which stream ran it or on graph replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def run_interleaved_on_streams(calls: Sequence[Callable[[], object]], rounds: int) -> list[list]:
    """``results[i][r]``: ``calls[i]()`` in round ``r``, each call on a stream of its own (the
    calls of one round issued one after the other, so that their kernels overlap), after the
    work already queued on the current stream; synchronized before returning."""
    streams = [torch.cuda.Stream() for _ in calls]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results: list[list] = [[] for _ in calls]
    for _ in range(rounds):
        for i, (stream, call) in enumerate(zip(streams, calls, strict=True)):
            with torch.cuda.stream(stream):
                results[i].append(call())
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return results


def capture_graph(call: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``(graph, output)``: ``call`` run once on a side stream (the warm-up torch asks for before
    a capture), then captured; ``graph.replay()`` rewrites ``output`` in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()
    return graph, output
