#!/bin/bash
# ruff: noqa
# Device call 2 (issue 6, session 11): the kept build against main's kernels (bits, rounds), the
# last-levels grids alone, the GPU tests, bench_rms_norm.py (Liger-Kernel from the carried
# wheels).  Run from the staged root.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site \
    ../../.whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/carried-site
for f in reports/norm_wgrad/*.cubin.gz; do gunzip -kf "$f"; done
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
timeout 80 python3 reports/norm_wgrad/ab_call2.py "$OUT" 4 2>&1 | tail -n 75
timeout 70 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py \
    -k rms -q -x 2>&1 | tail -n 6 | tee "$OUT/tests.log"
timeout 80 python3 benchmarks/bench_rms_norm.py --json "$OUT/bench_rms_norm.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -n 45
