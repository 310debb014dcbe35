#!/bin/bash
# ruff: noqa
# The one device call of session 11's second round (issue 6): the level-1 variants against this
# branch's kernels before the round and main's (bits, interleaved rounds; ab_call3.py), the GPU
# tests and bench_rms_norm.py on the staged build (the hint+cnt+res variant).  Run from the
# staged root.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/carried-site
for f in reports/norm_wgrad/*.cubin.gz; do gunzip -kf "$f"; done
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
timeout 85 python3 reports/norm_wgrad/ab_call3.py "$OUT" 3 2>&1 | tail -n 80
timeout 80 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py \
    -k rms -q -x 2>&1 | tail -n 8 | tee "$OUT/tests.log"
timeout 60 python3 benchmarks/bench_rms_norm.py --json "$OUT/bench_rms_norm.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -n 30
