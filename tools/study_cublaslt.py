"""Study: can cuBLASLt with one pinned algorithm serve as a batch-invariant linear?

For each Qwen3-8B linear shape and dtype: ask cuBLASLt's heuristic (no workspace allowed) for
its top algorithm at M = 4096, pin it (algo id, tile, stages, swizzle, custom option, inner and
cluster shape as the heuristic chose; split-K 1, reduction scheme none), then run that one
algorithm at every M of the sweep.  ``cublasLtMatmulAlgoCheck`` decides whether the pinned
algorithm can serve an M at all, and with how much workspace (0 is the goal; where it asks for
some, the run gets exactly that much and the table says so).  Where it can, every probe row
computed alone must be bitwise equal to the same row inside the batch (the contract's
comparator), and every row of the batch must be bitwise equal to the same row of the M = 8191
batch.  Stock ``torch.mm`` gets
the same checks for contrast.  bf16 is also timed against ``torch.mm`` and
``batchinv.linear`` (the same kernel, ``matmul_nt``) in the same run.

Writes a JSON (``--json``) and a markdown table (``--markdown``).  Needs an NVIDIA GPU and the
libcublasLt that PyTorch loads; not a dependency of anything else in the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "py"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import environment, median_ms  # noqa: E402

from batchinv.contract import assert_bitwise_equal, assert_within_tolerance  # noqa: E402
from batchinv.gpu.cublaslt import (  # noqa: E402
    ALGO_CONFIG,
    STATUS_NAMES,
    CublasLt,
    CublasLtError,
    find_cublaslt,
)
from batchinv.gpu.linear import matmul_nt  # noqa: E402
from batchinv.shapes import LINEAR_BENCH_M, LINEAR_M_SWEEP, QWEN3_8B_LINEAR  # noqa: E402

PROBE_ROWS = (0, 1, 2, 16, 64, 256, 1023, 4095, 8190)
PIN_AT_M = 4096
# Pinnings tried: the heuristic's configuration as it is, and the same with custom option 0
# (the heuristic's custom option may select a tile scheduler that adapts to the grid).
VARIANTS = (("heuristic", {}), ("custom option 0", {"custom_option": 0}))


def _mismatching_rows(batch: torch.Tensor, full_prefix: torch.Tensor) -> int:
    """Rows whose bit patterns differ (an integer view; no tolerance)."""
    bits = torch.int16
    return int((batch.view(bits) != full_prefix.view(bits)).any(dim=1).sum())


def _probe_failures(batch: torch.Tensor, alone: dict[int, torch.Tensor], label: str) -> list:
    failures = []
    for i, expected in alone.items():
        if i < batch.shape[0]:
            try:
                assert_bitwise_equal(batch[i : i + 1], expected, name=f"{label} row {i}")
            except AssertionError as error:
                failures.append({"row": i, "message": str(error).splitlines()[0]})
    return failures


def study_shape(
    lt: CublasLt, name, k, n, dtype, sweep, variant, timed_m: tuple, rep_ms: float
) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    m_max = max(sweep)
    x = torch.randn(m_max, k, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    top = lt.heuristic_top(PIN_AT_M, n, k, dtype)
    heuristic_config = lt.read_config(top.algo)
    heuristic_check = lt.check(top.algo, PIN_AT_M, n, k, dtype)
    entry = {
        "layer": name,
        "N": n,
        "K": k,
        "dtype": str(dtype).removeprefix("torch."),
        "heuristic_at_m": PIN_AT_M,
        "heuristic_config": heuristic_config,
        "heuristic_workspace_bytes": int(top.workspace_size),
        "heuristic_waves": float(top.waves_count),
        "heuristic_algo_check": {
            "status": STATUS_NAMES.get(heuristic_check[0], heuristic_check[0]),
            "workspace_bytes": heuristic_check[1],
        },
        "variant": variant[0],
        "pinned_from": "cublasLtMatmulAlgoInit + the heuristic's configuration",
    }
    overrides = variant[1]
    algo = lt.pinned_algo({**heuristic_config, **overrides}, dtype)
    status, _ = lt.check(algo, PIN_AT_M, n, k, dtype)
    if status != 0:  # the rebuilt descriptor is refused: pin the heuristic's own struct
        entry["pinned_from"] = (
            f"the heuristic's descriptor with split-K forced to 1 (AlgoInit rebuild was "
            f"{STATUS_NAMES.get(status, status)})"
        )
        algo = top.algo
        pins = {"splitk_num": 1, "reduction_scheme": 0, **overrides}
        for attr, name_, ctype in ALGO_CONFIG:
            if name_ not in pins:
                continue
            value = ctype(pins[name_])
            lt._call(
                "cublasLtMatmulAlgoConfigSetAttribute",
                ctypes.byref(algo),
                attr,
                ctypes.byref(value),
                ctypes.sizeof(value),
            )
    entry["pinned_config"] = lt.read_config(algo)

    checks = {m: lt.check(algo, m, n, k, dtype) for m in sweep}
    served = [m for m in sweep if checks[m][0] == 0]

    def run_lt(rows: torch.Tensor) -> torch.Tensor:
        return lt.matmul_fn(algo, rows, weight, checks[rows.shape[0]][1])()

    alone_lt = {i: run_lt(x[i : i + 1]).clone() for i in PROBE_ROWS if 1 in served}
    if alone_lt:  # bits that never change are worthless if wrong: Axis-B on the probe rows
        probes = list(alone_lt)
        reference = torch.mm(x[probes].float(), weight.float().t())  # fp32, TF32 off
        try:
            assert_within_tolerance(
                torch.cat([alone_lt[i] for i in probes]),
                reference,
                op_class="reduction",
                name=f"cuBLASLt pinned {name}",
            )
            entry["probe_rows_within_tolerance"] = True
        except AssertionError as error:
            entry["probe_rows_within_tolerance"] = False
            entry["tolerance_failure"] = str(error).splitlines()[0]
    alone_mm = {i: torch.mm(x[i : i + 1], weight.t()) for i in PROBE_ROWS}
    full_lt = run_lt(x).clone() if m_max in served else None
    full_mm = torch.mm(x, weight.t())
    per_m = []
    for m in sweep:
        status, workspace = checks[m]
        row = {
            "M": m,
            "algo_check": STATUS_NAMES.get(status, status),
            "workspace_bytes": workspace,
        }
        mm = torch.mm(x[:m], weight.t())
        row["torch_mm_probe_failures"] = len(_probe_failures(mm, alone_mm, f"torch.mm M={m}"))
        row["torch_mm_rows_differing_from_M_max"] = _mismatching_rows(mm, full_mm[:m])
        if status == 0:
            try:
                out = run_lt(x[:m])
            except CublasLtError as error:  # the check passed but the launch did not
                row["lt_run_error"] = str(error)
                row["lt_bitwise_invariant"] = False
                per_m.append(row)
                continue
            failures = _probe_failures(out, alone_lt, f"cuBLASLt M={m}") if alone_lt else None
            row["lt_probe_failures"] = failures
            row["lt_rows_differing_from_M_max"] = (
                _mismatching_rows(out, full_lt[:m]) if full_lt is not None else None
            )
            # None: M = 1 or M = 8191 is not served, so a reference row is missing.
            row["lt_bitwise_invariant"] = (
                None
                if not alone_lt or full_lt is None
                else not failures and row["lt_rows_differing_from_M_max"] == 0
            )
            if m in timed_m:
                lt_fn = lt.matmul_fn(algo, x[:m].contiguous(), weight, workspace)
                row["lt_ms"] = median_ms(lt_fn, warmup_ms=25, rep_ms=rep_ms)
        else:
            row["lt_bitwise_invariant"] = None  # not served: nothing to compare
        if m in timed_m:
            xm = x[:m].contiguous()
            row["torch_mm_ms"] = median_ms(
                lambda a=xm: torch.mm(a, weight.t()), warmup_ms=25, rep_ms=rep_ms
            )
            try:
                row["batchinv_ms"] = median_ms(
                    lambda a=xm: matmul_nt(a, weight), warmup_ms=25, rep_ms=rep_ms
                )
            except Exception as error:  # batchinv's own failure must not hide cuBLASLt's data
                row["batchinv_error"] = f"{type(error).__name__}: {error}"
        per_m.append(row)
        del mm
    entry["per_m"] = per_m
    entry["served_every_m"] = len(served) == len(sweep)
    entry["served_every_m_without_workspace"] = all(checks[m] == (0, 0) for m in sweep)
    entry["bitwise_at_every_m"] = all(r["lt_bitwise_invariant"] for r in per_m)
    return entry


def _markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# cuBLASLt with one pinned algorithm: a study",
        "",
        f"{env['gpu']}, driver {env['driver']}, torch {env['versions']['torch']}, "
        f"cuBLASLt {result['cublaslt_version']}, commit {env['commit']}, {env['date_utc']}.",
        f"Produced by `tools/study_cublaslt.py`. Algorithm pinned from the heuristic's top "
        f"choice at M = {PIN_AT_M} (heuristic allowed no workspace), split-K 1, reduction none. "
        "`AlgoCheck` = `cublasLtMatmulAlgoCheck` for that M, with the workspace it asks for "
        "(`ws`, bytes; the run gets exactly that); `bitwise` = every probe row "
        "alone equals the row in the batch and every row equals the same row at M = 8191. "
        "Times: medians in ms (bf16 only); ratio = torch.mm time / time.",
        "",
        "Adoptable (served and bitwise at every M of every shape), by pinning: "
        + ", ".join(f"{v}: **{ok}**" for v, ok in result["adoptable_by_variant"].items())
        + ("" if result["complete"] else " (incomplete run)"),
        "",
        *(f"- error: {error}" for error in result["errors"]),
        "",
    ]
    for entry in result["shapes"]:
        cfg = entry["pinned_config"]
        lines += [
            f"## {entry['layer']} (N = {entry['N']}, K = {entry['K']}, {entry['dtype']}), "
            f"pinning: {entry['variant']}",
            "",
            f"Pinned: algo {cfg['algo_id']}, tile {cfg['tile_id']}, stages {cfg['stages_id']}, "
            f"swizzle {cfg['cta_swizzling']}, custom {cfg['custom_option']}, inner "
            f"{cfg['inner_shape_id']}, cluster {cfg['cluster_shape_id']}, split-K "
            f"{cfg['splitk_num']} (heuristic had {entry['heuristic_config']['splitk_num']}); "
            f"{entry['pinned_from']}. Probe rows within the `reduction` tolerance of fp32: "
            f"{entry.get('probe_rows_within_tolerance')}. Heuristic's own descriptor at "
            f"M = {PIN_AT_M}: {entry['heuristic_algo_check']}.",
            "",
            "| M | AlgoCheck | cuBLASLt bitwise | torch.mm rows off | cuBLASLt ms | torch.mm ms "
            "| batchinv ms | cuBLASLt ratio | batchinv ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in entry["per_m"]:
            lt_ms, mm_ms, bi_ms = (row.get(key) for key in ("lt_ms", "torch_mm_ms", "batchinv_ms"))
            lines.append(
                f"| {row['M']} | {row['algo_check']}"
                + (f" (ws {row['workspace_bytes']})" if row["workspace_bytes"] else "")
                + f" | {_yes_no(row['lt_bitwise_invariant'])}"
                + f" ({_count(row.get('lt_rows_differing_from_M_max'))} rows off,"
                + f" {_count(row.get('lt_probe_failures'))} probes off)"
                + f" | {row['torch_mm_rows_differing_from_M_max']}"
                + f" | {_num(lt_ms)} | {_num(mm_ms)} | {_num(bi_ms)}"
                + f" | {_ratio(mm_ms, lt_ms)} | {_ratio(mm_ms, bi_ms)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _yes_no(value) -> str:
    return "not served" if value is None else ("yes" if value else "**no**")


def _count(value) -> str:
    if value is None:
        return "-"
    return str(len(value)) if isinstance(value, list) else str(value)


def _num(value) -> str:
    return "" if value is None else f"{value:.4f}"


def _ratio(anchor, value) -> str:
    return "" if anchor is None or value is None else f"{anchor / value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / "reports/cublaslt/study.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "reports/cublaslt/study.md")
    parser.add_argument("--quick", action="store_true", help="two shapes, M up to 257, bf16")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timing window per point")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this study needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    lt = CublasLt(find_cublaslt())
    shapes = QWEN3_8B_LINEAR[:2] if args.quick else QWEN3_8B_LINEAR
    sweep = tuple(m for m in LINEAR_M_SWEEP if m <= 257) if args.quick else LINEAR_M_SWEEP
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    result = {
        "study": "cuBLASLt pinned algorithm, bitwise M sweep",
        "environment": environment(),
        "cublaslt_library": lt.path,
        "cublaslt_version": lt.version,
        "m_sweep": list(sweep),
        "probe_rows": list(PROBE_ROWS),
        "shapes": [],
        "errors": [],
        "complete": False,
    }
    runs = [(v, s, d) for v in VARIANTS for s in shapes for d in dtypes]
    for variant, (name, k, n), dtype in runs:  # the heuristic's pinning first, every shape
        # bf16 is timed: every M for the heuristic's pinning, the benchmark's M for the other.
        timed = (
            () if dtype != torch.bfloat16 else sweep if variant is VARIANTS[0] else LINEAR_BENCH_M
        )
        label = f"{variant[0]}: {name} {dtype}"
        try:
            entry = study_shape(lt, name, k, n, dtype, sweep, variant, timed, args.rep_ms)
        except (CublasLtError, RuntimeError) as error:  # recorded, the study goes on
            print(f"{label}: {type(error).__name__}: {error}", flush=True)
            result["errors"].append(f"{label}: {type(error).__name__}: {error}")
            continue
        result["shapes"].append(entry)
        torch.cuda.empty_cache()  # the lm_head batches are large
        _write(args, result)  # after every shape, so a time limit keeps what ran
        print(
            f"{label}: served every M {entry['served_every_m']}, "
            f"bitwise at every M {entry['bitwise_at_every_m']}, "
            f"pinned {entry['pinned_config']}",
            flush=True,
        )
    result["complete"] = True
    _write(args, result)
    print(_markdown(result))


def _write(args: argparse.Namespace, result: dict) -> None:
    # A pinning is adoptable if it serves and is bitwise at every M of every shape run.
    result["adoptable_by_variant"] = {
        variant: bool(entries)
        and all(e["served_every_m"] and e["bitwise_at_every_m"] for e in entries)
        for variant, _ in VARIANTS
        for entries in [[e for e in result["shapes"] if e["variant"] == variant]]
    }
    result["adoptable"] = any(result["adoptable_by_variant"].values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(_markdown(result) + "\n")


if __name__ == "__main__":
    main()
