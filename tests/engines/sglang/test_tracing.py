"""`guardrails run` with `[trace]` settings patches SGLang's own `ModelRunner.load_model`, so
that the model it builds (`runner.model`) is traced: the loader resolves in this SGLang."""

from __future__ import annotations

import importlib

from prometheus_client import CollectorRegistry

from guardrails.testing import fresh_guardrails

LOADER = "sglang.srt.model_executor.model_runner:ModelRunner.load_model"


def test_sglangs_model_loader_is_patched() -> None:
    guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["model.layers.*"]})
    try:
        loaders = {str(h.point.target): h for h in guards.trace_configured()}
        module = importlib.import_module(LOADER.partition(":")[0])
        assert loaders[LOADER].state == "applied"
        assert getattr(module.ModelRunner.load_model, "__wrapped__", None) is not None
    finally:
        guards.close()
    assert getattr(module.ModelRunner.load_model, "__wrapped__", None) is None  # restored
