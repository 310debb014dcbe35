# session 12, call 1: build check, overlapped last levels A/B, GPU tests of rms_norm, bench.
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm --format=csv,noheader > $OUT/card.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site .carry/lead/whl/*.whl
export PYTHONPATH=$PWD/py
python3 -c "import batchinv, torch; from batchinv.gpu import rms_norm as g; print(g._programmatic(torch.device('cuda')))" > $OUT/check.log 2>&1 || { cat $OUT/check.log; exit 1; }
timeout 200 python3 .carry/lead/overlap_ab.py > $OUT/ab.log 2>&1
echo "ab rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
timeout 200 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py -k "rms" -q -x -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
export PYTHONPATH=$PWD/py:/tmp/carried-site
left=$(( 560 - ($(date +%s) - start) ))
[ $left -gt 40 ] && timeout $left python3 benchmarks/bench_rms_norm.py --json $OUT/rms_norm.json > $OUT/bench.log 2>&1
echo "bench rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
cat $OUT/ab.log; tail -3 $OUT/tests.log; grep -i "backward kernel" $OUT/bench.log | head; cat $OUT/session.log
