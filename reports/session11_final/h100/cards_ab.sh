# Same-card A/B of the RMSNorm kernels: session-10 main (48a63d8, old48/) against this tree,
# alternating processes, three rounds each.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
mkdir -p /tmp/old && cp -r .carry/lead/old48/py /tmp/old/ && xz -dc .carry/lead/old48/_native.abi3.so.xz > /tmp/old/py/batchinv/_native.abi3.so
for i in 1 2 3; do
  PYTHONPATH=/tmp/old/py python3 .carry/lead/rms_ab_cards.py old >> $OUT/ab.log 2>&1
  PYTHONPATH=$PWD/py python3 .carry/lead/rms_ab_cards.py new >> $OUT/ab.log 2>&1
done
cat $OUT/ab.log
