"""The audit's report: a table per transform (stdout) and the same data as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import batchinv

from ..contract import TRANSFORMS
from .sweep import AuditResult, transform_summary

__all__ = ["audit_json", "format_audit", "write_json"]


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
        f"batchinv {batchinv.__version__} audit: {result.model}",
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


def _clean(value):
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def audit_json(result: AuditResult) -> dict:
    """The result as a JSON-ready dict (schema in docs/audit.md)."""
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
            "cases": [vars(c) for c in path.cases],
        }
        for name, path in result.paths.items()
    }
    return _clean(
        {
            "batchinv_version": batchinv.__version__,
            "passed": result.passed,
            "device": result.device,
            "device_name": result.device_name,
            "dtype": result.dtype,
            "model": result.model,
            "config": result.config,
            "seq_len": result.seq_len,
            "transforms": transforms,
            "paths": paths,
        }
    )


def write_json(result: AuditResult, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(audit_json(result), indent=2) + "\n")
    return target
