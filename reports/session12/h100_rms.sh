# H100 check of the merged RMSNorm kernels: GPU tests of the op and its benchmark.
export BATCHINV_GIT_COMMIT=$(cat .carry/lead/commit) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site .carry/lead/whl/*.whl
PYTHONPATH=$PWD/py timeout 200 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $OUT/session.log
PYTHONPATH=$PWD/py:/tmp/carried-site timeout 150 python3 benchmarks/bench_rms_norm.py --json $OUT/rms_norm_h100.json > $OUT/bench_rms_norm.log 2>&1
echo "bench rc=$?" >> $OUT/session.log
tail -2 $OUT/tests.log; cat $OUT/session.log; grep -E "summary|backward kernel|forward " $OUT/bench_rms_norm.log | tail -20
