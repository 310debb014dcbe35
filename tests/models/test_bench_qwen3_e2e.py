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
