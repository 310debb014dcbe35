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

from ..contract import (
    SEQUENCE_BATCH_SIZES,
    TRANSFORMS,
    DriftReport,
    compare_bits,
    sequence_invariance_sweep,
)
from ..models.qwen3.config import Qwen3Config
from ..models.qwen3.model import Qwen3
from ..models.qwen3.ops import ops_by_name
from ..shapes import QWEN3_8B_CONFIG
from .adapter import ModelAdapter
from .kernel_paths import PathRecorder, merge_paths, recording_ops

__all__ = [
    "AUDIT_PATHS",
    "PRODUCTION_CONFIG",
    "PRODUCTION_SWEEP",
    "TOKEN_NEIGHBOUR_KINDS",
    "AuditResult",
    "CasePlan",
    "CaseResult",
    "PathResult",
    "count_cases",
    "kernel_paths_summary",
    "plan_cases",
    "run_audit",
]

AUDIT_PATHS = ("stock", "batchinv")
# Probe length: odd, past one 128-key attention block.
AUDIT_SEQ_LEN = 131

# The production-shaped run (the CUDA default besides the tiny model): Qwen3-8B's layer shapes
# and 151936-token vocabulary (so the lm_head and log_softmax are full size), two layers of
# random weights (the paths are per layer; more layers only cost time).
PRODUCTION_CONFIG = Qwen3Config(num_hidden_layers=2, **QWEN3_8B_CONFIG)
# Its sweep: a probe one 128-key block and one key past the 2048-key split, so every case's
# last rows attend across the split; neighbours up to 3001 tokens, so padded batches of 3 and
# 5 hold 1024 < rows <= 8191 and > 8191 rows (the pinned cuBLASLt range and beyond), and so
# does the packed batch of 5.  Decode starts 8 tokens before the split (a token-by-token walk
# across it, alone and with 4 companions) and at the last token; chunks of 7, 100 and 1000
# and an irregular mix cross it in prefill; prefixes of 1, 1088 and 2048 tokens (the split
# itself) are cached by one batch and continued in another.
PRODUCTION_SWEEP = {
    "seq_len": 2177,
    "neighbour_lengths": (3001, 1500, 1, 2177, 2600),
    "batch_sizes": (1, 3, 5),
    "chunk_sizes": (7, 100, 1000),
    "irregular_chunks": (5, 64, 1, 7, 100),
    "prompt_lengths": (2040, 2176),
    "prefix_lengths": (1, 1088, 2048),
}
# T3 for token sequences.  The contract's T3 kinds (extreme, subnormal, NaN, inf) replace
# float content, which token ids do not have, so it runs only "copies"; the audit adds
# neighbours of the probe's length whose tokens differ from the probe's: random tokens, one
# token repeated (every key alike), and tokens whose embedding rows hold the largest values.
TOKEN_NEIGHBOUR_KINDS = ("random tokens", "one token repeated", "largest-embedding tokens")

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
    kernel_paths: dict | None = None  # batchinv on CUDA: see kernel_paths.py


@dataclass
class PathResult:
    name: str
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    baseline_kernel_paths: dict | None = None  # the probe alone (batchinv on CUDA)

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
    name: str = "audit"
    sweep: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """batchinv ran every case, and every case was bitwise equal to the probe alone."""
        path = self.paths.get("batchinv")
        if path is None or path.error is not None or not path.cases:
            return False
        return all(c.status == "ok" for c in path.cases)


@dataclass(frozen=True)
class CasePlan:
    """One adapter call of a sweep, planned: its method, the most rows (tokens) one forward
    of it computes, and the most keys one sequence of it attends to."""

    method: str
    rows: int
    keys: int


class _PlanningAdapter:
    """Answers every schedule with zeros, to plan the sweep's calls without computing."""

    def __init__(self):
        self.plans: list[CasePlan] = []

    def _plan(self, method: str, rows: int, keys: int) -> None:
        self.plans.append(CasePlan(method, rows, keys))

    @staticmethod
    def _zeros(seq: Tensor) -> Tensor:
        return torch.zeros(seq.shape[0], 1)

    def prefill_padded(self, seqs, padding):
        width = max(max(s.shape[0] for s in seqs), 1)
        self._plan("prefill_padded", len(seqs) * width, width)
        return [self._zeros(s) for s in seqs]

    def prefill_varlen(self, seqs):
        self._plan("prefill_varlen", sum(s.shape[0] for s in seqs), max(s.shape[0] for s in seqs))
        return [self._zeros(s) for s in seqs]

    def prefill_chunked(self, seq, chunk_lengths):
        self._plan("prefill_chunked", max(chunk_lengths), seq.shape[0])
        return self._zeros(seq)

    def decode(self, seq, prompt_len, companions):
        seqs = [seq, *companions]
        prompt_rows = len(seqs) * max(min(prompt_len, s.shape[0]) for s in seqs)
        self._plan("decode", max(prompt_rows, len(seqs)), seq.shape[0])
        return self._zeros(seq)

    def prefix_reuse(self, seq, prefix_len, writer_batch, reader_batch):
        writers = [prefix_len, *(s.shape[0] for s in writer_batch)]
        readers = [seq.shape[0] - prefix_len, *(s.shape[0] for s in reader_batch)]
        rows = max(len(writers) * max(writers), len(readers) * max(readers))
        self._plan("prefix_reuse", rows, seq.shape[0])
        return self._zeros(seq)


def _make_sequence(vocab_size: int):
    def make(length: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, vocab_size, (length,), generator=generator)

    return make


def plan_cases(seq_len: int = AUDIT_SEQ_LEN, **sweep_kwargs) -> list[CasePlan]:
    """The adapter calls one path's sweep makes (the baseline first, then one per case, the
    audit's T3 neighbours last), planned without a model: what the audit will run."""
    planner = _PlanningAdapter()
    sequence_invariance_sweep(planner, _make_sequence(8), seq_len=seq_len, **sweep_kwargs)
    batch = _t3_batch(sweep_kwargs)
    for _ in TOKEN_NEIGHBOUR_KINDS:
        planner.prefill_padded([torch.zeros(seq_len)] * batch, "zeros")
    return planner.plans


def count_cases(seq_len: int = AUDIT_SEQ_LEN, **sweep_kwargs) -> int:
    """Adapter calls one path's sweep makes (the baseline included)."""
    return len(plan_cases(seq_len, **sweep_kwargs))


def _t3_batch(sweep_kwargs) -> int:
    """The contract's T3 batch (probe in the middle), which the audit's T3 cases share."""
    return max(3, max(sweep_kwargs.get("batch_sizes", SEQUENCE_BATCH_SIZES)))


def _token_neighbours(
    kind: str, count: int, length: int, model: Qwen3, generator: torch.Generator
) -> list[Tensor]:
    vocab = model.config.vocab_size
    if kind == "random tokens":
        return [torch.randint(0, vocab, (length,), generator=generator) for _ in range(count)]
    if kind == "one token repeated":
        tokens = torch.randint(0, vocab, (count,), generator=generator)
        return [torch.full((length,), int(t)) for t in tokens]
    if kind == "largest-embedding tokens":
        weight = model.model.embed_tokens.weight.detach()
        largest = weight.float().abs().amax(dim=1).topk(min(16, vocab)).indices.cpu()
        picks = torch.randint(0, largest.numel(), (count, length), generator=generator)
        return list(largest[picks])
    raise ValueError(f"unknown token neighbour kind {kind!r}")


def _token_neighbour_reports(
    adapter: ModelAdapter, probe: Tensor, baseline: Tensor, seed: int, batch: int
) -> list[DriftReport]:
    """The audit's T3 cases: the probe in the middle of ``batch`` sequences of its length
    whose tokens differ from its own, one padded prefill per kind, compared bit for bit."""
    generator = torch.Generator().manual_seed(seed + 3)
    index = batch // 2
    reports = []
    for kind in TOKEN_NEIGHBOUR_KINDS:
        others = _token_neighbours(kind, batch - 1, probe.shape[0], adapter.model, generator)
        seqs = others[:index] + [probe.clone()] + others[index:]
        out = adapter.prefill_padded(seqs, "zeros")[index]
        bits = compare_bits(out, baseline)
        reports.append(
            DriftReport(
                "T3",
                f"B={batch}, probe at {index}, neighbour sequences: {kind}",
                bits.equal,
                bits.mismatches,
                bits.first_mismatch,
                bits.max_abs_diff,
                detail="" if bits.equal else f"first mismatch at {bits.first_mismatch}",
            )
        )
    return reports


def _case(report: DriftReport, seconds: float | None, kernel_paths: dict | None) -> CaseResult:
    return CaseResult(
        transform_id=report.transform_id,
        case=report.case,
        status=report.status,
        bitwise=report.bitwise,
        max_abs_logprob_diff=report.max_abs_diff,
        mismatches=report.mismatches,
        seconds=seconds,
        detail=report.detail,
        kernel_paths=kernel_paths,
    )


def _run_path(
    model: Qwen3, name: str, seq_len: int, seed: int, progress: Progress | None, sweep_kwargs
) -> PathResult:
    result = PathResult(name)
    ops = ops_by_name(name)
    recorder = None
    if name == "batchinv" and model.device.type == "cuda":
        recorder = PathRecorder()
        ops = recording_ops(ops, recorder)
    adapter = ModelAdapter(model, ops, recorder)
    captured: dict[str, Tensor] = {}
    make_sequence = _make_sequence(model.config.vocab_size)

    def make_and_keep_probe(length: int, generator: torch.Generator) -> Tensor:
        seq = make_sequence(length, generator)
        captured.setdefault("probe", seq)  # the sweep draws the probe first
        return seq

    prefill_padded = adapter.prefill_padded

    def prefill_and_keep_baseline(seqs, padding):
        outs = prefill_padded(seqs, padding)
        captured.setdefault("baseline", outs[0])  # the sweep's first call: the probe alone
        return outs

    adapter.prefill_padded = prefill_and_keep_baseline
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
            adapter, make_and_keep_probe, seq_len=seq_len, seed=seed, **sweep_kwargs
        )
        reports += _token_neighbour_reports(
            adapter, captured["probe"], captured["baseline"], seed, _t3_batch(sweep_kwargs)
        )
    except Exception as err:  # the path could not run: reported as its error
        result.error = f"{type(err).__name__}: {err}"
        reports = []
    result.seconds = time.perf_counter() - start
    # One adapter call per case after the baseline (the adapter never reports n/a).
    timings = [seconds for _, seconds in adapter.calls[1:]]
    paths = adapter.kernel_paths[1:]
    aligned = len(timings) == len(reports)
    cases = [
        _case(r, timings[i] if aligned else None, paths[i] if aligned else None)
        for i, r in enumerate(reports)
    ]
    order = {transform.id: i for i, transform in enumerate(TRANSFORMS)}
    result.cases = sorted(cases, key=lambda c: order[c.transform_id])  # stable: T3's together
    result.baseline_kernel_paths = adapter.kernel_paths[0] if adapter.kernel_paths else None
    return result


def run_audit(
    model: Qwen3,
    *,
    paths: Sequence[str] = AUDIT_PATHS,
    seq_len: int = AUDIT_SEQ_LEN,
    seed: int = 0,
    model_label: str = "built-in tiny Qwen3 (random weights)",
    progress: Progress | None = None,
    run_name: str = "audit",
    **sweep_kwargs,
) -> AuditResult:
    """Runs the transform sweep on ``model`` for each path in ``paths``; ``run_name`` labels
    the run in reports."""
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
        name=run_name,
        sweep={"seq_len": seq_len, **sweep_kwargs},
    )


def kernel_paths_summary(path: PathResult) -> dict | None:
    """The kernel paths of all of a path's cases together (the baseline included), or None
    where none were recorded (stock, or the CPU)."""
    per_case = [path.baseline_kernel_paths] + [c.kernel_paths for c in path.cases]
    if all(p is None for p in per_case):
        return None
    return merge_paths(per_case)


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
