#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels that the GPU machine's image lacks for
# `benchmarks/gpu_check.sh`: its python3 is CPython 3.12 with torch, triton, pytest,
# hypothesis, numpy, prometheus-client and wrapt, but not pydantic, pydantic-settings or
# structlog. Run here (where PyPI is reachable), then carry `.whl` to the GPU machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf "$root/.whl"
mkdir -p "$root/.whl"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$root/.whl" \
  "pydantic==2.14.4" "pydantic-core==2.50.5" "pydantic-settings==2.16.3" \
  "annotated-types>=0.6" "typing-inspection>=0.4" "python-dotenv>=0.21" "structlog>=24.1"
ls -1 "$root/.whl"
