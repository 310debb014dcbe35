#!/bin/bash
# Second device call of kv-append: tests, then new vs old (b6cc67a) host time and e2e, then bench_attention decode.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 BATCHINV_QUICK=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.log
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r py benchmarks tools /tmp/old/ && cp -r old_overlay/py old_overlay/benchmarks /tmp/old/
PYTHONPATH=$PWD/py timeout 45 python3 -m pytest -q -rs --durations=5 -p no:cacheprovider \
  tests/gpu/test_kv_cache_cuda.py tests/gpu/test_attention_cuda.py tests/gpu/test_kernel_coverage_cuda.py \
  tests/gpu/test_attention_hopper_cuda.py tests/models/test_qwen3_model_cuda.py tests/gpu/test_attention_autograd_cuda.py \
  -k "cache or decode or prefix or chunk or sync or overflow or qwen3 or model" 2>&1 | tail -40 > $OUT/tests.log
tail -3 $OUT/tests.log
PYTHONPATH=$PWD/py timeout 18 python3 tools/kv_decode_host.py --profile > $OUT/host_after.log 2>&1
PYTHONPATH=/tmp/old/py timeout 18 python3 /tmp/old/tools/kv_decode_host.py > $OUT/host_before_same_call.log 2>&1
head -6 $OUT/host_after.log; head -6 $OUT/host_before_same_call.log
PYTHONPATH=$PWD/py timeout 22 python3 benchmarks/bench_qwen3_e2e.py --json $OUT/e2e_after.json > $OUT/e2e_after.log 2>&1
PYTHONPATH=/tmp/old/py timeout 22 python3 /tmp/old/benchmarks/bench_qwen3_e2e.py > $OUT/e2e_before_same_call.log 2>&1
grep -A5 "^phase" $OUT/e2e_after.log; grep -A5 "^phase" $OUT/e2e_before_same_call.log
PYTHONPATH=$PWD/py timeout 25 python3 benchmarks/bench_attention.py --phase decode --json $OUT/attn_decode.json > $OUT/attn_decode.log 2>&1
tail -12 $OUT/attn_decode.log
