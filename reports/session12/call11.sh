export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/py
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
timeout 250 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py -k "rms" -q -p no:cacheprovider > $OUT/tests.log 2>&1; echo "tests rc=$?" >> $OUT/tests.log
timeout 60 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -p no:cacheprovider -k "threads or overlapped or abandoned or flags_left or counts_left" -v > $OUT/tests_handoff.log 2>&1
cat $OUT/card.txt; tail -3 $OUT/tests.log; grep -E "PASS|FAIL|ERROR" $OUT/tests_handoff.log | head -20
