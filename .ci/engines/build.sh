#!/usr/bin/env bash
# Build one real-engine venv: .engines/NAME, from .ci/engines/NAME.txt, or VENV from REQ.
#   bash .ci/engines/build.sh sglang-0.5.23
#   bash .ci/engines/build.sh vllm .ci/e2e/vllm.txt .e2e-vllm     (make e2e's servers)
# torch and numpy come pinned by .ci/constraints.txt (the CPU build on local disk: an open
# range would pull a multi-GB CUDA build); guardrails is installed editable with its own
# dependencies and the test tools; then every line of NAME.txt (the engine itself and the
# pure-Python packages its sampler/scheduler modules import) goes in with --no-deps, so the
# engine's own dependency pins never pull CUDA wheels. Skipped when the venv's stamp is newer
# than its inputs.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: build.sh NAME [REQ VENV] (default: .ci/engines/NAME.txt, .engines/NAME)}
req=${2:-.ci/engines/$name.txt}
venv=${3:-.engines/$name}
stamp=$venv/.installed-stamp
test -f "$req" || { echo "no $req" >&2; exit 2; }
if [ -f "$stamp" ] && [ "$stamp" -nt "$req" ] && [ "$stamp" -nt pyproject.toml ] \
    && [ "$stamp" -nt .ci/constraints.txt ] && [ "$stamp" -nt .ci/engines/build.sh ]; then
    echo "==> $venv is up to date"
    exit 0
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
echo "==> [$name] venv, torch (CPU), guardrails"
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
"${pip[@]}" install -c .ci/constraints.txt torch numpy
"${pip[@]}" install -c .ci/constraints.txt -e . "pytest>=8" "hypothesis>=6.100"
echo "==> [$name] engine and the pure-Python modules it imports (--no-deps)"
"${pip[@]}" install --no-deps -c .ci/constraints.txt -r "$req"
touch "$stamp"
