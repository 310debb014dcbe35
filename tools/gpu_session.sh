#!/usr/bin/env bash
# One GPU-machine session: build check, cuda_parity, sanitize, benchmarks.
#
# Run from the repository root on a machine with an NVIDIA GPU and PyTorch, after
# placing the built extension at py/batchinv/_native.abi3.so (from `nox -s build`:
# unzip -j dist/batchinv-*.whl 'batchinv/_native*.so' -d py/batchinv).  Offline GPU
# machines get nox from wheels in .whl/ if it is not installed.
#   tools/gpu_session.sh [parity|sanitize|bench|audit]...   (default: all four)
# PARITY_TARGETS limits cuda_parity, SANITIZE_TARGETS the sanitizer, to some test paths.
# Results go to reports/ and benchmarks/results/, and also to $OUT when that is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/py${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Reports name the commit: from git here, or from the caller on a machine without .git.
BATCHINV_GIT_COMMIT="${BATCHINV_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
export BATCHINV_GIT_COMMIT
if [ -d .whl ]; then  # nox, Liger-Kernel, ... carried as wheels to an offline machine
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried-site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/carried-site"
fi
OUT="${OUT:-}"
log() { if [ -n "$OUT" ]; then tee -a "$OUT/$1.log"; else cat; fi; }

echo "== build check" | log session
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | log session
python3 - <<'PY' 2>&1 | log session || exit 1
import torch, batchinv, batchinv._native as n
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
print("build", n.build_info())
print("driver", n.driver_status("cuda"), "devices", n.device_count())
PY

status=0
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(parity sanitize bench audit)
for step in "${steps[@]}"; do
  echo "== $step" | log session
  case "$step" in
    parity) python3 -m nox -s cuda_parity -- ${PARITY_TARGETS:-} 2>&1 | log parity || status=1 ;;
    sanitize) python3 -m nox -s sanitize -- ${SANITIZE_TARGETS:-} 2>&1 | log sanitize || status=1 ;;
    bench) python3 -m nox -s bench 2>&1 | log bench || status=1 ;;
    audit)
      mkdir -p reports/audit
      gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))")
      python3 -m batchinv audit --device cuda --json "reports/audit/$gpu.json" 2>&1 | log audit || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
if [ -n "$OUT" ]; then
  # One archive: the device tool returns at most 8 files.
  tar -cf "$OUT/results.tar" reports/cuda_parity/*.json reports/audit/*.json benchmarks/results/*.json 2>/dev/null
fi
exit $status
