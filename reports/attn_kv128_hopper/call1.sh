#!/bin/bash
# attn-kv128-hopper device call 1 (<= 300 s): correctness of the 128-key Hopper kernel against
# the fp32 reference and its own bits (check_kv128.py), the interleaved timing against main's
# 64-key kernel and SDPA (time_kv128.py), bench_attention.py --phase prefill, the Hopper test
# file's tests that do not compare with the mma.sync kernels, and one Nsight Compute launch each.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
R=reports/attn_kv128_hopper
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
timeout 110 python3 $R/check_kv128.py 2>&1 | tail -40 > $OUT/check.log
echo "check done at ${SECONDS}s" | tee -a $OUT/check.log
timeout 70 python3 $R/time_kv128.py $OUT/timing.json 2>&1 | tee $OUT/timing.log
echo "timing done at ${SECONDS}s" | tee -a $OUT/timing.log
(cd benchmarks && timeout 40 python3 bench_attention.py --phase prefill --json $OUT/bench.json \
  2>&1 | tail -14 > $OUT/bench.log)
timeout 25 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_hopper_cuda.py \
  -k "tolerance or fully_masked or finalize or clear_error or shared_memory or rejects or tma" \
  2>&1 | tail -5 > $OUT/tests.log
echo "tests done at ${SECONDS}s" | tee -a $OUT/tests.log
left=$((285 - SECONDS))
S="--section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats"
for which in new old; do
  left=$((285 - SECONDS))
  [ $left -gt 15 ] && timeout $((left / 2)) ncu --clock-control none -k regex:attn_hopper \
    --launch-skip 1 --launch-count 1 $S python3 $R/prof_one.py $which > $OUT/ncu_$which.txt 2>&1
done
echo "all done at ${SECONDS}s" | tee -a $OUT/tests.log
cat $OUT/check.log | tail -25; cat $OUT/bench.log $OUT/tests.log | tail -22
