#!/bin/bash
# attn-pp128's one device call (<= 150 s): a smoke run of the ping-pong kernel (a hang would end
# here), the Hopper GPU test file (bitwise against the mma.sync kernels), the interleaved timing
# against the current kernel (temporary module) and SDPA, then bench_attention.py if time is left.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
R=reports/attn_pp128
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
timeout 30 python3 reports/attn_kv128_hopper/check_kv128.py --smoke > $OUT/smoke.log 2>&1
rc=$?
tail -3 $OUT/smoke.log
[ $rc -ne 0 ] && { echo "smoke failed rc=$rc at ${SECONDS}s"; exit 1; }
BATCHINV_QUICK=1 timeout 45 python3 -m pytest -q -x -p no:cacheprovider \
  tests/gpu/test_attention_hopper_cuda.py 2>&1 | tail -15 > $OUT/tests_hopper.log
echo "hopper tests done at ${SECONDS}s" | tee -a $OUT/tests_hopper.log
tail -3 $OUT/tests_hopper.log
timeout 60 python3 $R/time_pp128.py $OUT/timing.json > $OUT/timing.log 2>&1
echo "timing done at ${SECONDS}s rc=$?" | tee -a $OUT/timing.log
cat $OUT/timing.log
left=$((140 - SECONDS))
[ $left -gt 25 ] && (cd benchmarks && timeout $left python3 bench_attention.py --phase prefill \
  --json $OUT/bench.json 2>&1 | tail -8 > $OUT/bench.log)
cat $OUT/bench.log 2>/dev/null
echo "all done at ${SECONDS}s"
