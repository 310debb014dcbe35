#!/usr/bin/env bash
# The README's two commands as a new user runs them: a fresh clone, nothing cached, timed.
#
#   tools/fresh_machine.sh [REPO [BRANCH]]   (default: this checkout and its current branch)
#
# Clones BRANCH of REPO into an empty directory and runs `pip install nox && nox -s demo`,
# then `pip install nox && nox -s tests`, with a new HOME (so empty pip, zig and Hugging Face
# caches), a new CARGO_HOME (crates are downloaded again; the rustup toolchain stays on PATH),
# no .nox directory, no local wheel directories, and nox itself installed into a new
# virtualenv.  Only committed work is cloned.  Prints each command's wall time and exits 1
# if either fails.  The directory (FRESH_DIR, default a new one under /tmp) is kept for
# inspection; it holds a few GB, delete it afterwards.
set -uo pipefail

repo=$(cd "${1:-$(dirname "$0")/..}" && pwd)
branch=${2:-$(git -C "$repo" rev-parse --abbrev-ref HEAD)}
work=${FRESH_DIR:-$(mktemp -d /tmp/batchinv-fresh.XXXXXX)}
if [ -n "$(ls -A "$work" 2>/dev/null)" ]; then
  echo "$work is not empty" >&2
  exit 2
fi
mkdir -p "$work/home"

# Resolve the interpreter and the Rust toolchain before HOME changes: pyenv shims and
# rustup proxies find their installations through HOME.
python=$(python3 -c 'import sys; print(sys.executable)')
if command -v rustup >/dev/null; then
  toolchain_bin=$(dirname "$(rustup which cargo)")
else
  toolchain_bin=$(dirname "$(command -v cargo)")
fi

git clone --quiet --branch "$branch" --single-branch "$repo" "$work/batchinv" || exit 1
commit=$(git -C "$work/batchinv" rev-parse --short HEAD)

export HOME="$work/home"
export CARGO_HOME="$work/home/.cargo"
export PATH="$work/nox-venv/bin:$toolchain_bin:$PATH"
unset PIP_FIND_LINKS PIP_CACHE_DIR PIP_NO_CACHE_DIR XDG_CACHE_HOME CARGO_TARGET_DIR \
  RUSTC_WRAPPER VIRTUAL_ENV PYTHONPATH BATCHINV_NVCC CUDA_HOME
"$python" -m venv "$work/nox-venv" || exit 1

cd "$work/batchinv" || exit 1
echo "fresh clone of $branch ($commit) in $work/batchinv; python $("$python" -V 2>&1)," \
  "$(cargo --version), $(nproc) CPU cores"
status=0
summary=()
for session in demo tests; do
  echo "=== pip install nox && nox -s $session"
  start=$(date +%s)
  if pip install -q nox && nox -s "$session"; then result=ok; else result=FAILED; status=1; fi
  seconds=$(($(date +%s) - start))
  summary+=("nox -s $session: $((seconds / 60)) min $((seconds % 60)) s, $result")
done
echo "=== summary ($branch at $commit, $work)"
printf '%s\n' "${summary[@]}"
exit $status
