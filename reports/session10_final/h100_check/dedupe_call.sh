# bwd-dedupe GPU check (+ attention prefill bench on this card)
start=$(date +%s)
cd .carry/bwd-dedupe && export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee $OUT/card.txt
timeout -s INT 260 python3 -m pytest tests/gpu/test_attention_backward_cuda.py -q -p no:cacheprovider -rs > $OUT/tests_backward.log 2>&1
echo "backward tests rc=$? at $(( $(date +%s) - start )) s" | tee -a $OUT/session.log
tail -3 $OUT/tests_backward.log
timeout 120 python3 benchmarks/bench_attention_backward.py --json $OUT/attention_backward.json > $OUT/bench_attention_backward.log 2>&1
echo "bench backward rc=$? at $(( $(date +%s) - start )) s" | tee -a $OUT/session.log
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python3 benchmarks/bench_attention.py --phase prefill --json $OUT/attention_prefill.json > $OUT/bench_attention_prefill.log 2>&1
echo "bench prefill rc=$? at $(( $(date +%s) - start )) s" | tee -a $OUT/session.log
grep -A8 "^summary" $OUT/bench_attention_backward.log $OUT/bench_attention_prefill.log
