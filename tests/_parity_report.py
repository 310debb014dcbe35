"""Writes the cuda_parity JSON: provenance of a GPU test run and each test's outcome."""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
from pathlib import Path

from batchinv.provenance import source_commit


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _versions() -> dict:
    import torch

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in ("triton", "cupy", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # optional packages: absent is recorded as absent
            versions[name] = None
    return versions


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split(
            "\n"
        )[0],
    }


def gpu_slug(name: str | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (name or "no-gpu").lower()).strip("-")


def write_report(path: str, outcomes: dict[str, dict], exitstatus: int) -> None:
    try:
        import batchinv._native as native

        build = dict(native.build_info())
    except ImportError:
        build = None
    counts: dict[str, int] = {}
    for entry in outcomes.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    gpu = _gpu()
    target = Path(path.replace("{gpu}", gpu_slug(gpu["name"])))
    report = {
        "commit": source_commit(Path(__file__).parent.parent),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": gpu,
        "versions": _versions(),
        "build": build,
        "pytest_exit_status": exitstatus,
        "summary": counts,
        "tests": [{"id": nodeid, **entry} for nodeid, entry in sorted(outcomes.items())],
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nparity report written to {target}")
