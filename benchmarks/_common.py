"""Shared benchmark plumbing: timing, the card and versions, result files.

Every benchmark measures its stock anchor in the same run and prints the ratio with the
GPU's name; numbers from different cards are never compared.

Result file (``--json``), schema ``batchinv-bench/1``::

    {"schema": "batchinv-bench/1", "benchmark": str,
     "environment": {"gpu", "multiprocessors", "driver", "versions": {...}, "commit",
                     "date_utc"},
     "ratio_convention": str,
     "summary": [{"op", "case", "variant", "batchinv_ms", "anchor", "anchor_ms", "ratio",
                  "goal", ["scope", "ran"]}, ...],
     "rows": [...]}          # every measured path, columns specific to the benchmark

``summary`` holds one row per batchinv measurement against its anchor (see
``RATIO_CONVENTION``); ``goal`` is the target ratio for that row, or null.  Optional:
``scope`` says what was timed, ``"op"`` (the public op as a user calls it) or ``"kernel"`` (below
it: no checks, no autograd); ``ran`` names the path that served the measurement where an op has
several (``linear``: batchinv's kernels or the pinned cuBLASLt algorithm).  A goal counts only
on ``"op"`` rows (``tools/results_table.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from batchinv.provenance import source_commit

SCHEMA = "batchinv-bench/1"
RATIO_CONVENTION = (
    "ratio = anchor_ms / batchinv_ms for the same work; higher is better, 1.0 = as fast as "
    "the anchor. For a copy anchor, anchor_ms is the copy time measured in the same run "
    "scaled to the bytes the op must move, so the ratio is batchinv's bandwidth over the copy's."
)


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def bench_device(smoke: bool, json_path: Path | None) -> torch.device:
    """The GPU; or, for a ``--smoke`` run on a machine without one, the CPU (which records
    nothing: ``--json`` needs a card)."""
    if smoke and not torch.cuda.is_available():
        if json_path is not None:
            raise SystemExit("--json needs a GPU run: a CPU smoke run has no card to record")
        return torch.device("cpu")
    return require_cuda()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# NVLink multicast stays off on machines with several GPUs (a program using it can take a
# shared host's GPUs out of service): set before any NCCL process group is created.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def keep_nvlink_multicast_off() -> None:
    """Sets ``NCCL_SAFE_ENV`` where the environment does not already set those variables."""
    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)


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


def cuda_graph_replay(fn):
    """A callable replaying ``fn`` captured in a CUDA graph (the GPU time without Python's
    launch overhead); capture errors propagate."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph (lazy loads, allocator)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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
        try:  # the distribution's version: liger_kernel has no __version__
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "gpu": props.name,
        "multiprocessors": props.multi_processor_count,
        "driver": driver,
        "versions": versions,
        "commit": source_commit(Path(__file__).parent.parent),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def summary_row(
    op: str,
    case: str,
    variant: str,
    batchinv_ms: float,
    anchor: str,
    anchor_ms: float,
    goal: float | None = None,
    *,
    scope: str | None = None,
    ran: str | None = None,
) -> dict:
    """One row of the uniform ``summary`` list (``anchor_ms`` already for the same work);
    ``scope`` and ``ran`` are written only when given."""
    if scope not in (None, "op", "kernel"):
        raise ValueError(f"scope must be 'op' or 'kernel', got {scope!r}")
    row = {
        "op": op,
        "case": case,
        "variant": variant,
        "batchinv_ms": batchinv_ms,
        "anchor": anchor,
        "anchor_ms": anchor_ms,
        "ratio": anchor_ms / batchinv_ms,
        "goal": goal,
    }
    if scope is not None:
        row["scope"] = scope
    if ran is not None:
        row["ran"] = ran
    return row


def copy_ms_for(copy_ms: float, copy_bytes: int, op_bytes: int) -> float:
    """The measured copy's time scaled to ``op_bytes`` (a copy's time is linear in bytes
    at these sizes), so that anchor_ms / batchinv_ms is the bandwidth ratio."""
    return copy_ms * op_bytes / copy_bytes


def report(
    name: str,
    rows: list[dict],
    columns: list[str],
    json_path: Path | None,
    summary: list[dict],
) -> None:
    """Prints ``rows`` and ``summary`` as tables with the card; writes the JSON if asked."""
    env = environment()
    print(f"\n{name} on {env['gpu']} (torch {env['versions']['torch']})")
    print_table(rows, columns)
    print(f"\nsummary ({RATIO_CONVENTION})")
    print_table(summary, ["op", "case", "variant", "batchinv_ms", "anchor", "ratio", "goal"])
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "schema": SCHEMA,
            "benchmark": name,
            "environment": env,
            "ratio_convention": RATIO_CONVENTION,
            "summary": summary,
            "rows": rows,
        }
        json_path.write_text(json.dumps(result, indent=1) + "\n")


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
