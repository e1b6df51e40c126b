#!/usr/bin/env bash
# `make e2e`: a real `transformers serve` under `guardrails run`, in both modes, driven over
# 127.0.0.1 by the openai client (tests/e2e/). Builds its own venv, .e2e/, from
# .ci/e2e/requirements.txt (pinned; torch from .ci/constraints.txt, the CPU build), skipped
# when its stamp is newer than its inputs. The suite is bounded as a whole (E2E_TIMEOUT_S,
# default 600 s); every server it starts is stopped by its PID, every request has a timeout.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.e2e
req=.ci/e2e/requirements.txt
stamp=$venv/.installed-stamp
if [ -f "$stamp" ] && [ "$stamp" -nt "$req" ] && [ "$stamp" -nt pyproject.toml ] \
    && [ "$stamp" -nt .ci/constraints.txt ] && [ "$stamp" -nt .ci/e2e/run.sh ]; then
    echo "==> $venv is up to date"
else
    pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
    echo "==> [e2e] venv, torch (CPU), guardrails, transformers serve and the openai client"
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
    "${pip[@]}" install -c .ci/constraints.txt torch numpy
    "${pip[@]}" install -c .ci/constraints.txt -e . -r "$req"
    touch "$stamp"
fi
echo "==> [e2e] pytest tests/e2e"
# No download may happen: the model and its tokenizer are built by the suite.
E2E_SUITE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout --kill-after=30 "${E2E_TIMEOUT_S:-600}" \
    "$venv/bin/python" -m pytest -p no:cacheprovider tests/e2e
