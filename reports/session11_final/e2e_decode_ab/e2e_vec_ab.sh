# Is the e2e decode slower with the *_vec forward entries, or is it the process/card? Alternate
# separate processes: VECTOR_ENTRIES as built ("vec") and emptied ("novec": main's kernels).
export PYTHONPATH=$PWD/py PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/card.txt
cat > /tmp/e2e.py <<'PY'
import runpy, sys
sys.path.insert(0, "benchmarks")
import batchinv.gpu.rms_norm as r
if sys.argv[1] == "novec":
    r.VECTOR_ENTRIES = frozenset()
sys.argv = ["bench_qwen3_e2e.py", "--json", f"/tmp/{sys.argv[2]}.json"]
runpy.run_path("benchmarks/bench_qwen3_e2e.py", run_name="__main__")
PY
for i in 1 2 3; do for v in vec novec; do
  echo "== $v round $i" >> $OUT/e2e_ab.log
  timeout 60 python3 /tmp/e2e.py $v ${v}_$i 2>&1 | grep -E "^(prefill|decode) " >> $OUT/e2e_ab.log
done; done
cat $OUT/e2e_ab.log
