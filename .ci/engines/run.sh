#!/usr/bin/env bash
# `make engines`: build each real-engine venv and run its suite against the engine's own code.
# Each suite records what it observed (unguarded -> guarded) under .engines/results/; the
# table of all of them is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
# venv name -> suite directory under tests/engines/. vLLM's Model Runner V2 half runs in a
# process of its own: it sets TRITON_INTERPRET and imports vLLM's CPU shim before vLLM loads
# (tests/engines/vllm/conftest.py says why the two halves never share one).
suites=(
    "sglang-0.5.23 sglang"
    "sglang-0.5.13.post1 sglang"
    "vllm-0.33.0 vllm"
    "vllm-0.33.0 vllm/v2"
    # 0.34.0 has Model Runner V2 only: its V1 half (tests/engines/vllm) has nothing to drive.
    "vllm-0.34.0 vllm/v2"
)
rm -rf .engines/results
mkdir -p .engines/results
status=0
for entry in "${suites[@]}"; do
    read -r name suite <<<"$entry"
    bash .ci/engines/build.sh "$name"
    echo "==> [$name] pytest tests/engines/$suite"
    ENGINE_SUITE="$name" ENGINE_RESULTS=".engines/results/$name.jsonl" \
        ".engines/$name/bin/python" -m pytest -p no:cacheprovider "tests/engines/$suite" \
        || status=$?
done
.venv/bin/python -m tests.engines.summary .engines/results
exit "$status"
