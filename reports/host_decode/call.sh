#!/bin/bash
# host-decode device call: GPU tests of the touched files, then old/new decode-step rounds, then
# the e2e bench (new tree) if time is left.
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 BATCHINV_QUICK=1
cp py/batchinv/_native.abi3.so old/py/batchinv/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/card.txt
PYTHONPATH=$PWD/py timeout 70 python3 -m pytest -q -p no:cacheprovider --durations=8 \
  tests/gpu/test_qwen3_host_path_cuda.py tests/gpu/test_kv_cache_cuda.py \
  tests/gpu/test_linear_cuda.py tests/gpu/test_embedding_cuda.py tests/gpu/test_rope_cuda.py \
  tests/gpu/test_launcher_cuda.py tests/gpu/test_linear_cublaslt_cuda.py \
  tests/models/test_qwen3_model_cuda.py tests/gpu/test_attention_autograd_cuda.py \
  tests/gpu/test_token_logprobs_cuda.py tests/gpu/test_kernel_coverage_cuda.py \
  tests/gpu/test_attention_cuda.py 2>&1 | tail -40 > $OUT/tests.log
echo "tests done at ${SECONDS}s" | tee -a $OUT/tests.log
for r in 1 2; do for t in old new; do
  if [ $t = old ]; then P=$PWD/old/py; else P=$PWD/py; fi
  extra="--rounds 3"; [ $r = 1 ] && extra="--rounds 3 --profile --stack --save $OUT/$t.pt"
  PYTHONPATH=$P timeout 25 python3 tools/decode_step_host.py --tag $t $extra 2>&1 \
    | grep -v -i warn >> $OUT/steps.log
  echo "$t round $r done at ${SECONDS}s" >> $OUT/steps.log
done; done
PYTHONPATH=$PWD/py python3 -c "
import torch
from batchinv.contract import assert_bitwise_equal
assert_bitwise_equal(torch.load('$OUT/new.pt'), torch.load('$OUT/old.pt'))
print('batchinv decode hidden states: old == new bitwise')" 2>&1 | tail -3 >> $OUT/steps.log
left=$((168 - SECONDS))
if [ $left -gt 25 ]; then
  cd benchmarks && PYTHONPATH=$PWD/../py timeout $left python3 bench_qwen3_e2e.py \
    --json $OUT/e2e.json 2>&1 | tail -12 > $OUT/e2e.log
fi
echo "all done at ${SECONDS}s" >> $OUT/steps.log
grep -E "passed|failed|error" $OUT/tests.log | tail -3; grep -E "round|syncs|decode row|bitwise|done" $OUT/steps.log; cat $OUT/e2e.log 2>/dev/null
