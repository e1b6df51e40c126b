"""The liveness self-check: an attached site that the engine never calls, while the heartbeat
runs `liveness_steps` times, is reported (event `guardrails.site_not_called`, gauge
`guardrails_site_not_called` at 1); a site on the path is not (gauge 0)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.integrations._hooks import MethodHook
from guardrails.names import HOOK_ACTS_ON, KNOWN_HOOKS, SITE_NOT_CALLED_EVENT
from guardrails.service import Guardrails
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path

# Two runners, as engines have: the one the engine picked calls `step` and samples through
# `Sampler.forward`; the other one's sampler is never called.
ENGINE = """
class Model:
    def logits(self, x):
        return x

    async def alogits(self, x):
        return x


class Sampler:
    def forward(self, logits):
        return logits.argmax(-1)


class OldSampler:
    def forward(self, logits):
        return logits.argmax(-1)


def step(model, sampler, logits):
    return sampler.forward(model.logits(logits))
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    with module_on_path(ENGINE, "liveness_engine", tmp_path, monkeypatch) as name:
        yield importlib.import_module(name)


def guarded(engine: ModuleType, *, sampler: str = "Sampler", **settings: Any) -> Guardrails:
    name = engine.__name__
    options: dict[str, Any] = {
        "heartbeat": f"{name}:Model.logits",
        "liveness_steps": 8,
        "attach": [
            {
                "site": "sampler.logits",
                "target": f"{name}:{sampler}.forward",
                "tensor": "arg:logits",
            }
        ],
    }
    options.update(settings)
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, **options)
    REGISTRIES[guards] = registry
    guards.attach_configured()
    return guards


REGISTRIES: weakref.WeakKeyDictionary[Guardrails, CollectorRegistry] = weakref.WeakKeyDictionary()


def gauge(guards: Guardrails, site: str) -> float | None:
    return REGISTRIES[guards].get_sample_value(
        "guardrails_site_not_called", {"site": site, "rank": "0"}
    )


def steps(engine: ModuleType, n: int, sampler: Any = None) -> None:
    model = engine.Model()
    sampler = engine.Sampler() if sampler is None else sampler
    for _ in range(n):
        engine.step(model, sampler, torch.zeros(2, 4))


def not_called(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT]


def test_a_site_attached_where_nothing_calls_it_is_reported(engine: ModuleType) -> None:
    guards = guarded(engine, sampler="OldSampler")
    with capture_logs() as logs:
        steps(engine, 8)
    [event] = not_called(logs)
    assert event["log_level"] == "warning"
    assert event["site"] == "sampler.logits"
    assert event["heartbeat"] == f"{engine.__name__}:Model.logits"
    assert event["steps"] == 8
    assert event["targets"] == [f"{engine.__name__}:OldSampler.forward"]
    assert event["state"] == ["applied"]
    assert gauge(guards, "sampler.logits") == 1.0
    guards.close()


def test_a_site_on_the_path_is_not_reported_and_its_gauge_is_zero(engine: ModuleType) -> None:
    guards = guarded(engine)
    with capture_logs() as logs:
        steps(engine, 24)
    assert not_called(logs) == []
    assert gauge(guards, "sampler.logits") == 0.0
    assert guards.count("sampler.logits", "calls") == 24
    guards.close()


def test_the_report_waits_for_liveness_steps_beats(engine: ModuleType) -> None:
    guards = guarded(engine, sampler="OldSampler")
    with capture_logs() as logs:
        steps(engine, 7)
    assert not_called(logs) == []
    assert gauge(guards, "sampler.logits") is None  # no window has ended: no series yet
    guards.close()


def test_a_silent_site_warns_once_and_its_gauge_goes_back_to_zero_when_called(
    engine: ModuleType,
) -> None:
    guards = guarded(engine, sampler="OldSampler")
    with capture_logs() as logs:
        steps(engine, 24)  # three windows without a call
        assert len(not_called(logs)) == 1
        assert gauge(guards, "sampler.logits") == 1.0
        old = engine.OldSampler()
        engine.step(engine.Model(), old, torch.zeros(1, 4))  # beat 25, and a call
        steps(engine, 7)  # beats 26-32: the window with a call ends
        assert gauge(guards, "sampler.logits") == 0.0
        steps(engine, 8)  # silent again: a new episode, a new warning
    assert len(not_called(logs)) == 2
    assert gauge(guards, "sampler.logits") == 1.0
    guards.close()


def test_a_pending_point_whose_module_never_came_is_reported_too(engine: ModuleType) -> None:
    guards = guarded(
        engine,
        attach=[
            {"site": "sampler.logits", "target": "no_such_engine_module:Sampler.forward"},
        ],
    )
    with capture_logs() as logs:
        steps(engine, 8)
    [event] = not_called(logs)
    assert event["state"] == ["pending"]
    guards.close()


@pytest.mark.parametrize(
    ("site", "table"),
    [
        ("eagle.verify", {}),  # speculative decoding may be off: not expected by default
        ("sampler.logits", {"expect_calls": False}),
    ],
)
def test_sites_not_expected_to_be_called_are_not_watched(
    engine: ModuleType, site: str, table: dict[str, Any]
) -> None:
    name = engine.__name__
    guards = guarded(
        engine,
        attach=[{"site": site, "target": f"{name}:OldSampler.forward", "tensor": "arg:logits"}],
        sites={site: table},
    )
    with capture_logs() as logs:
        steps(engine, 16)
    assert not_called(logs) == []
    assert gauge(guards, site) is None
    guards.close()


def test_an_eagle_site_can_be_expected(engine: ModuleType) -> None:
    name = engine.__name__
    guards = guarded(
        engine,
        attach=[
            {"site": "eagle.verify", "target": f"{name}:OldSampler.forward", "tensor": "arg:logits"}
        ],
        sites={"eagle.verify": {"expect_calls": True}},
    )
    with capture_logs() as logs:
        steps(engine, 8)
    assert [e["site"] for e in not_called(logs)] == ["eagle.verify"]
    guards.close()


@pytest.mark.parametrize(
    "settings",
    [
        {"disabled_sites": ["sampler.logits"]},
        {"attach": [{"site": "sampler.logits", "target": "x:y", "when": "torch<0.1"}]},
    ],
    ids=["disabled", "other-version"],
)
def test_disabled_and_other_version_points_are_not_watched(
    engine: ModuleType, settings: dict[str, Any]
) -> None:
    guards = guarded(engine, sampler="OldSampler", **settings)
    with capture_logs() as logs:
        steps(engine, 16)
    assert not_called(logs) == []
    guards.close()


def test_a_process_where_the_heartbeat_never_beats_reports_nothing(engine: ModuleType) -> None:
    # An API-server process: it imports the engine's modules, never runs a step.
    guards = guarded(engine, sampler="OldSampler")
    with capture_logs() as logs:
        for _ in range(64):
            engine.OldSampler  # noqa: B018
    assert guards.liveness is not None
    assert guards.liveness.beats == 0
    assert not_called(logs) == []
    guards.close()


def test_a_heartbeat_adds_nothing_to_guarded_calls_and_keeps_the_engines_result(
    engine: ModuleType,
) -> None:
    guards = guarded(engine)
    x = torch.tensor([[float("nan"), 1.0, 3.0]])
    assert engine.Model().logits(x) is x
    assert guards.liveness is not None
    assert guards.liveness.beats == 1
    assert engine.step(engine.Model(), engine.Sampler(), x).tolist() == [2]
    guards.close()


def test_an_async_heartbeat_beats_and_stays_a_coroutine_function(engine: ModuleType) -> None:
    guards = guarded(engine, heartbeat=f"{engine.__name__}:Model.alogits")
    assert inspect.iscoroutinefunction(engine.Model.alogits)
    x = torch.zeros(1, 2)
    assert asyncio.run(engine.Model().alogits(x)) is x
    assert guards.liveness is not None
    assert guards.liveness.beats == 1
    guards.close()


def test_a_heartbeat_that_does_not_resolve_is_an_attach_error(engine: ModuleType) -> None:
    guards = guarded(engine, heartbeat=f"{engine.__name__}:Model.no_such_method")
    [handle] = guards.heartbeats()
    assert handle.state == "failed"
    site, target, error = guards.attach_errors.failures[0]
    assert (site, target) == ("heartbeat", f"{engine.__name__}:Model.no_such_method")
    assert "has no attribute 'no_such_method'" in error
    guards.close()


def test_a_heartbeat_that_does_not_resolve_is_fatal_with_strict_attach(engine: ModuleType) -> None:
    from guardrails.attach.points import AttachError

    guards = fresh_guardrails(
        heartbeat=f"{engine.__name__}:Model.no_such_method", strict_attach=True
    )
    with pytest.raises(AttachError, match="no_such_method"):
        guards.attach_configured()
    guards.close()


def test_a_removed_heartbeat_puts_the_engines_method_back(engine: ModuleType) -> None:
    original = engine.Model.__dict__["logits"]
    guards = guarded(engine)
    [handle] = guards.heartbeats()
    assert engine.Model.__dict__["logits"] is not original
    handle.remove()
    assert engine.Model.__dict__["logits"] is original
    guards.close()


# -- engine hooks: the halves that must run where the heartbeat runs ----------------------


def _installer(module: str, present: str) -> Any:
    """A hook of two alternative runner halves (only `present` exists) and a scheduler half
    whose module never comes."""

    def install(guards: Guardrails) -> list[MethodHook]:
        def half(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            return wrapped(*args, **kwargs)

        return [
            MethodHook(guards, "test.hook", module, present, half, expect_calls=True),
            MethodHook(
                guards, "test.hook", "no_such_runner_v1", "Runner.step", half, expect_calls=True
            ),
            MethodHook(
                guards,
                "test.hook",
                "no_such_scheduler",
                "Scheduler.update",
                half,
                expect_calls="sched",
            ),
        ]

    return install


@pytest.fixture
def hook(engine: ModuleType, monkeypatch: pytest.MonkeyPatch) -> str:
    import sys

    holder = ModuleType("liveness_hook_holder")
    holder.install = _installer(engine.__name__, "Sampler.forward")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liveness_hook_holder", holder)
    monkeypatch.setitem(KNOWN_HOOKS, "test.hook", "liveness_hook_holder:install")  # type: ignore[index]
    monkeypatch.setitem(HOOK_ACTS_ON, "test.hook", ())  # type: ignore[index]
    return "test.hook"


def test_a_hooks_expected_halves_are_alternatives_and_each_group_is_watched(
    engine: ModuleType, hook: str
) -> None:
    guards = guarded(engine, hooks=[hook])
    guards.install_hooks()
    with capture_logs() as logs:
        steps(engine, 8)
    # The present runner half ran: its group is fine although its alternative is pending.
    # The scheduler half's module never came: its group is reported.
    [event] = not_called(logs)
    assert event["site"] == "test.hook:sched"
    assert event["state"] == ["pending"]
    assert event["targets"] == ["no_such_scheduler:Scheduler.update"]
    assert gauge(guards, "test.hook") == 0.0
    assert gauge(guards, "test.hook:sched") == 1.0
    guards.close()


def _spec_and_plain(name: str, excused: str) -> list[dict[str, Any]]:
    """sampler.logits as V2 attaches it: a point on the target every step calls in this
    process, and one on `excused`, which only some steps call (`expect_calls = false`),
    beside another runner's point whose module is never imported here."""
    return [
        {"site": "sampler.logits", "target": "other_runner_never_imported:Sampler.forward"},
        {
            "site": "sampler.logits",
            "target": f"{name}:{excused}.forward",
            "tensor": "arg:logits",
            "expect_calls": False,
        },
    ]


def test_a_site_whose_applied_point_only_some_steps_call_is_not_reported(
    engine: ModuleType,
) -> None:
    # V2's sampler.token_ids under speculative decoding: its one applied point (on
    # Sampler.__call__) sees no call on speculative steps; the other runner's is pending.
    guards = guarded(engine, attach=_spec_and_plain(engine.__name__, "OldSampler"))
    with capture_logs() as logs:
        steps(engine, 16)
    assert not_called(logs) == []
    assert gauge(guards, "sampler.logits") is None
    guards.close()


def test_an_excused_point_leaves_the_sites_other_applied_points_watched(
    engine: ModuleType,
) -> None:
    name = engine.__name__
    attach = [
        *_spec_and_plain(name, "Sampler"),
        {"site": "sampler.logits", "target": f"{name}:OldSampler.forward", "tensor": "arg:logits"},
    ]
    guards = guarded(engine, attach=attach)
    with capture_logs() as logs:
        steps(engine, 8, sampler=engine.Sampler())  # the excused point is called: not silent
        assert not_called(logs) == []
        assert gauge(guards, "sampler.logits") == 0.0
        # Beats with no call at all (the window of beats 9-16 still saw step 8's call, made
        # after its beat): the expecting point makes the site silent.
        for _ in range(16):
            engine.Model().logits(torch.zeros(1, 4))
    [event] = not_called(logs)
    assert event["targets"] == [
        "other_runner_never_imported:Sampler.forward",
        f"{name}:OldSampler.forward",
    ]
    assert gauge(guards, "sampler.logits") == 1.0
    guards.close()


def test_a_watched_half_that_failed_to_resolve_is_reported(
    engine: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half whose method is gone from the engine's imported module (state "failed") runs
    nowhere: the self-check names it, as it names one whose module never came."""
    import sys

    def install(guards: Guardrails) -> list[MethodHook]:
        def half(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            return wrapped(*args, **kwargs)

        return [
            MethodHook(
                guards, "test.hook", engine.__name__, "Sampler.no_such", half, expect_calls="gone"
            )
        ]

    holder = ModuleType("liveness_failed_holder")
    holder.install = install  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liveness_failed_holder", holder)
    monkeypatch.setitem(KNOWN_HOOKS, "test.hook", "liveness_failed_holder:install")  # type: ignore[index]
    monkeypatch.setitem(HOOK_ACTS_ON, "test.hook", ())  # type: ignore[index]
    guards = guarded(engine, hooks=["test.hook"])
    [part] = guards.install_hooks()
    assert part.state == "failed"
    with capture_logs() as logs:
        steps(engine, 8)
    [event] = not_called(logs)
    assert (event["site"], event["state"]) == ("test.hook:gone", ["failed"])
