# split-size experiment: main (A, 1024-key splits) vs .carry/split2048 (B, 2048-key splits)
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
root=$PWD
mkdir -p /tmp/B && tar -xJf .carry/split2048.tar.xz -C /tmp/B
(PYTHONPATH=/tmp/B/py BATCHINV_QUICK=1 timeout 120 python3 -m pytest tests/gpu/test_attention_cuda.py tests/gpu/test_attention_hopper_cuda.py -q -x -p no:cacheprovider > $OUT/tests_B.log 2>&1; echo "tests B rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log)
tail -2 $OUT/tests_B.log
for i in 1 2; do
  for b in A B; do
    left=$(( 230 - ($(date +%s) - start) )); [ $left -lt 25 ] && break 2
    if [ $b = A ]; then pp=$root/py; else pp=/tmp/B/py; fi
    PYTHONPATH=$pp timeout $left python3 .carry/lead/split_ab.py $b $OUT/ab_${b}_$i.json > $OUT/ab_${b}_$i.log 2>&1
    echo "ab $b $i rc=$? at $(( $(date +%s) - start )) s" >> $OUT/session.log
    cat $OUT/ab_${b}_$i.log
  done
done
cat $OUT/session.log
