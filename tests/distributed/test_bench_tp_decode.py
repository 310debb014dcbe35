"""benchmarks/bench_tp_decode.py (a multi-GPU script): its arguments, its refusal without two
GPUs, and its per-rank measurement on the CPU over gloo at a small config (every rank runs
the same collectives in the same order, and the TP step's logits equal one device's)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from _spawn import run_world

from batchinv.models.qwen3 import Qwen3Config

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
# Splits unevenly at TP = 3 (3 / 3 / 2 heads; vocabulary tiles 2 / 1 / 1, the last partial),
# so the stock logits' padded gather runs too.
CONFIG = Qwen3Config(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=256,
)


def _import_bench():
    """The script as a module (it imports benchmarks/_common.py and bench_decode.py)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        return importlib.import_module("bench_tp_decode")
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="module")
def bench():
    return _import_bench()


def test_arguments(bench):
    args = bench.parse_args([])
    assert (args.layers, args.batch, args.context) == (4, [1, 8, 64], 4096)
    assert (args.world, args.json) == (None, None)
    args = bench.parse_args(["--layers", "2", "--batch", "3", "5", "--context", "100"])
    assert (args.layers, args.batch, args.context) == (2, [3, 5], 100)
    for bad in (["--layers", "0"], ["--batch", "0"], ["--batch", "two"], ["--context", "40950"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal without 2 GPUs")
def test_refuses_to_run_without_two_gpus(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun
    out = tmp_path / "tp_decode.json"
    with pytest.raises(SystemExit) as refused:
        bench.main(["--json", str(out)])
    assert refused.value.code == 1
    assert "needs 2 or more NVIDIA GPUs" in capsys.readouterr().err
    assert not out.exists()


def _measure(rank: int, world: int) -> dict:
    bench = _import_bench()
    bench.WARMUP, bench.REPS = 1, 2
    args = bench.parse_args(["--batch", "1", "3", "--context", "8"])
    rows, summary = bench.measure(rank, world, args, torch.device("cpu"), config=CONFIG)
    return {"rows": rows, "summary": summary}


def test_measure_on_gloo(tmp_path):
    world = 3
    results = run_world(_measure, world, tmp_path, timeout_s=300)
    rows = results[0]["rows"]
    assert [(r["world"], r["batch"], r["context"], r["layers"]) for r in rows] == [
        (world, 1, 8, 2),
        (world, 3, 8, 2),
    ]
    for row, summary in zip(rows, results[0]["summary"], strict=True):
        assert row["tp_bitwise_one_gpu"] is True
        assert row["batchinv_tp_ms"] > 0 and row["stock_tp_ms"] > 0
        assert row["batchinv_one_gpu_ms"] > 0
        # on CPU the stock step keeps SDPA's own pick, and no second stock step is timed
        assert row["stock_attention"] == "SDPA, kv heads repeated, its own pick"
        assert row["stock_tp_sdpa_default_ms"] is None
        assert "kv heads repeated" in summary["anchor"]
        assert row["stock_tp_vs_batchinv_tp"] == row["stock_tp_ms"] / row["batchinv_tp_ms"]
        assert summary["ratio"] == row["stock_tp_vs_batchinv_tp"]
        assert summary["goal"] is None
    for result in results[1:]:  # the slowest rank's medians reach every rank
        for row, first in zip(result["rows"], rows, strict=True):
            assert row["batchinv_tp_ms"] == first["batchinv_tp_ms"]
            assert row["stock_tp_ms"] == first["stock_tp_ms"]
            assert row["batchinv_one_gpu_ms"] is None  # rank 0 alone runs one device
