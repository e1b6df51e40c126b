"""`transformers serve` under `guardrails run --config config/profiles/transformers-serve.toml`.

transformers serve has no /metrics: guardrails serves its own (`GUARDRAILS_METRICS_PORT`, one
process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.server import BIN, Server, free_port, guarded, running, server_env

# Continuous batching's KV cache otherwise takes a share of the machine's memory: a few
# blocks of 16 tokens are plenty for these requests.
CB_ARGS = ("--cb-block-size", "16", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "256")


@contextlib.contextmanager
def serving(
    model: Path,
    log: Path,
    *extra: str,
    guarded_run: bool = True,
    settings: dict[str, str] | None = None,
) -> Iterator[Server]:
    port, metrics_port = free_port(), free_port()
    serve = [str(BIN / "transformers"), "serve", str(model), "--device", "cpu"]
    serve += ["--dtype", "float16", "--host", "127.0.0.1", "--port", str(port), *extra]
    env = server_env(
        settings,
        GUARDRAILS_METRICS_PORT=str(metrics_port),
        GUARDRAILS_REPORT_EVERY="1",  # counts reach /metrics at each call
        GUARDRAILS_STRICT_ATTACH="true",  # a point that does not resolve fails the start
        GUARDRAILS_LIVENESS_STEPS="8",  # the self-check judges every 8 decoding steps
    )
    with running(
        guarded("transformers-serve", serve) if guarded_run else serve,
        log,
        port=port,
        model=str(model),
        env=env,
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
    ) as server:
        yield server
