"""One recorder for the errors guardrails swallows (`guardrails.reporting.recorder`): each kind
counts every error in its own family (names unchanged), logs the first of each key once, makes
its series at 0 when asked, and never raises, not even for a broken registry or logger."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.attach.patching import AttachFailures, GuardErrors
from guardrails.attach.points import AttachPoint
from guardrails.names import (
    ATTACH_ERROR_EVENT,
    GUARD_ERROR_EVENT,
    HOOK_ERROR_EVENT,
    REQUEST_ABORTED_EVENT,
)
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.metrics import guard_metrics
from guardrails.reporting.recorder import ErrorRecorder, ReportingErrors
from guardrails.testing import fresh_guardrails


class BrokenLogger:
    """A host logger whose every call fails."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"logger.{name} is broken")

        return fail


def test_every_recorder_of_a_guardrails_is_one_and_keeps_its_names() -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    try:
        recorders = (
            guards.guard_errors,
            guards.attach_errors,
            guards.hook_errors,
            guards.request_aborts,
        )
        assert all(isinstance(r, ErrorRecorder) for r in recorders)
        assert [(type(r).FAMILY, type(r).EVENT, type(r).LABELS) for r in recorders] == [
            ("guard_errors", GUARD_ERROR_EVENT, ("site", "reason")),
            ("attach_errors", ATTACH_ERROR_EVENT, ("site", "target")),
            ("hook_errors", HOOK_ERROR_EVENT, ("hook",)),
            ("requests_aborted", REQUEST_ABORTED_EVENT, ("hook", "reason")),
        ]
    finally:
        guards.close()


def test_guard_errors_count_each_call_and_log_the_first_of_a_site_and_reason() -> None:
    registry = CollectorRegistry()
    errors = GuardErrors(registry)
    point = AttachPoint.from_arguments(site="sampler.logits", target="engine:Runner.sample")
    errors.prepare("sampler.logits")
    labels = {"site": "sampler.logits", "rank": "0"}
    value = registry.get_sample_value
    assert value("guardrails_guard_errors_total", {**labels, "reason": "shape"}) == 0.0
    with capture_logs() as logs:
        for _ in range(3):
            errors.record(point, "shape", ValueError("rows"))
        errors.record(point, "dtype", TypeError("int8"))
    assert value("guardrails_guard_errors_total", {**labels, "reason": "shape"}) == 3.0
    assert value("guardrails_guard_errors_total", {**labels, "reason": "dtype"}) == 1.0
    assert [(e["event"], e["reason"], e["error"]) for e in logs] == [
        (GUARD_ERROR_EVENT, "shape", "ValueError: rows"),
        (GUARD_ERROR_EVENT, "dtype", "TypeError: int8"),
    ]
    assert logs[0]["rank"] == "0"


def test_attach_errors_log_every_failure_and_keep_them_in_order() -> None:
    registry = CollectorRegistry()
    errors = AttachFailures(registry)
    with capture_logs() as logs:
        errors.record(site="a", target="m:X.f", error=AttributeError("no f"))
        errors.record(site="a", target="m:X.f", error=AttributeError("no f"))
    labels = {"site": "a", "target": "m:X.f", "rank": "0"}
    assert registry.get_sample_value("guardrails_attach_errors_total", labels) == 2.0
    assert [e["event"] for e in logs] == [ATTACH_ERROR_EVENT] * 2
    assert errors.failures == [("a", "m:X.f", "AttributeError: no f")] * 2


def test_a_broken_logger_or_registry_is_swallowed() -> None:
    registry = CollectorRegistry()
    errors = HookErrors(registry, BrokenLogger())
    errors.prepare("vllm.end_poisoned_requests")
    errors.record("vllm.end_poisoned_requests", "Runner.step", KeyError("x"), log=True)
    labels = {"hook": "vllm.end_poisoned_requests", "rank": "0"}
    assert registry.get_sample_value("guardrails_hook_errors_total", labels) == 1.0
    # A registry whose families clash (other constant label names) fails every increment.
    other = CollectorRegistry()
    guard_metrics(other, {"pod": "p"})
    clash = GuardErrors(other, labels={"zone": "z"})
    point = AttachPoint.from_arguments(site="s", target="m:X.f")
    with capture_logs() as logs:
        clash.record(point, "error", RuntimeError("boom"))
    assert [e["event"] for e in logs] == [GUARD_ERROR_EVENT]  # still logged
    assert other.get_sample_value("guardrails_guard_errors_total", {"site": "s"}) is None


def test_first_is_once_per_key() -> None:
    errors = HookErrors(CollectorRegistry())
    assert [errors.first("h", "p"), errors.first("h", "p"), errors.first("h", "q")] == [
        True,
        False,
        True,
    ]


def test_a_key_that_does_not_fit_the_labels_is_refused_by_name() -> None:
    errors = GuardErrors(CollectorRegistry())
    with pytest.raises(ValueError, match=r"GuardErrors: 2 labels \(site, reason\)"):
        errors._child(("only-site",))


def test_reporting_errors_hold_faults_until_the_series_exist() -> None:
    registry = CollectorRegistry()
    family = guard_metrics(registry).reporting_errors
    errors = ReportingErrors(guard_metrics(registry), logger=None)
    first = errors.record("poll", RuntimeError("early"), None)
    assert first is not None
    assert first[1:] == (
        "guardrails.reporting_error",
        {"stage": "poll", "error": "RuntimeError: early", "rank": None},
    )
    assert errors.record("poll", RuntimeError("again"), None) is None  # logged once
    made = {stage: family.labels(stage=stage, rank="0") for stage in ("poll", "metrics", "logs")}
    errors.open("0", made)
    errors.record("poll", RuntimeError("late"), "0")
    labels = {"stage": "poll", "rank": "0"}
    assert registry.get_sample_value("guardrails_reporting_errors_total", labels) == 3.0
