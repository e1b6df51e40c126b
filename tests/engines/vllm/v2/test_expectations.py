"""What `vllm.end_poisoned_requests` reads from vLLM, declared beside the code that reads it
(`guardrails.attach.expects`), checked against the vLLM installed in this venv.

The case this exists for: vLLM 0.34.0 dropped `ModelRunnerOutput.req_id_to_index`, which the
scheduler half read at every step (through 0.33.0). The method it wraps,
`Scheduler.update_from_output`, still resolved, so `guardrails check` said ok while the half
raised at every step and no poisoned request was ended. Declared, that read is an error in
`check` and, in a server, a part that is not applied at all: reported once, marked off,
and the engine's own method runs with no error per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.attach.expects import reads, verify
from guardrails.integrations._hooks import MethodHook
from guardrails.integrations.vllm import _SCHEDULER, HOOK, SCHEDULER_MODULE, SCHEDULER_TARGET
from guardrails.names import ATTACH_ERROR_EVENT, SITE_NOT_CALLED_EVENT
from guardrails.settings.targets import installed_version, requirement_holds

from ..faults import guarded
from .runner import Engine, engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

V034 = bool(requirement_holds("vllm>=0.34"))
VERSION = installed_version("vllm")
# What the scheduler half read through vLLM 0.33.0 (the output's rows by request id).
UP_TO_033 = reads("vllm.v1.outputs:ModelRunnerOutput", "req_id_to_index")


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[Engine]:
    with engine(tmp_path) as built:
        yield built


def test_the_read_vllm_034_dropped_is_an_error_naming_the_field_and_version() -> None:
    problems = verify([UP_TO_033])
    if V034:
        assert problems == [
            "vllm.v1.outputs:ModelRunnerOutput has no field or attribute 'req_id_to_index' "
            f"(vllm {VERSION})"
        ]
    else:
        assert problems == []


def test_every_read_the_shipped_scheduler_half_declares_holds_here() -> None:
    assert verify(_SCHEDULER) == []


def test_the_scheduler_half_as_it_read_up_to_033_is_not_applied_on_034(  # type: ignore[no-untyped-def]
    outcome, v2
) -> None:
    """The half built with the pre-0.34 declaration: on 0.34 it is never wrapped, is reported
    once, its gauge says it is off, and engine steps run with no hook error."""
    from vllm.v1.core.sched.scheduler import Scheduler

    registry = CollectorRegistry()
    calls = []
    with guarded(registry=registry) as guards, capture_logs() as logs:
        part = MethodHook(
            guards,
            HOOK,
            SCHEDULER_MODULE,
            SCHEDULER_TARGET,
            lambda wrapped, instance, args, kwargs: calls.append(1) or wrapped(*args, **kwargs),
            reads=[*_SCHEDULER, UP_TO_033],
        )
        part.install()
        try:
            for req_id in ("r0", "r1"):
                v2.add(req_id, [1, 5, 7, 9], temperature=0.0, max_tokens=3)
            for _ in range(3):
                v2.step()
            wrapped = hasattr(Scheduler.update_from_output, "__wrapped__")
            state = part.state
        finally:
            part.remove()

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"rank": "0", **labels})

    off = f"{HOOK}:{SCHEDULER_TARGET}"
    if not V034:
        assert (state, calls, wrapped) == ("applied", [1, 1, 1], True)
        assert sample("guardrails_site_not_called", site=off) is None
        return
    assert (state, wrapped, calls) == ("mismatch", False, [])
    target = f"{SCHEDULER_MODULE}:{SCHEDULER_TARGET}"
    assert sample("guardrails_attach_errors_total", site=HOOK, target=target) == 1.0
    assert sample("guardrails_site_not_called", site=off) == 1.0
    assert sample("guardrails_hook_errors_total", hook=HOOK) in (None, 0.0)
    errors = [e for e in logs if e["event"] == ATTACH_ERROR_EVENT]
    assert len(errors) == 1
    assert "req_id_to_index" in str(errors[0])
    assert f"vllm {VERSION}" in str(errors[0])
    [silent] = [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT]
    assert silent["site"] == off
    assert silent["state"] == ["mismatch"]
    assert "lacks what it reads" in silent["action"]
    outcome(
        component="check / hook part (Scheduler.update_from_output)",
        dtype="-",
        mode="the 0.33.0 declaration on vLLM 0.34.0",
        fault="ModelRunnerOutput.req_id_to_index removed",
        unguarded="check ok; AttributeError at every step, no request ended",
        guarded="part not applied: 1 attach error naming the field and version, gauge off 1",
    )
