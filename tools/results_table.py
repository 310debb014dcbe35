"""The results tables of the README and of ``docs/results.md``, made from the benchmark files.

Reads every ``benchmarks/results/*.json`` with a ``summary`` list (schema ``batchinv-bench/1``,
see ``benchmarks/_common.py``) and writes:

- in ``README.md``, between ``<!-- results:begin -->`` and ``<!-- results:end -->``: one row
  per (op, variant): what it times, its anchor, the range of ratios over the measured cases,
  the goal, and how many cases meet it;
- ``docs/results.md``: every summary row, grouped by benchmark file, with the card, commit and
  versions of the run that made it.

A goal counts only on the public op: a row that times the kernels alone (``scope`` "kernel",
or, in files without ``scope``, a variant naming a kernel or "no autograd") is quoted beside
the op's rows, never counted.  An op with several GPU paths (``linear``: batchinv's kernels
and the pinned cuBLASLt algorithm) must name the path that ran (``ran``); its rows without one
count nothing, and each path's variant missing from the file shows as "not measured".

Nothing in either table is typed by hand: rerun this after ``nox -s bench``.

    python tools/results_table.py           # rewrite both
    python tools/results_table.py --check   # exit 1 if either is out of date (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# Ops with more than one GPU path: each path's summary variant (benchmarks/bench_linear.py's
# VARIANTS), and the anchor and benchmark of those rows.
PATH_VARIANTS = {
    "linear": {
        "variants": (
            "forward, own kernels",
            "forward, own kernels, CUDA graph",
            "forward, pinned cuBLASLt",
        ),
        # the path each variant times (bench_linear.py's rows name it in "path")
        "paths": {
            "forward, own kernels": "own",
            "forward, own kernels, CUDA graph": "own",
            "forward, pinned cuBLASLt": "cublaslt",
        },
        "anchor": "cuBLAS (torch.mm)",
        "bench": "benchmarks/bench_linear.py",
    }
}
SCOPE_LABELS = {"op": "public op", "kernel": "kernel only", "unlabelled": "path not recorded"}


def load(results: Path) -> list[dict]:
    """The benchmark files that carry a summary, sorted by name."""
    files = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("summary"), list):
            files.append({"name": path.name, **data})
    return files


def _ratio(value: object) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "n/a"
    return f"{value:.2f}x"


def scope(row: dict) -> str:
    """What a summary row times: "op", "kernel", or "unlabelled" (a row of an op with several
    paths that names none)."""
    if row.get("op") in PATH_VARIANTS and not row.get("ran"):
        return "unlabelled"
    if row.get("scope") in ("op", "kernel"):
        return row["scope"]
    variant = row.get("variant", "")
    return "kernel" if "kernel" in variant or "no autograd" in variant else "op"


def _meets(row: dict) -> bool | None:
    goal, ratio = row.get("goal"), row.get("ratio")
    if goal is None or not isinstance(ratio, int | float):
        return None
    return ratio >= goal


def _is_own_benchmark(data: dict, op: str) -> bool:
    """Whether ``data`` came from ``op``'s own benchmark script (its name starts with the
    script's stem: "linear (bf16)" from bench_linear.py)."""
    stem = Path(PATH_VARIANTS[op]["bench"]).stem.removeprefix("bench_")
    return str(data.get("benchmark", "")).split(" ")[0] == stem


def _missing_variants(data: dict) -> list[tuple[str, str, str | None]]:
    """(op, variant, refusal) of every path variant that an op with several paths should
    report but this file lacks.  Expected in a file whose rows of that op time its paths (a
    path variant, or a row that names no path); ``refusal`` is the reason the benchmark
    recorded when the path refused every case (its rows with a ``note``), else None.  Only
    the op's own benchmark (``PATH_VARIANTS[op]["bench"]``) is expected to time its paths:
    another file's rows of the op (host time, say) are not a path's timing."""
    present = {(row["op"], row["variant"]) for row in data["summary"]}
    timed = {
        row["op"]
        for row in data["summary"]
        if row["op"] in PATH_VARIANTS
        and _is_own_benchmark(data, row["op"])
        and (not row.get("ran") or row["variant"] in PATH_VARIANTS[row["op"]]["variants"])
    }
    missing = []
    for op in sorted(timed):
        for variant in PATH_VARIANTS[op]["variants"]:
            if (op, variant) in present:
                continue
            path = PATH_VARIANTS[op]["paths"][variant]
            notes = [
                r["note"] for r in data.get("rows", []) if r.get("path") == path and r.get("note")
            ]
            missing.append((op, variant, notes[0] if notes else None))
    return missing


def _run(environment: dict) -> str:
    commit = str(environment.get("commit") or "unknown")[:7]
    return f"{environment.get('gpu', 'unknown GPU')}, `{commit}`"


def summary_table(files: list[dict]) -> str:
    """One line per (op, variant): min-max ratio over its cases and how many meet the goal."""
    lines = [
        "| op | variant | times | anchor | ratio (min-max) | goal | cases at goal | run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for data in files:
        groups: dict[tuple[str, str], list[dict]] = {}
        for row in data["summary"]:
            groups.setdefault((row["op"], row["variant"]), []).append(row)
        for (op, variant), rows in groups.items():
            kind = scope(rows[0])
            ratios = [r["ratio"] for r in rows if isinstance(r.get("ratio"), int | float)]
            span = (
                f"{_ratio(min(ratios))}-{_ratio(max(ratios))}"
                if len(ratios) > 1
                else _ratio(ratios[0] if ratios else None)
            )
            goals = sorted({r["goal"] for r in rows if r.get("goal") is not None})
            goal = ", ".join(f"{g:.2f}x" for g in goals) or "-"
            verdicts = [_meets(r) for r in rows]
            judged = [v for v in verdicts if v is not None]
            at_goal = f"{sum(judged)} of {len(judged)}" if judged else "-"
            if judged and kind != "op":
                at_goal = f"not counted ({SCOPE_LABELS[kind]}: {at_goal})"
            anchors = ", ".join(dict.fromkeys(r["anchor"] for r in rows))
            lines.append(
                f"| {op} | {variant} | {SCOPE_LABELS[kind]} | {anchors} | {span} | {goal} "
                f"| {at_goal} | {_run(data['environment'])} |"
            )
        for op, variant, refusal in _missing_variants(data):
            spec = PATH_VARIANTS[op]
            anchor = spec["anchor"] + (", CUDA graph" if variant.endswith(", CUDA graph") else "")
            if refusal is not None:
                lines.append(
                    f"| {op} | {variant} | public op | {anchor} | refused on this card "
                    f"([results](docs/results.md)) | - | - | {_run(data['environment'])} |"
                )
                continue
            lines.append(
                f"| {op} | {variant} | public op | {anchor} | not measured | - | - "
                f"| rerun `{spec['bench']}` |"
            )
    return "\n".join(lines)


def full_page(files: list[dict]) -> str:
    """``docs/results.md``: every summary row of every benchmark file."""
    out = [
        "# Benchmark results",
        "",
        "Generated by `tools/results_table.py` from `benchmarks/results/*.json`; do not edit.",
        "ratio = anchor time / batchinv time for the same work, measured in the same run on the",
        'same card (higher is better; 1.00x = as fast as the anchor). "times": the public op',
        'as a user calls it, or the kernels alone (a variant naming a kernel or "no autograd");',
        'a goal counts only on the public op. "ran": the path that served the row, for an op',
        "with several (`linear`: batchinv's kernels or the pinned cuBLASLt algorithm); such an",
        'op\'s rows without it are marked "path not recorded" and count nothing.',
    ]
    for data in files:
        env = data["environment"]
        versions = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items())
        out += [
            "",
            f"## {data.get('benchmark', data['name'])} (`benchmarks/results/{data['name']}`)",
            "",
            f"{_run(env)}, driver {env.get('driver', 'unknown')}, {versions}; "
            f"{env.get('date_utc', 'undated')}.",
            "",
            "| variant | case | times | ran | batchinv ms | anchor | anchor ms | ratio | goal |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in data["summary"]:
            goal, kind = row.get("goal"), scope(row)
            verdict = _meets(row)
            if verdict is None:
                mark = ""
            elif kind != "op":
                mark = " (not counted)"
            else:
                mark = " (met)" if verdict else " (missed)"
            out.append(
                f"| {row['variant']} | {row['case']} | {SCOPE_LABELS[kind]} "
                f"| {row.get('ran') or '-'} | {row.get('batchinv_ms', float('nan')):.4f} "
                f"| {row['anchor']} | {row.get('anchor_ms', float('nan')):.4f} "
                f"| {_ratio(row.get('ratio'))} | "
                f"{'-' if goal is None else f'{goal:.2f}x'}{mark} |"
            )
        missing = _missing_variants(data)
        unmeasured = [(op, variant) for op, variant, refusal in missing if refusal is None]
        if unmeasured:
            names = ", ".join(f'{op} "{variant}"' for op, variant in unmeasured)
            out += ["", f"Not measured in this file: {names}."]
        for op, variant, refusal in missing:
            if refusal is not None:
                out += ["", f'{op} "{variant}": the path refused these cases: {refusal}']
    return "\n".join(out) + "\n"


def with_table(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table``."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a table is out of date")
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    files = load(args.root / "benchmarks" / "results")
    targets = {
        args.root / "README.md": with_table(
            (args.root / "README.md").read_text(), summary_table(files)
        ),
        args.root / "docs" / "results.md": full_page(files),
    }
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(
                f"{path.relative_to(args.root)} is out of date: run python tools/results_table.py"
            )
        return 1 if stale else 0
    for path in stale:
        path.write_text(targets[path])
        print(f"wrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
