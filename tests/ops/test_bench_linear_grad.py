"""benchmarks/bench_linear_grad.py (a GPU script) runs its smoke shapes on the CPU and writes
summary rows that tools/results_table.py counts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_linear_grad.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # the script imports benchmarks/_common.py
    try:
        yield _load("bench_linear_grad", BENCH)
    finally:
        sys.path.remove(str(BENCH.parent))


@pytest.fixture(scope="module")
def smoke(bench):
    return bench.main(["--smoke"])


def test_shapes_and_goal(bench):
    from batchinv.shapes import QWEN3_8B_LINEAR

    assert bench.TOKENS == (16384, 32768)
    assert bench.GOAL == 0.9
    assert [name for name, _, _ in QWEN3_8B_LINEAR] == [
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        "lm_head",
    ]


def test_within_blocks_moves_tokens_only_inside_their_block(bench):
    gen = torch.Generator().manual_seed(0)
    for tokens, block in ((128, 16), (130, 64), (5, 16)):
        perm = bench.within_blocks(tokens, block, gen)
        assert sorted(perm.tolist()) == list(range(tokens))
        assert torch.equal(perm // block, torch.arange(tokens) // block)
    assert not torch.equal(bench.within_blocks(128, 64, gen), torch.arange(128))


def test_smoke_run_rows_summary_and_checks(bench, smoke):
    rows, summary, checks = smoke
    cases = [(name, tokens) for name, _, _ in bench.SMOKE_SHAPES for tokens in bench.SMOKE_TOKENS]
    assert [(c["layer"], c["tokens"]) for c in checks] == cases
    for check in checks:  # the contract: bits run to run, grad_x rows follow their tokens
        assert check["deterministic"] is True
        assert check["grad_x_rows_follow"] is True
        # the backward's two routes give the same bits (the GPU only has two)
        assert check.get("in_place_equals_copies", True) is True
        assert ("in_place_equals_copies" in check) == torch.cuda.is_available()
        assert isinstance(check["grad_w_perm16_same"], bool)
        assert isinstance(check["grad_w_perm64_same"], bool)
    op_rows = [r for r in summary if r["scope"] == "op"]
    assert [r["variant"] for r in op_rows] == list(bench.OP_VARIANTS.values()) * len(cases)
    for row in op_rows:
        assert row["op"] == "linear" and row["goal"] == bench.GOAL and row["ran"]
        assert row["anchor"] == bench.OP_ANCHOR
        assert row["ratio"] == pytest.approx(row["anchor_ms"] / row["batchinv_ms"])
    kernel_rows = [r for r in summary if r["scope"] == "kernel"]
    if torch.cuda.is_available():  # each route's launcher and GEMMs
        gemms = set(bench.KERNEL_VARIANTS.values())
        launchers = {
            f"{bench.OP_VARIANTS[which]} backward, {route}"
            for which in ("x", "w")
            for route in ("in place", "copies")
        }
        expected = gemms | {f"{v} on copies" for v in gemms} | launchers
        assert {r["variant"] for r in kernel_rows} == expected
        assert all(r["ran"].startswith(("in place: ", "copies: ")) for r in kernel_rows)
    else:  # the launcher and the GEMMs alone exist on the GPU only
        assert kernel_rows == []
    assert all(r["ms"] > 0 for r in rows)
    assert all("deterministic" in r for r in rows)


def test_results_table_counts_the_op_rows_only(smoke):
    results_table = _load("results_table", ROOT / "tools" / "results_table.py")
    _, summary, _ = smoke
    data = {"name": "linear_grad.json", "environment": {"gpu": "G"}, "summary": summary}
    assert {results_table.scope(r) for r in summary if r["scope"] == "op"} == {"op"}
    table = results_table.summary_table([data])
    assert "| linear | grad_w | public op | cuBLAS (F.linear autograd) |" in table
    assert "not measured" not in table  # no forward path of linear is expected in this file


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU messages")
def test_refuses_to_run_or_record_without_a_gpu(bench, tmp_path):
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench.main([])
    with pytest.raises(SystemExit, match="--json needs a GPU run"):
        bench.main(["--smoke", "--json", str(tmp_path / "x.json")])
