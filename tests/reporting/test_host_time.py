"""guardrails_host_seconds_total{part, rank}: what `Guardrails.host_time` was told reaches the
counter at each report (poll, flush, close, the background poll), exactly, once; the poller
times itself; a failing series catches up.

Parts named `test:*` here are ones no guardrails code adds, so the values are exact whatever
else a site call times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

import guardrails as gr
from tests.instances import instances

HOST = "guardrails_host_seconds_total"
LOGITS = "sampler.logits"


@pytest.fixture
def make(registry: CollectorRegistry) -> Iterator[Callable[..., gr.Guardrails]]:
    reporting = {"every_calls": 1_000_000, "report_interval_s": 3600}
    with instances(registry=registry, reporting=reporting) as build:
        yield build


def seconds(registry: CollectorRegistry, part: str) -> float | None:
    return registry.get_sample_value(HOST, {"part": part, "rank": "0"})


def test_time_added_reaches_the_counter_exactly_at_the_next_poll(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    guards.site(LOGITS)(torch.randn(2, 8))  # the metrics open, as in a serving process
    guards.host_time.add("test:a", 0.25)
    guards.host_time.add("test:a", 0.125)
    guards.host_time.add("test:b", 0.5)
    assert seconds(registry, "test:a") is None  # nothing reported before the poll
    guards.poll()
    assert seconds(registry, "test:a") == 0.375
    assert seconds(registry, "test:b") == 0.5


def test_each_poll_adds_only_what_was_spent_since_the_last(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    guards.site(LOGITS)(torch.randn(2, 8))
    guards.host_time.add("test:a", 0.25)
    guards.poll()
    guards.poll()  # nothing new: the counter stays
    assert seconds(registry, "test:a") == 0.25
    guards.host_time.add("test:a", 0.5)
    guards.poll()
    assert seconds(registry, "test:a") == 0.75


def test_close_reports_the_last_time_added_exactly(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    guards.site(LOGITS)(torch.randn(2, 8))
    guards.host_time.add("test:a", 0.25)
    guards.poll()
    guards.host_time.add("test:a", 0.0625)
    guards.close()
    assert seconds(registry, "test:a") == 0.3125


def test_flush_reports_time_added_without_any_site(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()  # a process that only loads models (a trace's `loader` part), no site
    guards.host_time.add("test:a", 1.5)
    guards.flush()
    assert seconds(registry, "test:a") == 1.5


def test_the_background_poller_times_itself(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make(reporting={"every_calls": 1_000_000, "report_interval_s": 0.05})
    guards.site(LOGITS)(torch.randn(2, 8))  # starts the poller
    deadline = time.monotonic() + 30.0
    while not (seconds(registry, "poller") or 0.0) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (seconds(registry, "poller") or 0.0) > 0.0


def test_without_the_poller_no_poller_part_is_counted(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    """The control for the test above: an interval longer than the test, no poller time."""
    guards = make()
    guards.site(LOGITS)(torch.randn(2, 8))
    time.sleep(0.2)
    guards.poll()
    assert seconds(registry, "poller") is None


def test_a_failing_series_is_contained_and_catches_up(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guardrails.reporting.metrics import guard_metrics

    guards = make()
    guards.site(LOGITS)(torch.randn(2, 8))
    series = guard_metrics(registry).host_seconds.labels(part="test:a", rank="0")

    def broken(amount: float = 1) -> None:
        raise OSError("multiprocess directory is full")

    guards.host_time.add("test:a", 0.25)
    with monkeypatch.context() as patch:
        patch.setattr(series, "inc", broken)
        guards.poll()  # never raises
    assert seconds(registry, "test:a") is None
    errors = {"stage": "metrics", "rank": "0"}
    assert registry.get_sample_value("guardrails_reporting_errors_total", errors) == 1
    guards.host_time.add("test:a", 0.5)
    guards.poll()
    assert seconds(registry, "test:a") == 0.75
