"""`guardrails run` with `[trace]` settings patches vLLM's V1 `GPUModelRunner.load_model`
(`VLLM_USE_V2_MODEL_RUNNER=0`), so that the model it builds (`runner.model`) is traced: the
loader resolves in this vLLM. The V2 runner's loader is driven in tests/engines/vllm/v2/."""

from __future__ import annotations

import importlib

from prometheus_client import CollectorRegistry

from guardrails.testing import fresh_guardrails

LOADER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model"


def test_vllms_v1_model_loader_is_patched() -> None:
    guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["model.layers.*"]})
    try:
        loaders = {str(h.point.target): h for h in guards.trace_configured()}
        module = importlib.import_module(LOADER.partition(":")[0])
        assert loaders[LOADER].state == "applied"
        assert getattr(module.GPUModelRunner.load_model, "__wrapped__", None) is not None
    finally:
        guards.close()
    assert getattr(module.GPUModelRunner.load_model, "__wrapped__", None) is None  # restored
