#!/bin/bash
# ruff: noqa
# The one device call of session 11's third round (issue 6): a first level of at most 256
# partial rows (two-group entries with the rows per group as an argument) against round 2's
# kernels (bits, interleaved rounds; ab_call4.py), the GPU tests and bench_rms_norm.py on the
# staged build.  Run from the staged root.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/carried-site
for f in reports/norm_wgrad/*.cubin.gz; do gunzip -kf "$f"; done
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
timeout 95 python3 reports/norm_wgrad/ab_call4.py "$OUT" 3 2>&1 | tail -n 120
timeout 75 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py \
    -k rms -q -x 2>&1 | tail -n 8 | tee "$OUT/tests.log"
timeout 45 python3 benchmarks/bench_rms_norm.py --json "$OUT/bench_rms_norm.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -n 30
