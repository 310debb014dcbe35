export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/py
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
timeout 250 python3 .carry/lead/k5_at_4096.py > $OUT/k5.log 2>&1; echo "rc=$?" >> $OUT/k5.log
cat $OUT/card.txt $OUT/k5.log
