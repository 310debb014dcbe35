# split-size experiment 2: decode stages, main (A) vs 2048-key splits (B)
start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
mkdir -p /tmp/B && tar -xJf .carry/split2048.tar.xz -C /tmp/B
for b in A B A B; do
  if [ $b = A ]; then pp=$PWD/py; else pp=/tmp/B/py; fi
  left=$(( 200 - ($(date +%s) - start) )); [ $left -lt 20 ] && break
  PYTHONPATH=$pp timeout $left python3 .carry/lead/split_dec.py $b $OUT/dec_$b.json 2>&1 | tee -a $OUT/dec_$b.log
  echo "dec $b at $(( $(date +%s) - start )) s"
done
