"""An engine hook's own failure: counted in guardrails_hook_errors_total{hook, rank}, logged
once per part through the host's logging (a JSON line in json mode), the engine's call going
on as if unhooked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.integrations._hooks import MethodHook, PartFailures
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path
from tests.processes import child_env, run_python

HOOK = "vllm.end_poisoned_requests"  # any name: the hook's code is the test's
ENGINE = "class Runner:\n    def step(self, x):\n        return x + 1\n"


def hook_errors(registry: CollectorRegistry, hook: str = HOOK) -> float | None:
    return registry.get_sample_value("guardrails_hook_errors_total", {"hook": hook, "rank": "0"})


class BrokenHalf:
    """A hook half whose own code fails before it calls the engine, as a bug would."""

    def __init__(self, guards: Any) -> None:
        self.failed = PartFailures(HOOK, "Runner.step", guards)

    def __call__(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            raise KeyError("sampled_token_ids")
        except Exception as exc:
            self.failed(exc)
        return wrapped(*args, **kwargs)


def test_a_failing_hook_is_counted_each_time_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry)
    with module_on_path(ENGINE, "hooked_engine", tmp_path, monkeypatch) as name:
        hook = MethodHook(guards, HOOK, name, "Runner.step", BrokenHalf(guards))
        hook.install()
        module = __import__(name)
        assert hook.state == "applied"
        assert hook_errors(registry) == 0.0  # exists at 0 once the hook applies
        with capture_logs() as logs:
            results = [module.Runner().step(i) for i in range(3)]
    assert results == [1, 2, 3]  # the engine's calls went on
    assert hook_errors(registry) == 3.0
    [event] = [e for e in logs if e["event"] == "guardrails.hook_error"]
    assert event["log_level"] == "error"
    assert event["hook"] == HOOK
    assert event["part"] == "Runner.step"
    assert event["error"] == "KeyError: 'sampled_token_ids'"
    assert event["rank"] == "0"
    guards.close()


JSON_MODE = r"""
import sys
import guardrails as gr
from guardrails.integrations._hooks import PartFailures
from prometheus_client import REGISTRY

guards = gr.Guardrails(gr.GuardSettings())
failed = PartFailures("sglang.abort_poisoned_requests", "Sampler.forward", guards)
for _ in range(2):
    failed(RuntimeError("logits_output has no next_token_logits"))
print(REGISTRY.get_sample_value(
    "guardrails_hook_errors_total", {"hook": "sglang.abort_poisoned_requests", "rank": "0"}))
"""


def test_in_json_mode_a_hook_error_is_one_json_line() -> None:
    done = run_python("-c", JSON_MODE, env=child_env(GUARDRAILS_LOG_FORMAT="json"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2.0"
    lines = [line for line in done.stderr.splitlines() if "hook_error" in line]
    assert len(lines) == 1, done.stderr
    event = json.loads(lines[0])
    assert event["event"] == "guardrails.hook_error"
    assert event["level"] == "error"
    assert event["hook"] == "sglang.abort_poisoned_requests"
    assert event["error"] == "RuntimeError: logits_output has no next_token_logits"
