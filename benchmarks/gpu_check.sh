#!/usr/bin/env bash
# The whole GPU check in one command: CUDA tests, then the full benchmark (under 5 minutes).
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default: benchmarks/results
#
# Writes into OUT_DIR: gpu-env.log (nvidia-smi, versions), gpu-tests.log (pytest -m cuda),
# gpu-bench.log (the printed table) and the benchmark's cuda-<gpu>-<time>.json.
# Uses `python3` from PATH with whatever PYTHONPATH the caller set. Exit status: non-zero if
# the tests or the benchmark failed (both always run).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/benchmarks/results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$root"

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi || true
  python3 -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  python3 -c 'import triton; print("triton", triton.__version__)' || echo "triton: not importable"
} >"$out/gpu-env.log" 2>&1

status=0
timeout 240 python3 -m pytest tests/test_cuda.py tests/test_reporting_cuda.py -m cuda -p no:cacheprovider -q -rA \
  2>&1 | tee "$out/gpu-tests.log" || status=1

timeout 200 python3 -m guardrails bench --device cuda --out "$out" \
  2>&1 | tee "$out/gpu-bench.log" || status=1

echo "gpu_check: results in $out (status $status)"
exit "$status"
