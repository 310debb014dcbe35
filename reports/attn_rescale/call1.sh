#!/bin/bash
# attn-rescale's device call 1 (<= 230 s): the Hopper GPU test file with the rescale skip as the
# default (bitwise against the mma.sync kernels), the interleaved timing against main's kernel
# (temporary module) and SDPA, then bench_attention.py --phase prefill (the new round method).
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
R=reports/attn_rescale
nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader | tee $OUT/card.txt
BATCHINV_QUICK=1 timeout 70 python3 -m pytest -q -x -p no:cacheprovider \
  tests/gpu/test_attention_hopper_cuda.py 2>&1 | tail -15 > $OUT/tests_hopper.log
echo "hopper tests done at ${SECONDS}s" | tee -a $OUT/tests_hopper.log
tail -3 $OUT/tests_hopper.log
timeout 100 python3 $R/time_rescale.py $OUT/timing.json > $OUT/timing.log 2>&1
echo "timing done at ${SECONDS}s rc=$?" | tee -a $OUT/timing.log
cat $OUT/timing.log
left=$((225 - SECONDS))
[ $left -gt 20 ] && (cd benchmarks && timeout $left python3 bench_attention.py --phase prefill \
  --json $OUT/bench.json > $OUT/bench.log 2>&1)
cat $OUT/bench.log 2>/dev/null
echo "all done at ${SECONDS}s"
