"""SGLang's own process topology for /metrics (`--enable-metrics`), on CPU: run by
test_metrics_tree.py, plain and under `guardrails run --config config/profiles/sglang.toml`.

    python tests/engines/sglang/metrics_tree_workload.py OUT.json

In the order SGLang's launcher does it: this (main) process calls SGLang's own
`set_prometheus_multiproc_dir()`, publishes its configuration, builds the tokenizer manager's
`TokenizerMetricsCollector` (SGLang's main-process series, which import prometheus_client
only now) and counts prompt tokens; a scheduler process is started with multiprocessing's
spawn context (as SGLang starts its schedulers), in which SGLang's Sampler samples a batch with
an all-NaN row; then the main process serves /metrics through SGLang's own
`add_prometheus_middleware` (a MultiProcessCollector over that directory) and scrapes it.
Writes {"scrape": text, "exitcodes": [...], "imported_at_start": bool} to OUT.json.
"""

from __future__ import annotations

import sys

IMPORTED_AT_START = "prometheus_client" in sys.modules

import json  # noqa: E402
import multiprocessing  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engines" / "stubs")]

PROMPT_TOKENS = 7


def scheduler() -> None:
    import torch

    from tests.engines.sglang.engine import clean_logits, inject, load_engine, sample

    engine = load_engine()
    logits = clean_logits(torch.float32)
    inject(logits, "all_nan")
    sample(engine, logits, "greedy")


def tokenizer_metrics() -> None:
    try:
        from sglang.srt.observability.metrics_collector import TokenizerMetricsCollector
    except ModuleNotFoundError:  # before 0.5.14
        from sglang.srt.metrics.collector import (  # type: ignore[import-not-found, no-redef, unused-ignore]
            TokenizerMetricsCollector,
        )

    from sglang.srt.server_args import ServerArgs

    # The server's own arguments, as the tokenizer manager passes them (0.5.13 reads its
    # bucket settings from them; 0.5.23 also takes None).
    args = ServerArgs(model_path="dummy", device="cpu", sampling_backend="pytorch")
    collector = TokenizerMetricsCollector(server_args=args, labels={"model_name": "m"})
    # The labels SGLang's own counting passes: 0.5.14+ adds is_streaming to the collector's
    # (the same version split as test_metrics_tree.PROMPT_TOKENS).
    from tests.engines.sglang.engine import NEW

    labels = {"model_name": "m", "is_streaming": "false"} if NEW else {"model_name": "m"}
    collector.prompt_tokens_total.labels(**labels).inc(PROMPT_TOKENS)


def main() -> None:
    from sglang.srt.utils import add_prometheus_middleware, set_prometheus_multiproc_dir
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from tests.engines.sglang.engine import load_engine

    set_prometheus_multiproc_dir()
    load_engine()  # publishes the configuration the collectors read
    tokenizer_metrics()
    proc = multiprocessing.get_context("spawn").Process(target=scheduler, name="scheduler_TP0")
    proc.start()
    proc.join(300)
    app = Starlette()
    add_prometheus_middleware(app)
    reply = TestClient(app).get("/metrics")
    Path(sys.argv[1]).write_text(
        json.dumps(
            {
                "scrape": reply.text,
                "status": reply.status_code,
                "exitcodes": [proc.exitcode],
                "imported_at_start": IMPORTED_AT_START,
            }
        )
    )


if __name__ == "__main__":
    main()
