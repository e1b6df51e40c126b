#!/usr/bin/env bash
# The whole GPU check in one command (about 3-5 minutes on an H200; at most 7 min 20 s, the
# sum of its steps' time limits, so that a 15-minute device budget leaves room for a rerun):
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# 1. every test marked `cuda` (the Triton kernel against the reference on CUDA, one launch
#    and no host sync per call, CUDA-graph replays, buffers under capture, the pinned mirror,
#    async assert, torch.compile with mode="reduce-overhead"), then the compiled-step tests;
# 2. `guardrails bench --device cuda` (the table, the JSON and the copy bandwidth).
#
# Python: the checkout's .venv if there is one, else `python3` (a bare GPU image). Wheels in
# .whl/ (made here by benchmarks/gpu_wheels.sh for an image without pydantic or structlog)
# are installed into a scratch directory first, where that Python lacks them. Writes into
# OUT_DIR: gpu-env.log, gpu-tests.log, gpu-compile.log, gpu-bench.log and the benchmark's
# cuda-<gpu>-<time>.json.
# Exit status: non-zero if any step failed (every step always runs).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$root"

py="$root/.venv/bin/python"
[ -x "$py" ] || py="$(command -v python3)"
if ! "$py" -c 'import pydantic, pydantic_settings, structlog' 2>/dev/null \
  && compgen -G "$root/.whl/*.whl" >/dev/null; then
  site_dir="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site_dir" "$root"/.whl/*.whl || exit 1
  export PYTHONPATH="$site_dir${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi || true
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable); print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  "$py" -c 'import triton; print("triton", triton.__version__)' || echo "triton: not importable"
  "$py" -c 'import guardrails, pydantic, structlog; print("guardrails", guardrails.__version__, guardrails.__file__); print("pydantic", pydantic.VERSION, "structlog", structlog.__version__)'
} >"$out/gpu-env.log" 2>&1

status=0
timeout 200 "$py" -m pytest tests -m cuda -p no:cacheprovider -q -rA --durations=15 \
  2>&1 | tee "$out/gpu-tests.log" || status=1

timeout 90 "$py" -m pytest tests/contract/test_compiled.py -p no:cacheprovider -q -rA \
  2>&1 | tee "$out/gpu-compile.log" || status=1

timeout 150 "$py" -m guardrails bench --device cuda --out "$out" \
  2>&1 | tee "$out/gpu-bench.log" || status=1

echo "gpu_check: results in $out (status $status)"
exit "$status"
