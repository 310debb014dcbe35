# session 12, flags variant: A/B (flags / flags zeroed per call / waiting form), timeline, rms tests.
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/py
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
python3 -c "import batchinv" || exit 1
timeout 200 python3 .carry/lead/overlap_ab.py 11 > $OUT/ab.log 2>&1
echo "ab rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
timeout 60 python3 .carry/lead/profile_op.py 2>&1 | grep -v -i warn > $OUT/profile.log
timeout 200 python3 -m pytest tests/gpu/test_rms_norm_cuda.py tests/gpu/test_kernel_coverage_cuda.py -k "rms" -q -x -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
cat $OUT/ab.log; grep "overlap=True" $OUT/profile.log | head -12; tail -3 $OUT/tests.log; cat $OUT/session.log
