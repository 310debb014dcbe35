start=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
mkdir -p /tmp/B && tar -xJf .carry/split2048.tar.xz -C /tmp/B
for b in A B A B; do
  if [ $b = A ]; then pp=$PWD/py; else pp=/tmp/B/py; fi
  left=$(( 170 - ($(date +%s) - start) )); [ $left -lt 20 ] && break
  PYTHONPATH=$pp timeout $left python3 .carry/lead/split_probe.py $b 2>&1 | grep -v Warn
done
echo "done at $(( $(date +%s) - start )) s"
