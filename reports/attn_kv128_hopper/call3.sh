#!/bin/bash
# attn-kv128-hopper device call 3 (<= 300 s), after merging the core branch (128-key blocks in
# every mma.sync kernel): the Hopper and attention GPU test files (bitwise against the mma.sync
# kernels), bench_attention.py --phase prefill, the interleaved timing against main's 64-key
# kernel (temporary module), then the KV-cache, plan and coverage attention tests if time is left.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
R=reports/attn_kv128_hopper
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
timeout 40 python3 $R/check_kv128.py --smoke > $OUT/smoke.log 2>&1
rc=$?
tail -5 $OUT/smoke.log
[ $rc -ne 0 ] && { echo "smoke failed rc=$rc at ${SECONDS}s"; exit 1; }
timeout 80 $PT tests/gpu/test_attention_hopper_cuda.py 2>&1 | tail -25 > $OUT/tests_hopper.log
echo "hopper tests done at ${SECONDS}s" | tee -a $OUT/tests_hopper.log
BATCHINV_QUICK=1 timeout 80 $PT tests/gpu/test_attention_cuda.py 2>&1 | tail -25 \
  > $OUT/tests_attention.log
echo "attention tests done at ${SECONDS}s" | tee -a $OUT/tests_attention.log
tail -3 $OUT/tests_hopper.log $OUT/tests_attention.log
(cd benchmarks && timeout 35 python3 bench_attention.py --phase prefill --json $OUT/bench.json \
  2>&1 | tail -14 > $OUT/bench.log)
cat $OUT/bench.log
left=$((285 - SECONDS))
[ $left -gt 30 ] && timeout $((left < 45 ? left : 45)) python3 $R/time_kv128.py \
  $OUT/timing.json > $OUT/timing.log 2>&1
cat $OUT/timing.log
left=$((292 - SECONDS))
[ $left -gt 10 ] && timeout $left $PT tests/gpu/test_kv_cache_cuda.py \
  tests/gpu/test_attention_plan_cuda.py 2>&1 | tail -6 > $OUT/tests_more.log
echo "all done at ${SECONDS}s" | tee -a $OUT/tests_more.log
cat $OUT/tests_more.log
