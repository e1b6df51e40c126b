"""Reporting on CUDA: no host sync on the guarded path, a pinned mirror, exact totals.

Skipped without a GPU (marker `cuda`).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from guardrails import Guardrails
from guardrails.testing import fresh_guardrails

pytestmark = pytest.mark.cuda

LOGITS = "sampler.logits"
IDS = "sampler.token_ids"


def nan_count(registry: CollectorRegistry) -> float | None:
    labels = {"site": LOGITS, "kind": "nan", "rank": "0"}
    return registry.get_sample_value("guardrails_nonfinite_values_total", labels)


def test_guarded_calls_and_polls_never_sync_the_host() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1})
    # Buffers are made when a site is created for a device, before the sync check starts.
    site = guards.site(LOGITS, device="cuda", capacity=8)
    ids_site = guards.token_site(IDS, vocab_size=100, device="cuda", capacity=8)
    batches = [torch.randn(8, 4096, device="cuda") for _ in range(4)]
    for logits in batches:
        logits[0, :3] = math.nan
    ids = torch.tensor([1, 200, 3], device="cuda")
    # One clean call first: kernels compile or load on first use, outside the check.
    site(torch.zeros(8, 4096, device="cuda"))
    ids_site(torch.zeros(3, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for logits in batches:
            site(logits)
            ids_site(ids)
            guards.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    guards.close()
    assert nan_count(registry) == 12


def test_host_mirror_is_pinned() -> None:
    guards = fresh_guardrails(registry=CollectorRegistry())
    site = guards.site(LOGITS, device="cuda")
    [counts] = site.device_counts()
    # The mirror is private; pinned memory is what makes the copy into it asynchronous.
    assert counts._mirror.is_pinned()
    guards.close()


def test_completed_copies_reach_the_counters_without_a_flush() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1})
    site = guards.site(LOGITS, device="cuda")
    logits = torch.randn(4, 256, device="cuda")
    logits[1, :5] = math.nan
    site(logits)  # starts the copy
    torch.cuda.synchronize()  # the test, not the library, waits for it
    guards.poll()
    assert nan_count(registry) == 5
    guards.close()


def test_close_reports_exact_totals_from_the_device() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1000})
    site = guards.site(LOGITS, device="cuda")
    for _ in range(3):
        logits = torch.randn(4, 256, device="cuda")
        logits[2, :2] = math.nan
        site(logits)
    guards.close()
    assert nan_count(registry) == 6


@pytest.mark.parametrize("action", ["poll", "counts"])
def test_polls_from_another_thread_leave_a_global_mode_capture_intact(action: str) -> None:
    # `counts` waits for the device (DeviceCounts.exact, also behind flush and close): in
    # thread-local capture mode too (issue 21, defect 7).
    # A host's metrics thread polls while the engine's thread captures a CUDA graph in the
    # default "global" mode: an event query from the poller would otherwise be refused and
    # invalidate the capture.
    import threading

    pytest.importorskip("triton")
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1_000_000})
    site = guards.site(LOGITS, device="cuda", capacity=4)
    other = guards.site("draft.logits", device="cuda", capacity=4)
    static = torch.randn(4, 2048, device="cuda")
    site(static.clone())
    other(torch.randn(4, 2048, device="cuda"))
    guards.poll()  # a copy is in flight: the poller's next poll queries its event
    torch.cuda.synchronize()
    inside, polled = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def poller() -> None:
        try:
            inside.wait(10)
            for _ in range(5):
                guards.poll() if action == "poll" else guards.counts()
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)
        finally:
            polled.set()

    thread = threading.Thread(target=poller)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        site(static)
        inside.set()
        assert polled.wait(10)
    thread.join()
    assert not failures
    errors = registry.get_sample_value(
        "guardrails_reporting_errors_total", {"stage": "poll", "rank": "0"}
    )
    assert not errors
    static[1, :2] = math.nan
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    guards.close()
    assert nan_count(registry) == 6


# -- the background poller (reporting.report_interval_s) ------------------------------------


def eventually_nan(registry: CollectorRegistry, want: float, timeout_s: float = 20.0) -> float:
    deadline = time.monotonic() + timeout_s
    got = nan_count(registry) or 0.0
    while got != want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = nan_count(registry) or 0.0
    return got


def by_time(interval: float) -> tuple[Guardrails, CollectorRegistry]:
    """An instance whose counts arrive by the background poll alone (no tick)."""
    registry = CollectorRegistry()
    reporting = {"every_calls": 1_000_000, "report_interval_s": interval}
    return fresh_guardrails(registry=registry, reporting=reporting), registry


def test_an_idle_sites_counts_arrive_by_the_poller_alone() -> None:
    """No tick, no poll, no synchronize: the poller's side-stream copy brings them."""
    guards, registry = by_time(0.1)
    site = guards.site(LOGITS, device="cuda")
    for _ in range(3):
        logits = torch.randn(4, 256, device="cuda")
        logits[1, :5] = math.nan
        site(logits)
    assert eventually_nan(registry, 15.0) == 15.0
    guards.close()


def test_graph_replays_reach_the_counters_with_no_python_call() -> None:
    pytest.importorskip("triton")
    guards, registry = by_time(0.1)
    site = guards.site(LOGITS, device="cuda", capacity=4)
    static = torch.randn(4, 2048, device="cuda")
    site(static.clone())  # buffers and kernels before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        site(static)
    static[1, :2] = math.nan
    for _ in range(4):
        graph.replay()
    assert eventually_nan(registry, 8.0) == 8.0
    guards.close()


def test_background_polls_leave_a_global_mode_capture_intact() -> None:
    """The poller polls every 10 ms while the serving thread captures in global mode."""
    pytest.importorskip("triton")
    guards, registry = by_time(0.02)
    site = guards.site(LOGITS, device="cuda", capacity=4)
    static = torch.randn(4, 2048, device="cuda")
    site(static.clone())  # starts the poller
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        site(static)
        time.sleep(0.5)  # about 50 background polls inside the capture
    errors = registry.get_sample_value(
        "guardrails_reporting_errors_total", {"stage": "poll", "rank": "0"}
    )
    assert not errors
    static[1, :2] = math.nan
    for _ in range(3):
        graph.replay()
    assert eventually_nan(registry, 6.0) == 6.0
    guards.close()
    assert nan_count(registry) == 6
