#!/usr/bin/env bash
# One check of kiln on a lent GPU machine (an H200), in under 8 minutes:
#   benchmarks/gpu_check.sh             install offline, then correctness, timing, roofline -> $OUT/gpu.md
#   benchmarks/gpu_check.sh --dry-run   the same on the CPU (emulated cuda backend, tiny models); no installs
# The machine has torch (CUDA), triton and transformers but no network: islpy (and nvcc, when
# the machine has no CUDA toolkit) come from a wheels/ folder at the checkout's root when there
# is one, and kiln is installed without dependencies.  The cuda backend needs nvcc; the kernel
# generators' isl proofs need islpy (without it they fall back, and the report says so).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=(--dry-run)
else
  if [[ -d wheels ]]; then
    python -m pip install --quiet --no-index --find-links wheels/ islpy || echo "gpu_check: islpy not installed from wheels/"
  fi
  python -c "import islpy" 2>/dev/null || echo "gpu_check: islpy missing; kiln builds without its isl proofs"
  if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]] && [[ -d wheels ]]; then
    python -m pip install --quiet --no-index --find-links wheels/ nvidia-cuda-nvcc \
      || echo "gpu_check: no nvcc: the cuda backend's rows will say so"
  fi
  python -m pip install --quiet --no-deps --no-build-isolation -e . \
    || { echo "gpu_check: pip install failed; running kiln from the checkout"; export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# 460 s for the checks, leaving the rest of the 8 minutes to installs and start-up
timeout --signal=INT --kill-after=20 460 python -m benchmarks.gpu_check ${DRY[@]+"${DRY[@]}"} --out "$OUT/gpu.md" --budget-s 430
status=$?
[[ -f "$OUT/gpu.md" ]] || echo "gpu_check: no report written (exit $status)"
exit $status
