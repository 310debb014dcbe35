# lead's merged run, part 1 (tenth session): whole-suite parity + audit + sanitizer over the coverage file
start=$(date +%s)
export BATCHINV_GIT_COMMIT=$(cat .carry/lead/commit) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
mkdir -p reports/cuda_parity reports/audit
PYTHONPATH=$PWD/py timeout -s INT 400 python3 -m pytest tests -p no:cacheprovider --parity-report "reports/cuda_parity/{gpu}.json" > $OUT/parity.log 2>&1
echo "parity rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))")
PYTHONPATH=$PWD/py timeout 50 python3 -m batchinv audit --device cuda --json "reports/audit/$gpu.json" > $OUT/audit.log 2>&1
echo "audit rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
for tool in memcheck racecheck; do
  left=$(( 585 - ($(date +%s) - start) )); [ $left -gt 80 ] && left=80
  [ $left -lt 20 ] && { echo "skipped sanitize $tool (time)" >> $OUT/session.log; continue; }
  extra=""; [ $tool = racecheck ] && extra="--kernel-name regex=^(embedding|linear|rms_norm|rope|silu_mul|log_softmax|attn|attention_bwd|token_logprobs)_"
  PYTHONPATH=$PWD/py BATCHINV_QUICK=1 timeout -s INT $left compute-sanitizer --tool $tool $extra --error-exitcode 1 --target-processes all python3 -m pytest tests/gpu/test_kernel_coverage_cuda.py -q -x -p no:cacheprovider -m "not provokes_driver_error" > $OUT/sanitize_$tool.log 2>&1
  echo "sanitize $tool rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
done
tar -cf $OUT/results.tar reports/cuda_parity/*.json reports/audit/*.json
tail -3 $OUT/parity.log; cat $OUT/session.log
