#!/bin/bash
# attn-kv128-hopper device call 2 (<= 300 s): call 1 hung (setmaxnreg 32 / 240 asked for more
# registers than the CTA's pool).  A smoke test first (stops the call if it fails), then the
# interleaved timing against main's 64-key kernel, the Q-by-descriptor variant and SDPA
# (time_kv128.py), the correctness checks (check_kv128.py), bench_attention.py --phase prefill,
# the Hopper test file's tests that do not compare with the mma.sync kernels, Nsight Compute.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
R=reports/attn_kv128_hopper
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
timeout 45 python3 $R/check_kv128.py --smoke > $OUT/smoke.log 2>&1
rc=$?
tail -20 $OUT/smoke.log
[ $rc -ne 0 ] && { echo "smoke failed rc=$rc at ${SECONDS}s"; exit 1; }
timeout 75 python3 $R/time_kv128.py $OUT/timing.json 2>&1 | tee $OUT/timing.log
echo "timing done at ${SECONDS}s" | tee -a $OUT/timing.log
timeout 100 python3 $R/check_kv128.py 2>&1 | tail -40 > $OUT/check.log
echo "check done at ${SECONDS}s" | tee -a $OUT/check.log
tail -25 $OUT/check.log
left=$((250 - SECONDS))
[ $left -gt 10 ] && (cd benchmarks && timeout 35 python3 bench_attention.py --phase prefill \
  --json $OUT/bench.json 2>&1 | tail -14 > $OUT/bench.log)
cat $OUT/bench.log
left=$((270 - SECONDS))
[ $left -gt 10 ] && timeout $left python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_attention_hopper_cuda.py \
  -k "tolerance or fully_masked or finalize or clear_error or shared_memory or rejects or tma" \
  2>&1 | tail -5 > $OUT/tests.log
echo "tests done at ${SECONDS}s" | tee -a $OUT/tests.log
S="--section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats"
for which in new old; do
  left=$((292 - SECONDS))
  [ $left -gt 12 ] && timeout $((left < 25 ? left : 25)) ncu --clock-control none \
    -k regex:attn_hopper --launch-skip 1 --launch-count 1 $S python3 $R/prof_one.py $which \
    > $OUT/ncu_$which.txt 2>&1
done
echo "all done at ${SECONDS}s" | tee -a $OUT/tests.log
cat $OUT/tests.log
