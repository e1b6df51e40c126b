"""Load: 100,000 guarded calls with random injections from 4 threads.

Each thread drives its own site (threads sharing one: tests/system/test_threads_and_fork.py), all
through one `Guardrails` and one reporter, ticking every 8 calls so that threads constantly
meet in the reporter. Counters must end exact, Python memory flat, no thread left behind.
"""

from __future__ import annotations

import math
import random
import threading
import tracemalloc
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from guardrails.testing import fresh_guardrails

pytestmark = pytest.mark.slow  # seconds each: `pytest -m 'not slow'` skips them

THREADS = 4
CALLS_PER_THREAD = 25_000
WARMUP_CALLS = 2_000
ROWS, VOCAB = 4, 32
# Growth of Python-heap memory allowed over the run: far below one object per tick
# (12,500 ticks) or per call (100,000 calls).
MAX_GROWTH_BYTES = 256 * 1024


class CountingLogger:
    """Counts events without keeping them (capture_logs would grow with every event)."""

    def __init__(self) -> None:
        self.events = 0
        self._lock = threading.Lock()

    def _record(self, event: str, **fields: Any) -> None:
        with self._lock:
            self.events += 1

    warning = error = _record


def drive(site: Any, calls: int, seed: int, totals: dict[str, int]) -> None:
    rng = random.Random(seed)
    logits = torch.zeros(ROWS, VOCAB)
    for _ in range(calls):
        logits.zero_()
        if rng.random() < 0.05:
            row = rng.randrange(ROWS)
            nan = rng.randint(1, 4)
            logits[row, :nan] = math.nan
            totals["nan"] += nan
            totals["rows"] += 1
            if rng.random() < 0.5:
                logits[row, VOCAB - 1] = math.inf
                totals["posinf"] += 1
        site(logits)
        totals["calls"] += 1


def test_counters_end_exact_under_threaded_load() -> None:
    registry = CollectorRegistry()
    logger = CountingLogger()
    guards = fresh_guardrails(registry=registry, logger=logger, reporting={"every_calls": 8})
    threads_before = threading.active_count()
    totals = [dict.fromkeys(("nan", "posinf", "rows", "calls"), 0) for _ in range(THREADS)]
    sites = [guards.site(f"load.{i}") for i in range(THREADS)]

    def run(calls: int) -> None:
        workers = [
            threading.Thread(target=drive, args=(sites[i], calls, 1000 * calls + i, totals[i]))
            for i in range(THREADS)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    run(WARMUP_CALLS // THREADS)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        run(CALLS_PER_THREAD - WARMUP_CALLS // THREADS)
        guards.poll()
        growth = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    guards.close()

    def sample(metric: str, **labels: str) -> float | None:
        return registry.get_sample_value(metric, {"rank": "0", **labels})

    for i, expected in enumerate(totals):
        site = f"load.{i}"
        assert expected["calls"] == CALLS_PER_THREAD
        assert sample("guardrails_guard_calls_total", site=site) == CALLS_PER_THREAD
        values = "guardrails_nonfinite_values_total"
        assert sample(values, site=site, kind="nan") == expected["nan"]
        assert sample(values, site=site, kind="posinf") == expected["posinf"]
        rows = "guardrails_flagged_rows_total"
        assert sample(rows, site=site, reason="nonfinite") == expected["rows"]
    assert growth < MAX_GROWTH_BYTES, f"Python heap grew {growth} bytes"
    assert threading.active_count() == threads_before
    assert 0 < logger.events <= 4 * THREADS  # throttled: first hit, close summary, little else
