"""benchmarks/bench_qwen3_e2e.py (a GPU script) imports and checks its arguments on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_qwen3_e2e.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # the script imports benchmarks/_common.py
    try:
        spec = importlib.util.spec_from_file_location("bench_qwen3_e2e", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH.parent))


def test_arguments(bench):
    args = bench.parse_args(["--layers", "3", "--json", "out.json"])
    assert (args.layers, args.prefill_batch, args.prefill_len) == (3, 8, 4096)
    assert (args.decode_batch, args.context) == (64, 4096)
    for bad in (["--layers", "0"], ["--layers", "two"], ["--context", "50000"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_config_is_qwen3_8b_shaped(bench):
    from batchinv.models.qwen3 import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, **bench.QWEN3_8B)
    assert config.num_attention_heads * config.head_dim == config.hidden_size == 4096
    assert bench.PATHS == ("stock", "batchinv")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_refuses_to_run_without_a_gpu(bench):
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench.main(["--layers", "1"])


def test_summary_rows(bench):
    args = bench.parse_args(["--layers", "3"])
    rows = [
        {"phase": phase, "path": path, "total_ms": ms}
        for phase, path, ms in (
            ("prefill", "stock", 100.0),
            ("prefill", "batchinv", 110.0),
            ("decode", "stock", 4.0),
            ("decode", "batchinv", 5.0),
        )
    ]
    summary = bench.summary_rows(rows, args)
    assert [(r["variant"], r["anchor"]) for r in summary] == [
        ("prefill", "stock PyTorch"),
        ("decode", "stock PyTorch"),
    ]
    assert summary[0]["case"].startswith("B=8 S=4096, 3 layers")
    assert summary[1]["case"].startswith("B=64 ctx=4096, 3 layers")
    assert summary[0]["ratio"] == pytest.approx(bench.GOAL)  # exactly 1.10x stock: on the goal
    assert summary[1]["ratio"] == pytest.approx(0.8)
    assert summary[1]["ratio"] < summary[1]["goal"]
    assert {"op", "case", "variant", "batchinv_ms", "anchor", "anchor_ms", "ratio", "goal"} == set(
        summary[0]
    )
