#!/bin/bash
# attn-hopper-d64 device call 1 and 2 (run from the staged tree): card, a d = 64 smoke check, the timing
# script, the Hopper test file, the prefill benchmark; every log straight into $OUT.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/card.txt"
timeout 30 python3 reports/attn_hopper_d64/smoke_d64.py 2>&1 | tee "$OUT/smoke.log"
timeout 60 python3 reports/attn_hopper_d64/time_d64.py "$OUT/time_d64.json" 2>&1 | tee "$OUT/time.log"
BATCHINV_QUICK=1 timeout 110 python3 -m pytest tests/gpu/test_attention_hopper_cuda.py -q -x \
    2>&1 | tail -60 | tee "$OUT/test.log"
timeout 30 python3 benchmarks/bench_attention.py --phase prefill --json "$OUT/bench.json" \
    2>&1 | tee "$OUT/bench.log"
