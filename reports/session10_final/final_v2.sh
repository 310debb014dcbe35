# lead's merged run, part 2 (tenth session): the benchmarks of what changed
start=$(date +%s)
export BATCHINV_GIT_COMMIT=$(cat .carry/lead/commit) PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site .carry/lead/whl/*.whl
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
export PYTHONPATH=$PWD/py:/tmp/carried-site
for b in ${BENCHES:-attention attention_backward rms_norm qwen3_e2e}; do
  left=$(( 585 - ($(date +%s) - start) ))
  [ $left -lt 30 ] && { echo "skipped bench_$b (time)" >> $OUT/session.log; continue; }
  timeout $(( left < 150 ? left : 150 )) python3 benchmarks/bench_$b.py --json benchmarks/results/$b.json > $OUT/bench_$b.log 2>&1
  echo "bench_$b rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
done
tar -cf $OUT/results.tar benchmarks/results/*.json
cat $OUT/session.log
