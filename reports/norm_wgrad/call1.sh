#!/bin/bash
# ruff: noqa
# Device call 1 (issue 6, session 11): bits and paired rounds against main's kernels, then the
# quick GPU tests.  Run from the staged root.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
timeout 120 python3 reports/norm_wgrad/ab_call1.py "$OUT" 4 2>&1 | tail -n 80
BATCHINV_QUICK=1 timeout 90 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -x 2>&1 \
    | tail -n 15 | tee "$OUT/tests_quick.log"
