"""The README's results table and docs/results.md are generated from the benchmark files and
kept in step with them (``tools/results_table.py --check``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools/results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_tables_match_the_benchmark_files(results_table):
    assert results_table.main(["--check"]) == 0, "run: python tools/results_table.py"


@pytest.fixture
def copy_of_tree(tmp_path):
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "docs" / "results.md")
    return tmp_path


def test_a_changed_ratio_makes_the_tables_stale(results_table, copy_of_tree):
    path = copy_of_tree / "benchmarks" / "results" / "linear.json"
    data = json.loads(path.read_text())
    data["summary"][0]["ratio"] = 0.123
    path.write_text(json.dumps(data))
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 1
    assert results_table.main(["--root", str(copy_of_tree)]) == 0
    assert "0.12x" in (copy_of_tree / "README.md").read_text()
    assert "0.12x" in (copy_of_tree / "docs" / "results.md").read_text()
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 0


def test_a_hand_edited_table_is_caught(results_table, copy_of_tree):
    readme = copy_of_tree / "README.md"
    readme.write_text(readme.read_text().replace("| linear |", "| linear (edited) |", 1))
    assert results_table.main(["--check", "--root", str(copy_of_tree)]) == 1


def test_goal_verdicts(results_table):
    files = [
        {
            "name": "x.json",
            "environment": {"gpu": "G", "commit": "abcdef0123"},
            "summary": [
                {"op": "o", "case": "a", "variant": "v", "anchor": "copy", "ratio": 0.95,
                 "goal": 0.9},
                {"op": "o", "case": "b", "variant": "v", "anchor": "copy", "ratio": 0.85,
                 "goal": 0.9},
            ],
        }
    ]  # fmt: skip
    table = results_table.summary_table(files)
    assert "| o | v | public op | copy | 0.85x-0.95x | 0.90x | 1 of 2 | G, `abcdef0` |" in table


def _file(*summary: dict, benchmark: str = "linear (bf16)") -> dict:
    return {
        "name": "x.json",
        "benchmark": benchmark,
        "environment": {"gpu": "G", "commit": "abcdef0"},
        "summary": summary,
    }


def _row(op: str, variant: str, ratio: float, **extra) -> dict:
    return {"op": op, "case": "c", "variant": variant, "anchor": "a", "ratio": ratio,
            "goal": 0.9, "batchinv_ms": 1.0, "anchor_ms": ratio, **extra}  # fmt: skip


def test_kernel_rows_are_quoted_but_never_count_toward_a_goal(results_table):
    data = _file(
        _row("rope", "forward kernel (no check)", 0.95),
        _row("rope", "forward op (+position check)", 0.72),
        _row("rms_norm", "backward kernel (no autograd)", 0.91),
        _row("x", "fast path", 0.99, scope="kernel"),  # an explicit scope wins over the name
    )
    table = results_table.summary_table([data])
    assert "| rope | forward kernel (no check) | kernel only | a | 0.95x | 0.90x " in table
    assert "| not counted (kernel only: 1 of 1) |" in table
    assert (
        "| rope | forward op (+position check) | public op | a | 0.72x | 0.90x | 0 of 1 |" in table
    )
    assert "| x | fast path | kernel only |" in table
    page = results_table.full_page([data])
    assert "| 0.95x | 0.90x (not counted) |" in page
    assert "| 0.72x | 0.90x (missed) |" in page


def test_linear_rows_must_name_their_path_and_each_path_is_quoted(results_table):
    old = _file(_row("linear", "forward", 1.0))
    table = results_table.summary_table([old])
    assert "| linear | forward | path not recorded |" in table
    assert "not counted (path not recorded: 1 of 1)" in table
    for variant in results_table.PATH_VARIANTS["linear"]["variants"]:
        assert f"| linear | {variant} | public op |" in table
    assert table.count("| not measured |") == 3
    assert 'Not measured in this file: linear "forward, own kernels"' in (
        results_table.full_page([old])
    )

    own = "own: hopper bm128 bn256 k64 s4"
    pinned = "cublaslt: cuBLASLt algo 66 tile 24 stages 35 split-K 1"
    new = _file(
        _row("linear", "forward, own kernels", 0.88, scope="op", ran=own),
        _row("linear", "forward, own kernels, CUDA graph", 0.97, scope="op", ran=own),
        _row("linear", "forward, pinned cuBLASLt", 0.99, scope="op", ran=pinned),
    )
    table = results_table.summary_table([new])
    assert "not measured" not in table and "path not recorded" not in table
    assert "| linear | forward, own kernels | public op | a | 0.88x | 0.90x | 0 of 1 |" in table
    assert "| linear | forward, pinned cuBLASLt | public op | a | 0.99x | 0.90x | 1 of 1 |" in table
    page = results_table.full_page([new])
    assert f"| public op | {pinned} | 1.0000 |" in page
    assert f"| public op | {own} | 1.0000 |" in page


def test_a_path_that_refused_is_shown_as_refused_with_its_reason(results_table):
    own = "own: hopper bm128 bn256 k64 s4"
    data = _file(
        _row("linear", "forward, own kernels", 0.88, scope="op", ran=own),
        _row("linear", "forward, own kernels, CUDA graph", 0.97, scope="op", ran=own),
    )
    data["rows"] = [{"path": "cublaslt", "ran": None, "note": "bits differ (NaN 0x7fff)"}]
    table = results_table.summary_table([data])
    assert "| linear | forward, pinned cuBLASLt | public op | cuBLAS (torch.mm) | refused" in table
    assert "not measured" not in table
    assert "the path refused these cases: bits differ (NaN 0x7fff)" in results_table.full_page(
        [data]
    )


def test_rows_of_a_multi_path_op_that_name_their_path_expect_no_other_variants(results_table):
    data = _file(_row("linear", "eager host time per call", 0.6, scope="op", ran="own: x"))
    table = results_table.summary_table([data])
    assert "not measured" not in table and "refused" not in table


def test_another_benchmarks_rows_of_a_multi_path_op_expect_no_path_variants(results_table):
    # bench_host_overhead.py times linear's host side, no path: not linear's own benchmark
    data = _file(
        _row("linear", "autograd.grad host time per call", 0.6, scope="op"),
        benchmark="host overhead per eager call",
    )
    table = results_table.summary_table([data])
    assert "not measured" not in table and "refused" not in table
    assert "Not measured in this file" not in results_table.full_page([data])
