export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/py:$PWD/.carry/lead
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
for i in 1 2 3; do
  timeout 60 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -p no:cacheprovider -p nolock_conftest -k "threads_on_one_stream" > $OUT/nolock_$i.log 2>&1; echo "run $i rc=$?" >> $OUT/summary.log
done
timeout 60 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -p no:cacheprovider -k "threads_on_one_stream" > $OUT/withlock.log 2>&1; echo "with lock rc=$?" >> $OUT/summary.log
cat $OUT/card.txt $OUT/summary.log; for i in 1 2 3; do grep -E "passed|failed|Error|assert" $OUT/nolock_$i.log | head -3; done; tail -1 $OUT/withlock.log
