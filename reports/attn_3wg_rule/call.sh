#!/bin/bash
# attn-3wg-rule device call (one, <= 150 s): the interleaved timing of the shape rule
# (time_rule.py), the attention GPU test files, bench_attention.py --phase prefill, the backward
# tests (BATCHINV_QUICK) if time is left.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
timeout 40 python3 reports/attn_3wg_rule/time_rule.py $OUT/timing.json 2>&1 | tee $OUT/timing.log
echo "timing done at ${SECONDS}s" | tee -a $OUT/timing.log
timeout 75 python3 -m pytest -q -p no:cacheprovider --durations=5 \
  tests/gpu/test_attention_hopper_cuda.py tests/gpu/test_attention_cuda.py \
  tests/gpu/test_kv_cache_cuda.py tests/gpu/test_attention_autograd_cuda.py \
  2>&1 | tail -30 > $OUT/tests.log
timeout 12 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_coverage_cuda.py \
  -k attention 2>&1 | tail -4 >> $OUT/tests.log
echo "tests done at ${SECONDS}s" | tee -a $OUT/tests.log
left=$((146 - SECONDS))
[ $left -gt 8 ] && (cd benchmarks && timeout $left python3 bench_attention.py --phase prefill \
  --json $OUT/bench.json 2>&1 | tail -14 > $OUT/bench.log)
left=$((146 - SECONDS))
[ $left -gt 8 ] && BATCHINV_QUICK=1 timeout $left python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_attention_backward_cuda.py 2>&1 | tail -6 > $OUT/backward.log
echo "all done at ${SECONDS}s" >> $OUT/timing.log
grep -E "passed|failed|error" $OUT/tests.log | tail -3; cat $OUT/bench.log $OUT/backward.log 2>/dev/null | tail -20
