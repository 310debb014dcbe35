# lead's merged run (eleventh session): whole-suite parity + audit + sanitizer over the coverage
# file, then the benchmarks named in BENCHES (default rms_norm), in one device call.
start=$(date +%s)
export BATCHINV_GIT_COMMIT=$(cat .carry/lead/commit) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site .carry/lead/whl/*.whl
mkdir -p reports/cuda_parity reports/audit
PYTHONPATH=$PWD/py timeout -s INT 400 python3 -m pytest tests -p no:cacheprovider --parity-report "reports/cuda_parity/{gpu}.json" > $OUT/parity.log 2>&1
echo "parity rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))")
PYTHONPATH=$PWD/py timeout 50 python3 -m batchinv audit --device cuda --json "reports/audit/$gpu.json" > $OUT/audit.log 2>&1
echo "audit rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
for tool in memcheck racecheck; do
  left=$(( 500 - ($(date +%s) - start) )); [ $left -gt 80 ] && left=80
  [ $left -lt 20 ] && { echo "skipped sanitize $tool (time)" >> $OUT/session.log; continue; }
  extra=""; [ $tool = racecheck ] && extra="--kernel-name regex=^(embedding|linear|rms_norm|rope|silu_mul|log_softmax|attn|attention_bwd|token_logprobs)_"
  PYTHONPATH=$PWD/py BATCHINV_QUICK=1 timeout -s INT $left compute-sanitizer --tool $tool $extra --error-exitcode 1 --target-processes all python3 -m pytest tests/gpu/test_kernel_coverage_cuda.py -q -x -p no:cacheprovider -m "not provokes_driver_error" > $OUT/sanitize_$tool.log 2>&1
  echo "sanitize $tool rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
done
export PYTHONPATH=$PWD/py:/tmp/carried-site
for b in ${BENCHES:-rms_norm}; do
  left=$(( 585 - ($(date +%s) - start) ))
  [ $left -lt 30 ] && { echo "skipped bench_$b (time)" >> $OUT/session.log; continue; }
  timeout $(( left < 150 ? left : 150 )) python3 benchmarks/bench_$b.py --json benchmarks/results/$b.json > $OUT/bench_$b.log 2>&1
  echo "bench_$b rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
done
tar -cf $OUT/results.tar reports/cuda_parity/*.json reports/audit/*.json benchmarks/results/*.json
tail -3 $OUT/parity.log; cat $OUT/session.log
