"""The requests engine hooks end (`guardrails.reporting.request_aborts`): each counted in
guardrails_requests_aborted_total{hook, reason, rank} and named, by the engine's own id, in one
`guardrails.request_aborted` warning; at most PER_SECOND events per hook and second, the rest
folded into the next event's `suppressed`, the count never throttled; nothing ever raised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.integrations._hooks import MethodHook
from guardrails.names import REQUEST_ABORTED_EVENT
from guardrails.reporting.metrics import ABORT_REASONS
from guardrails.reporting.request_aborts import PER_SECOND, RequestAborts
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path
from tests.reporting.test_recorder import BrokenLogger

HOOK = "sglang.abort_poisoned_requests"
SITE = "sampler.logits"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def aborted(registry: CollectorRegistry, hook: str = HOOK, reason: str = "nonfinite_logits") -> Any:
    return registry.get_sample_value(
        "guardrails_requests_aborted_total", {"hook": hook, "reason": reason, "rank": "0"}
    )


def end(aborts: RequestAborts, request_id: object, hook: str = HOOK) -> None:
    aborts.record(
        hook,
        site=SITE,
        reason="nonfinite_logits",
        request_id=request_id,
        status=503,
        finish_reason="abort",
    )


def events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == REQUEST_ABORTED_EVENT]


def test_each_ended_request_is_counted_and_named_by_the_engines_id() -> None:
    registry = CollectorRegistry()
    aborts = RequestAborts(registry)
    with capture_logs() as logs:
        for rid in ("a1f3", "b7c2", 42):
            end(aborts, rid)
    assert aborted(registry) == 3.0
    got = events(logs)
    assert [e["request_id"] for e in got] == ["a1f3", "b7c2", "42"]
    assert got[0] == {
        "event": REQUEST_ABORTED_EVENT,
        "log_level": "warning",
        "hook": HOOK,
        "site": SITE,
        "reason": "nonfinite_logits",
        "request_id": "a1f3",
        "status": 503,
        "finish_reason": "abort",
        "suppressed": 0,
        "rank": "0",
    }


def test_a_request_without_an_id_is_logged_with_none() -> None:
    with capture_logs() as logs:
        end(RequestAborts(CollectorRegistry()), None)
    assert [e["request_id"] for e in events(logs)] == [None]


def test_a_storm_is_throttled_per_second_and_the_count_stays_exact() -> None:
    registry = CollectorRegistry()
    clock = Clock()
    aborts = RequestAborts(registry, clock=clock)
    with capture_logs() as logs:
        for i in range(PER_SECOND + 5):
            end(aborts, f"r{i}")
        clock.now += 0.5  # same window: still held back
        end(aborts, "held")
        clock.now += 0.5  # a new window: the next event carries what was held back
        end(aborts, "next")
    got = events(logs)
    assert [e["request_id"] for e in got] == [f"r{i}" for i in range(PER_SECOND)] + ["next"]
    assert got[-1]["suppressed"] == 6
    assert all(e["suppressed"] == 0 for e in got[:-1])
    assert aborted(registry) == PER_SECOND + 7


def test_no_one_second_span_logs_more_than_per_second_events_across_a_window_edge() -> None:
    """Windows that start at an event let 2 x PER_SECOND through within 0.05 s (PER_SECOND just
    before a window's end, PER_SECOND just after); every span of one second holds at most
    PER_SECOND events."""
    clock = Clock()
    aborts = RequestAborts(CollectorRegistry(), clock=clock)
    times = []
    with capture_logs() as logs:
        end(aborts, "first")
        times.append(clock.now)
        clock.now += 0.9805
        for i in range(2 * PER_SECOND):
            clock.now += 0.001
            before = len(events(logs))
            end(aborts, f"r{i}")
            if len(events(logs)) > before:
                times.append(clock.now)
        clock.now += 1.0  # a second after the last logged one: the next goes, with the rest
        end(aborts, "later")
    for i, start in enumerate(times):
        assert sum(1 for t in times[i:] if t - start < 1.0) <= PER_SECOND
    # "first" and 19 before its second ends, then one as "first" ages out; the rest held.
    assert len(times) == PER_SECOND + 1
    [later] = [e for e in events(logs) if e["request_id"] == "later"]
    assert later["suppressed"] == PER_SECOND


def test_each_hook_has_its_own_window() -> None:
    clock = Clock()
    aborts = RequestAborts(CollectorRegistry(), clock=clock)
    with capture_logs() as logs:
        for i in range(PER_SECOND + 1):
            end(aborts, f"s{i}")
        end(aborts, "v0", hook="vllm.end_poisoned_requests")
    assert [e["request_id"] for e in events(logs)][-1] == "v0"


def test_a_broken_logger_or_registry_never_raises() -> None:
    class BrokenRegistry(CollectorRegistry):
        def register(self, collector: Any) -> None:
            raise RuntimeError("registry is broken")

    end(RequestAborts(CollectorRegistry(), BrokenLogger()), "r1")
    end(RequestAborts(BrokenRegistry()), "r2")


def test_a_hooks_series_exist_at_zero_once_it_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    engine = "class Runner:\n    def step(self, x):\n        return x\n"
    try:
        with module_on_path(engine, "aborting_engine", tmp_path, monkeypatch) as name:
            hook = MethodHook(guards, HOOK, name, "Runner.step", lambda w, i, a, k: w(*a, **k))
            hook.install()
            assert aborted(registry) is None  # not applied yet: nothing made
            __import__(name)
            assert hook.state == "applied"
        assert [aborted(registry, reason=r) for r in ABORT_REASONS] == [0.0, 0.0]
        with capture_logs() as logs:
            end(guards.request_aborts, "x9")
        assert aborted(registry) == 1.0
        assert [e["request_id"] for e in events(logs)] == ["x9"]
    finally:
        guards.close()
