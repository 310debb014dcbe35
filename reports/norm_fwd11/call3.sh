#!/bin/bash
# Device call of the second round (issue 6, session 11, helper norm-fwd12): bits + A/B of the
# forward variants (ab_call3.py), the forward GPU tests of this build (not quick; the *_vec
# entries through the op), bench_rms_norm.py.  Run from the staged tree's root with carry
# [".carry/norm-fwd11", ".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/liger_kernel-*.whl
export PYTHONPATH=$PWD/py:/tmp/carried-site PYTHONUNBUFFERED=1
for c in main branch exp12; do gunzip -c reports/norm_fwd11/$c.cubin.gz > reports/norm_fwd11/$c.cubin; done
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 70 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py -q -x \
    -k "forward or fused_add_rows or fused_add_is or special or misaligned or every_output or fewer_chunks or nan_rows or zero_rows or qk or rms_norm_fused_and or vec" \
    2>&1 | tail -n 12 | tee "$OUT/tests.log"
timeout 80 python3 reports/norm_fwd11/ab_call3.py "$OUT" 3 2>&1 | tail -n 70
timeout 75 python3 benchmarks/bench_rms_norm.py --json "$OUT/bench_rms_norm.json" 2>&1 | tail -n 60 > "$OUT/bench.log"
grep -E "forward|copy" "$OUT/bench.log" | head -40
