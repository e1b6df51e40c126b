"""`guardrails run` traces the model vLLM's Model Runner V2 loads: the loader patch on V2's own
`GPUModelRunner.load_model` (guardrails/attach/loaders.py) traces the runner's `.model`
once it is built, with the `[trace]` settings, no code change."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from guardrails.testing import fresh_guardrails
from tests.engines.vllm.v2.runner import engine

V2_LOADER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model"


def test_the_model_v2s_load_model_builds_is_traced(tmp_path: Path) -> None:
    guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["lm_head"]})
    try:
        loaders = {str(h.point.target): h for h in guards.trace_configured()}
        with engine(tmp_path) as v2:
            assert loaders[V2_LOADER].state == "applied"
            (trace,) = loaders[V2_LOADER].traces
            assert trace.names == ("lm_head",)
            assert trace.installed
            assert trace.buffer in dict(v2.runner.model.named_buffers())
            assert guards.traces() == [trace]
    finally:
        guards.close()
    assert not trace.installed  # close() takes the probes off the engine's model


def test_without_trace_settings_v2s_model_is_not_hooked(tmp_path: Path) -> None:
    guards = fresh_guardrails(registry=CollectorRegistry())
    try:
        assert guards.trace_configured() == []
        with engine(tmp_path) as v2:
            assert all(not m._forward_hooks for m in v2.runner.model.modules())
    finally:
        guards.close()
