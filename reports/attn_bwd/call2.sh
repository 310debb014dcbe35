#!/bin/bash
# attn-bwd device call 2 (session 10, commit e7b5dfd, since reverted): run from the carried
# worktree's root on the device.
# The pair dQ kernel: paired timing rounds (with the bitwise check at the benchmark shape), the
# GPU test file (BATCHINV_QUICK=1, -x), then the benchmark; each under its own time limit.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 75 python3 reports/attn_bwd/time_dq_pair.py "$OUT/time_dq_pair.json" 2>&1 |
    tee "$OUT/time_dq_pair.log"
BATCHINV_QUICK=1 timeout 100 python3 -m pytest tests/gpu/test_attention_backward_cuda.py -q -x \
    2>&1 | tail -20 | tee "$OUT/test.log"
timeout 55 python3 benchmarks/bench_attention_backward.py --json "$OUT/bench.json" 2>&1 |
    tee "$OUT/bench.log"
