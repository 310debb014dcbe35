#!/bin/bash
# Device call 2 (issue 6, session 11, helper norm-fwd11): the forward GPU tests of the final
# build, the op against main's kernels (ab_call2.py), bench_rms_norm.py.  Run from the staged
# tree's root with carry [".carry/norm-fwd11", ".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/liger_kernel-*.whl
export PYTHONPATH=$PWD/py:/tmp/carried-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
timeout 75 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py -q -x \
    -k "forward or fused_add_rows or fused_add_is or special or misaligned or every_output or fewer_chunks or nan_rows or zero_rows or qk or rms_norm_fused_and" \
    2>&1 | tail -n 8 | tee "$OUT/tests.log"
timeout 55 python3 reports/norm_fwd11/ab_call2.py "$OUT" 4 2>&1 | tail -n 60
timeout 90 python3 benchmarks/bench_rms_norm.py --json "$OUT/bench_rms_norm.json" 2>&1 | tail -n 60 | tee "$OUT/bench.log"
