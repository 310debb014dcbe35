"""Which kernel paths batchinv's ops took in each audit case (CUDA only).

``recording_ops(ops, recorder)`` wraps the op table's linear, attention and log_softmax: before
each call it asks which path the call takes (``batchinv.linear_path`` and
``gpu.linear.describe``, ``gpu.attention.path_for``, ``gpu.log_softmax.forward_path``: the
launch's own decisions), notes it with the call's size, then runs the op unchanged.  The
adapter takes the notes after each case, so every case reports the paths it reached::

    {"linear": {"own: hopper bm128 bn256 k64 s4": {"calls": 14, "max_rows": 15005},
                "own: small-m bn32 k128 s8": {...}, "cublaslt: ...": {...}},
     "attention": {"split w1": {"calls": 270, "max_keys": 2177}},
     "log_softmax": {"cluster x8 T1024": {"calls": 1, "max_rows": 15005}}}

``max_rows``: the largest number of rows (tokens) one call had; ``max_keys``: the most keys
one sequence of one call attended to.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..reference.qwen3_chain import Qwen3Ops

__all__ = ["PathRecorder", "merge_paths", "recording_ops"]


class PathRecorder:
    """Collects ``{op: {path: {"calls", "max_rows" or "max_keys"}}}`` until ``take``."""

    def __init__(self) -> None:
        self._paths: dict[str, dict[str, dict[str, int]]] = {}

    def note(self, op: str, path: str, size_name: str, size: int) -> None:
        entry = self._paths.setdefault(op, {}).setdefault(path, {"calls": 0, size_name: 0})
        entry["calls"] += 1
        entry[size_name] = max(entry[size_name], int(size))

    def take(self) -> dict[str, dict[str, dict[str, int]]]:
        """What was noted since the last ``take``, and a fresh start."""
        paths, self._paths = self._paths, {}
        return paths


def merge_paths(per_case: list[dict | None]) -> dict[str, dict[str, dict[str, int]]]:
    """The paths of several cases together: calls added, sizes maximised, ``cases`` counted."""
    merged: dict[str, dict[str, dict[str, int]]] = {}
    for paths in per_case:
        for op, by_path in (paths or {}).items():
            for path, entry in by_path.items():
                total = merged.setdefault(op, {}).setdefault(path, {"cases": 0})
                total["cases"] += 1
                for key, value in entry.items():
                    combine = sum if key == "calls" else max
                    total[key] = combine((total.get(key, 0), value))
    return merged


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def recording_ops(ops: Qwen3Ops, recorder: PathRecorder) -> Qwen3Ops:
    """``ops`` whose CUDA linear (grouped or not), attention and log_softmax calls note their
    path."""
    from ..gpu import attention as gpu_attention
    from ..gpu import linear as gpu_linear
    from ..gpu import log_softmax as gpu_log_softmax
    from ..ops.linear import linear_path

    def linear(x, weight, bias):
        if x.is_cuda:
            rows = _rows(x)
            path = linear_path(x, weight, bias)  # "own" or "cublaslt"
            label = gpu_linear.describe(rows, weight.shape[0], path, x.device)
            recorder.note("linear", label, "max_rows", rows)
        return ops.linear(x, weight, bias)

    def linear_group(x, weights, biases):
        # The grouped launch (q/k/v, gate/up at decode sizes) is a production path too; where
        # it does not apply, the chain calls ``linear`` above, which notes its own path.
        if ops.linear_group is None:
            return None
        outputs = ops.linear_group(x, weights, biases)
        if outputs is not None and x.is_cuda:
            rows = _rows(x)
            recorder.note("linear", gpu_linear.describe_grouped(rows), "max_rows", rows)
        return outputs

    def note_attention(bounds, hq, hkv, device, keys: int) -> None:
        path = gpu_attention.path_for(bounds, hq, hkv, device)
        recorder.note("attention", path, "max_keys", keys)

    def attention(q, k, v, *, causal, seqlens_q, seqlens_k):
        if q.is_cuda:
            keys = k.shape[1] if seqlens_k is None else int(seqlens_k.max())
            bounds = gpu_attention.padded_bounds(q, k)
            note_attention(bounds, q.shape[2], k.shape[2], q.device, keys)
        return ops.attention(q, k, v, causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k)

    def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal):
        if q.is_cuda:
            bounds = gpu_attention.varlen_bounds(cu_seqlens_q.cpu(), cu_seqlens_k.cpu())
            note_attention(bounds, q.shape[1], k.shape[1], q.device, bounds.max_k_len)
        return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal)

    def attention_with_kv_cache(q, k_new, v_new, cache, seq_ids, *, seqlens_new, causal):
        bounds = gpu_attention.kv_cache_bounds(q, cache) if q.is_cuda else None
        out = ops.attention_with_kv_cache(
            q, k_new, v_new, cache, seq_ids, seqlens_new=seqlens_new, causal=causal
        )
        if bounds is not None:  # the keys each slot attended to: its length after the append
            keys = int(cache.host_lengths(seq_ids).max()) if bounds.batch else 0
            note_attention(bounds, q.shape[2], k_new.shape[2], q.device, keys)
        return out

    def log_softmax(x):
        if x.is_cuda:
            path = gpu_log_softmax.forward_path(x, torch.float32)
            recorder.note("log_softmax", path, "max_rows", _rows(x))
        return ops.log_softmax(x)

    return dataclasses.replace(
        ops,
        linear=linear,
        linear_group=linear_group,
        attention=attention,
        attention_varlen=attention_varlen,
        attention_with_kv_cache=attention_with_kv_cache,
        log_softmax=log_softmax,
    )
