"""The audit's sweep: the contract's transforms T1-T7 on a Qwen3 model, per op table.

For each path (stock PyTorch, batchinv) the model's weights are the same; the contract's
``sequence_invariance_sweep`` computes a probe sequence alone, then under every transform
(batch population, position, neighbour content, padding, schedule, varlen packing, prefix
reuse), and compares the probe's fp32 logprobs bit for bit.  The audit passes when every
batchinv case is bitwise equal; stock drift is measured and shown, never a failure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..contract import TRANSFORMS, DriftReport, sequence_invariance_sweep
from ..models.qwen3.model import Qwen3
from ..models.qwen3.ops import ops_by_name
from .adapter import ModelAdapter

__all__ = ["AUDIT_PATHS", "AuditResult", "CaseResult", "PathResult", "count_cases", "run_audit"]

AUDIT_PATHS = ("stock", "batchinv")
# Probe length: odd, past one 128-key attention block.
AUDIT_SEQ_LEN = 131

Progress = Callable[[str, int], None]  # (label, cases done so far in this path)


@dataclass(frozen=True)
class CaseResult:
    transform_id: str
    case: str
    status: str  # "ok", "DRIFT" or "n/a"
    bitwise: bool
    max_abs_logprob_diff: float  # nan when every differing element is non-finite
    mismatches: int
    seconds: float | None
    detail: str = ""


@dataclass
class PathResult:
    name: str
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def transform_cases(self, transform_id: str) -> list[CaseResult]:
        return [c for c in self.cases if c.transform_id == transform_id]


@dataclass
class AuditResult:
    device: str
    device_name: str
    dtype: str
    model: str
    config: dict
    seq_len: int
    paths: dict[str, PathResult]

    @property
    def passed(self) -> bool:
        """batchinv ran every case, and every case was bitwise equal to the probe alone."""
        path = self.paths.get("batchinv")
        if path is None or path.error is not None or not path.cases:
            return False
        return all(c.status == "ok" for c in path.cases)


class _CountingAdapter:
    """Answers every schedule with zeros, to count the sweep's cases without computing."""

    def __init__(self):
        self.count = 0

    def _rows(self, seq: Tensor) -> Tensor:
        self.count += 1
        return torch.zeros(seq.shape[0], 1)

    def prefill_padded(self, seqs, padding):
        self.count += 1
        return [torch.zeros(s.shape[0], 1) for s in seqs]

    def prefill_varlen(self, seqs):
        self.count += 1
        return [torch.zeros(s.shape[0], 1) for s in seqs]

    def prefill_chunked(self, seq, chunk_lengths):
        return self._rows(seq)

    def decode(self, seq, prompt_len, companions):
        return self._rows(seq)

    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        return self._rows(seq)


def _make_sequence(vocab_size: int):
    def make(length: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (length,), generator=generator)

    return make


def count_cases(seq_len: int = AUDIT_SEQ_LEN, **sweep_kwargs) -> int:
    """Adapter calls one path's sweep makes (the baseline included)."""
    counter = _CountingAdapter()
    sequence_invariance_sweep(counter, _make_sequence(8), seq_len=seq_len, **sweep_kwargs)
    return counter.count


def _case(report: DriftReport, seconds: float | None) -> CaseResult:
    return CaseResult(
        transform_id=report.transform_id,
        case=report.case,
        status=report.status,
        bitwise=report.bitwise,
        max_abs_logprob_diff=report.max_abs_diff,
        mismatches=report.mismatches,
        seconds=seconds,
        detail=report.detail,
    )


def _run_path(
    model: Qwen3, name: str, seq_len: int, seed: int, progress: Progress | None, sweep_kwargs
) -> PathResult:
    result = PathResult(name)
    adapter = ModelAdapter(model, ops_by_name(name))
    if progress is not None:
        inner = adapter._run

        def reporting_run(method, fn):
            try:
                return inner(method, fn)
            finally:
                progress(f"{name}: {method}", len(adapter.calls))

        adapter._run = reporting_run
    start = time.perf_counter()
    try:
        reports = sequence_invariance_sweep(
            adapter,
            _make_sequence(model.config.vocab_size),
            seq_len=seq_len,
            seed=seed,
            **sweep_kwargs,
        )
    except Exception as err:  # the path could not run: reported as its error
        result.error = f"{type(err).__name__}: {err}"
        reports = []
    result.seconds = time.perf_counter() - start
    # One adapter call per case after the baseline (the adapter never reports n/a).
    timings = [seconds for _, seconds in adapter.calls[1:]]
    aligned = len(timings) == len(reports)
    result.cases = [_case(r, timings[i] if aligned else None) for i, r in enumerate(reports)]
    return result


def run_audit(
    model: Qwen3,
    *,
    paths: Sequence[str] = AUDIT_PATHS,
    seq_len: int = AUDIT_SEQ_LEN,
    seed: int = 0,
    model_label: str = "built-in tiny Qwen3 (random weights)",
    progress: Progress | None = None,
    **sweep_kwargs,
) -> AuditResult:
    """Runs the transform sweep on ``model`` for each path in ``paths``."""
    for name in paths:
        ops_by_name(name)  # an unknown path is an error before any work
    device = model.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    config = {k: v for k, v in vars(model.config).items()}
    results = {
        name: _run_path(model, name, seq_len, seed, progress, sweep_kwargs) for name in paths
    }
    return AuditResult(
        device=str(device),
        device_name=device_name,
        dtype=str(model.dtype).removeprefix("torch."),
        model=model_label,
        config=config,
        seq_len=seq_len,
        paths=results,
    )


def transform_summary(path: PathResult, transform_id: str) -> dict:
    """max |Δ logprob|, bitwise (all cases), counts and time of one path on one transform."""
    cases = path.transform_cases(transform_id)
    applicable = [c for c in cases if c.status != "n/a"]
    finite = [c.max_abs_logprob_diff for c in applicable if not math.isnan(c.max_abs_logprob_diff)]
    non_finite = any(math.isnan(c.max_abs_logprob_diff) for c in applicable)
    times = [c.seconds for c in cases if c.seconds is not None]
    return {
        "cases": len(cases),
        "bitwise_cases": sum(c.status == "ok" for c in cases),
        "not_applicable": len(cases) - len(applicable),
        "bitwise": bool(cases) and all(c.status == "ok" for c in cases),
        "max_abs_logprob_diff": max(finite) if finite else 0.0,
        "non_finite_diff": non_finite,  # some drifting element was NaN/inf
        "seconds": sum(times) if len(times) == len(cases) else None,
    }


TRANSFORM_IDS = tuple(t.id for t in TRANSFORMS)
