"""Shared benchmark plumbing: timing, the card and versions, result files.

Every benchmark measures its stock anchor in the same run and prints the ratio with the
GPU's name; numbers from different cards are never compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def median_ms(fn, *, warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .split("\n")[0]
        )
    except (OSError, subprocess.CalledProcessError):
        driver = None
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in ("triton", "liger_kernel"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = None
    return {
        "gpu": props.name,
        "multiprocessors": props.multi_processor_count,
        "driver": driver,
        "versions": versions,
        "commit": os.environ.get("BATCHINV_GIT_COMMIT"),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def report(name: str, rows: list[dict], columns: list[str], json_path: Path | None) -> None:
    """Prints ``rows`` as a table with the card, and writes them as JSON if asked."""
    env = environment()
    print(f"\n{name} on {env['gpu']} (torch {env['versions']['torch']})")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps({"benchmark": name, "environment": env, "rows": rows}, indent=1) + "\n"
        )


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
