#!/bin/bash
# The attn-host device call (one call, <= 120 s): run from the staged tree
# (.carry/attn-host) with PYTHONPATH=$PWD/py; OLD = main's attention.py of the carried checkout.
set -u
OLD=$PWD/../../py/batchinv/gpu/attention.py
export BATCHINV_QUICK=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
cmp -s "$OLD" py/batchinv/gpu/attention.py && echo "OLD equals the new file?!" | tee -a "$OUT/card.txt"
timeout 25 python3 tools/attention_decode_host.py --old "$OLD" --rounds 4 --profile \
    --json "$OUT/host.json" > "$OUT/host.log" 2>&1
echo "host tool rc=$? at ${SECONDS}s" | tee -a "$OUT/card.txt"
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_attention_plan_cuda.py \
    tests/gpu/test_attention_cuda.py tests/gpu/test_attention_hopper_cuda.py \
    tests/gpu/test_kv_cache_cuda.py "tests/gpu/test_kernel_coverage_cuda.py" -k \
    "not test_kernel_coverage_cuda or attention" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at ${SECONDS}s" | tee -a "$OUT/card.txt"
timeout $((112 - SECONDS)) python3 benchmarks/bench_attention.py --phase decode \
    --json "$OUT/bench_new.json" > "$OUT/bench_new.log" 2>&1
echo "bench new rc=$? at ${SECONDS}s" | tee -a "$OUT/card.txt"
rm -rf /tmp/oldtree && cp -r py /tmp/oldtree && cp "$OLD" /tmp/oldtree/batchinv/gpu/attention.py
left=$((116 - SECONDS))
if [ "$left" -gt 5 ]; then
    PYTHONPATH=/tmp/oldtree timeout "$left" python3 benchmarks/bench_attention.py --phase decode \
        --json "$OUT/bench_old.json" > "$OUT/bench_old.log" 2>&1
    echo "bench old rc=$? at ${SECONDS}s" | tee -a "$OUT/card.txt"
fi
