"""The audit's report: a table per transform (stdout) and the same data as JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

import batchinv

from ..contract import TRANSFORMS
from ..provenance import source_commit
from .sweep import AuditResult, kernel_paths_summary, transform_summary

__all__ = ["audit_json", "format_audit", "provenance", "write_json"]

_PROJECT_ROOT = Path(batchinv.__file__).resolve().parents[2]  # a checkout's root, if any


def _diff(summary: dict) -> str:
    if summary["non_finite_diff"]:
        return "non-finite"
    value = summary["max_abs_logprob_diff"]
    return "0" if value == 0 else f"{value:.3g}"


def _bitwise(summary: dict) -> str:
    if summary["bitwise"]:
        return "yes"
    drifting = summary["cases"] - summary["bitwise_cases"] - summary["not_applicable"]
    detail = f"{drifting} of {summary['cases']} drift"
    if summary["not_applicable"]:
        detail += f", {summary['not_applicable']} n/a"
    return f"NO ({detail})"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def format_audit(result: AuditResult) -> str:
    """Header, one table per transform (path, max |Δ logprob|, bitwise, time), verdict."""
    lines = [
        f"batchinv {batchinv.__version__} audit, {result.name} run: {result.model}",
        f"device {result.device_name} ({result.device}), dtype {result.dtype}, "
        f"probe of {result.seq_len} tokens; every case compares the probe's fp32 logprobs "
        "with the probe computed alone",
        "",
    ]
    width = max(len(name) for name in result.paths)
    for transform in TRANSFORMS:
        summaries = {
            name: transform_summary(path, transform.id)
            for name, path in result.paths.items()
            if path.error is None or path.transform_cases(transform.id)
        }
        cases = max((s["cases"] for s in summaries.values()), default=0)
        plural = "" if cases == 1 else "s"
        lines.append(f"{transform.id} {transform.name} ({cases} case{plural})")
        lines.append(f"  {'path':<{width}}  {'max |Δ logprob|':>15}  {'bitwise':<22}  time")
        for name in result.paths:
            if name not in summaries:
                lines.append(f"  {name:<{width}}  {'-':>15}  {'ERROR':<22}  -")
                continue
            s = summaries[name]
            lines.append(
                f"  {name:<{width}}  {_diff(s):>15}  {_bitwise(s):<22}  {_seconds(s['seconds'])}"
            )
        lines.append("")
    paths = result.paths.get("batchinv")
    summary = kernel_paths_summary(paths) if paths is not None else None
    if summary:
        lines.append("kernel paths batchinv took (every case, the probe alone included):")
        for op, by_path in summary.items():
            taken = ", ".join(f"{path} {_extent(entry)}" for path, entry in by_path.items())
            lines.append(f"  {op}: {taken}")
        lines.append("")
    for name, path in result.paths.items():
        status = "error" if path.error else "ran"
        lines.append(f"{name}: {status}, {len(path.cases)} cases in {path.seconds:.1f} s")
        if path.error:
            lines.append(f"  {name} ERROR: {path.error}")
    batchinv_path = result.paths.get("batchinv")
    if batchinv_path is not None:
        drifting = [c for c in batchinv_path.cases if c.status != "ok"]
        for c in drifting[:10]:
            lines.append(f"  batchinv {c.status}: {c.transform_id} {c.case} {c.detail}".rstrip())
    lines.append(
        "PASS: batchinv is bitwise invariant in every case"
        if result.passed
        else "FAIL: batchinv broke invariance (or could not run) -- see above"
    )
    return "\n".join(lines)


def _extent(entry: dict) -> str:
    if "max_rows" in entry:
        return f"(up to {entry['max_rows']} rows, {entry['cases']} cases)"
    return f"(up to {entry['max_keys']} keys, {entry['cases']} cases)"


def _clean(value):
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _run_json(result: AuditResult) -> dict:
    transforms = []
    for transform in TRANSFORMS:
        transforms.append(
            {
                "id": transform.id,
                "name": transform.name,
                "paths": {
                    name: transform_summary(path, transform.id)
                    for name, path in result.paths.items()
                },
            }
        )
    paths = {
        name: {
            "seconds": path.seconds,
            "error": path.error,
            "kernel_paths": kernel_paths_summary(path),
            "baseline_kernel_paths": path.baseline_kernel_paths,
            "cases": [vars(c) for c in path.cases],
        }
        for name, path in result.paths.items()
    }
    return {
        "name": result.name,
        "passed": result.passed,
        "model": result.model,
        "config": result.config,
        "seq_len": result.seq_len,
        "sweep": result.sweep,
        "transforms": transforms,
        "paths": paths,
    }


def provenance(device: str) -> dict:
    """What produced a result: the source commit (``BATCHINV_GIT_COMMIT`` or the checkout's
    HEAD, see ``batchinv.provenance``; None when unknown), the native build and the card."""
    from ..runtime import NativeModuleMissingError, build_info

    try:
        build = dict(build_info())
    except NativeModuleMissingError:  # a source checkout never built: the CPU references ran
        build = None
    card = {"name": "CPU"}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        card = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return {
        "commit": source_commit(_PROJECT_ROOT),
        "build": build,
        "card": card,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def audit_json(results: AuditResult | Sequence[AuditResult]) -> dict:
    """One or more runs (same device and dtype) as a JSON-ready dict (schema in
    docs/audit.md)."""
    runs = [results] if isinstance(results, AuditResult) else list(results)
    if not runs:
        raise ValueError("audit_json needs at least one run")
    first = runs[0]
    return _clean(
        {
            "batchinv_version": batchinv.__version__,
            "passed": all(r.passed for r in runs),
            **provenance(first.device),
            "device": first.device,
            "device_name": first.device_name,
            "dtype": first.dtype,
            "runs": [_run_json(r) for r in runs],
        }
    )


def write_json(results: AuditResult | Sequence[AuditResult], path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(audit_json(results), indent=2) + "\n")
    return target
