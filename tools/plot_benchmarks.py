"""One chart of batchinv-over-anchor ratios from the benchmark result files.

Reads every ``benchmarks/results/*.json`` that carries a ``summary`` list (schema
``batchinv-bench/1``, see ``benchmarks/_common.py``) and draws one horizontal bar per (op,
variant, case): the ratio anchor_ms / batchinv_ms, a line at 1.0 and the goal as a mark.
Files without a summary (other studies, older results) are listed and skipped.  The title
names the GPU(s) and commit(s) the files come from.

    python tools/plot_benchmarks.py [--results benchmarks/results] [--out .../ratios.png]

matplotlib is needed here only; it is not a dependency of the package or of CI.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("op", "case", "variant", "ratio", "anchor")


def load_summaries(results: Path) -> tuple[list[dict], list[dict], list[str]]:
    """(summary rows, environments, notes on skipped files or rows) from ``results``/*.json."""
    rows, environments, notes = [], [], []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            notes.append(f"{path.name}: unreadable ({error})")
            continue
        summary = data.get("summary") if isinstance(data, dict) else None
        if not isinstance(summary, list):
            notes.append(f"{path.name}: no 'summary' list, skipped")
            continue
        environments.append(data.get("environment") or {})
        for index, row in enumerate(summary):
            missing = [key for key in REQUIRED if not isinstance(row, dict) or key not in row]
            if missing or not _finite(row["ratio"]):
                notes.append(
                    f"{path.name}: summary[{index}] skipped (missing {missing or 'ratio'})"
                )
                continue
            rows.append({**row, "source": path.name})
    return rows, environments, notes


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def title_for(environments: list[dict]) -> str:
    gpus = sorted({str(env.get("gpu")) for env in environments})
    commits = sorted({str(env.get("commit"))[:7] for env in environments})
    return (
        "batchinv speed over its anchor (anchor time / batchinv time; higher is better)\n"
        f"GPU: {', '.join(gpus)} · commit: {', '.join(commits)}"
    )


def plot(rows: list[dict], title: str, out: Path) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "tools/plot_benchmarks.py needs matplotlib (pip install matplotlib); "
            "it is not a dependency of batchinv"
        ) from error
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ops = list(dict.fromkeys(row["op"] for row in rows))
    colors = {op: plt.cm.tab10(i % 10) for i, op in enumerate(ops)}
    rows = sorted(rows, key=lambda row: ops.index(row["op"]))  # stable: file order inside op
    labels = [f"{row['op']} · {row['variant']} · {row['case']}" for row in rows]
    ratios = [float(row["ratio"]) for row in rows]
    positions = list(range(len(rows)))[::-1]  # first row at the top
    height = 1.2 + 0.24 * len(rows)
    fig, ax = plt.subplots(figsize=(13, height))
    ax.barh(positions, ratios, color=[colors[row["op"]] for row in rows], height=0.7)
    handles = []
    for op in ops:  # one legend entry per op, naming its anchor(s)
        anchors = dict.fromkeys(row["anchor"] for row in rows if row["op"] == op)
        handles.append(Patch(color=colors[op], label=f"{op} vs {' / '.join(anchors)}"))
    for y, ratio in zip(positions, ratios, strict=True):
        ax.text(ratio + 0.01, y, f"{ratio:.2f}", va="center", fontsize=7)
    goals = [(y, row["goal"]) for y, row in zip(positions, rows, strict=True) if row.get("goal")]
    if goals:
        ax.scatter(
            [goal for _, goal in goals],
            [y for y, _ in goals],
            marker="|",
            s=140,
            color="black",
            zorder=3,
        )
        handles.append(
            Line2D([], [], marker="|", color="black", linestyle="", markersize=10, label="goal")
        )
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    handles.append(Line2D([], [], color="grey", linestyle="--", label="as fast as the anchor"))
    ax.set_yticks(positions, labels, fontsize=7)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlim(0, max(max(ratios), 1.0) * 1.12)
    ax.set_xlabel("ratio = anchor time / batchinv time for the same work (copy anchors: bandwidth)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", linewidth=0.3)
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.55 / (height - 1.0)),  # below the x label, in axes units
        ncol=2,
        fontsize=8,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=None, help="default: RESULTS/ratios.png")
    args = parser.parse_args()
    rows, environments, notes = load_summaries(args.results)
    for note in notes:
        print(f"note: {note}")
    if not rows:
        raise SystemExit(f"no summary rows in {args.results}/*.json; nothing to plot")
    out = args.out or args.results / "ratios.png"
    plot(rows, title_for(environments), out)
    print(f"wrote {out} ({len(rows)} bars from {len(environments)} files)")


if __name__ == "__main__":
    main()
