#!/bin/bash
# Device call 1 (issue 6, session 10): A/B + bits, per-kernel durations, Nsight Compute on main's
# fused t128k5 and t4 kernels, then the quick GPU tests.  Run from the staged tree's root.
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,clocks.max.sm --format=csv,noheader
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 85 python3 reports/norm_bwd/ab_call1.py ab "$OUT" 4 2>&1 | tail -n 80
timeout 20 "$NCU" --metrics gpu__time_duration.sum -k regex:'rms_norm' \
    python3 reports/norm_bwd/ab_call1.py ncu_seq "$OUT" > "$OUT/ncu_seq.txt" 2>&1
grep -E "rms_norm|gpu__time" "$OUT/ncu_seq.txt" | head -20
timeout 60 "$NCU" --set full --import-source no -c 2 -f -o "$OUT/full" \
    -k regex:'rms_norm_backward_weight_grad_bf16_(t4|t128k5)$' \
    python3 reports/norm_bwd/ab_call1.py ncu_full "$OUT" > "$OUT/ncu_full.log" 2>&1
tail -3 "$OUT/ncu_full.log"
if [ -f "$OUT/full.ncu-rep" ]; then
    "$NCU" -i "$OUT/full.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
    "$NCU" -i "$OUT/full.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
    "$NCU" -i "$OUT/full.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit" \
        "$OUT/ncu_details.txt" | head -30
fi
(cd "$OUT" && tar czf ncu.tgz ncu_*.txt ncu_*.csv full.ncu-rep 2>/dev/null && rm -f ncu_raw.csv ncu_sass.csv full.ncu-rep)
BATCHINV_QUICK=1 timeout 50 python3 -m pytest tests/gpu/test_rms_norm_cuda.py -q -x 2>&1 | tail -n 5
