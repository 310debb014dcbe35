#!/bin/bash
# Device call 1 (issue 6, session 11, helper norm-fwd11): bits + A/B of the forward variants
# (ab_call1.py), then the forward GPU tests of the staged build.  Run from the staged tree's root
# with carry [".carry/norm-fwd11", ".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/liger_kernel-*.whl
export PYTHONPATH=$PWD/py:/tmp/carried-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,clocks.max.sm --format=csv,noheader
timeout 150 python3 reports/norm_fwd11/ab_call1.py "$OUT" 5 2>&1 | tail -n 160
BATCHINV_QUICK=1 timeout 70 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -x \
    -k "forward or fused_add_rows or fused_add_is or special or misaligned or every_output or fewer_chunks or nan_rows" \
    2>&1 | tail -n 8 | tee "$OUT/tests.log"
