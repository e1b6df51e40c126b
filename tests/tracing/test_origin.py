"""The origin of a float16 overflow, named exactly: eager and compiled, both faults, every
mode; nothing named on a clean run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

import guardrails as gr
from guardrails.names import NONFINITE_ORIGIN_EVENT
from guardrails.tracing import ops
from tests.tracing.models import TRIGGER_ID, llama, llama_trigger, net

NET_MODULES = ["embed", "layers.*", "norm", "head"]
LLAMA_MODULES = ["model.embed_tokens", "model.layers.*", "model.norm", "lm_head"]
CLEAN = [[1, 2, 5]]
POISONED = [[1, 5, TRIGGER_ID]]
ORIGIN = "guardrails_nonfinite_origin_total"
EXPECTED = {"mlp": "layers.0.mlp", "proj": "layers.0.mlp.up_proj"}


def step(guards: gr.Guardrails, model: Callable[..., Any], ids: list[list[int]]) -> None:
    """One decode step: the model, then the sampler's site on its last position."""
    with torch.no_grad():
        out = model(torch.tensor(ids))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    guards.site("sampler.logits")(logits[:, -1].contiguous())
    guards.poll()


def origins(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == ORIGIN:
                found[(sample.labels["module"], sample.labels["kind"])] = sample.value
    return found


def origin_events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT]


@pytest.mark.parametrize("fault", ["mlp", "proj"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_origin_is_named_exactly(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, fault: str, compiled: bool
) -> None:
    guards = make()
    model = net(fault)
    trace = guards.trace(model, NET_MODULES)
    run = torch.compile(model, fullgraph=True) if compiled else model
    with capture_logs() as logs:
        step(guards, run, CLEAN)
        assert origin_events(logs) == []
        step(guards, run, POISONED)
    (event,) = origin_events(logs)
    assert event["module"] == EXPECTED[fault]
    assert event["site"] == "sampler.logits"
    assert event["kind"] in ("nan", "posinf")
    assert event["dtype"] == "float16"
    assert trace.origin is not None
    assert trace.origin.module == EXPECTED[fault]
    assert origins(registry) == {(EXPECTED[fault], event["kind"]): 1.0}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_engine_that_calls_model_forward_directly_gets_its_origin(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, compiled: bool
) -> None:
    # SGLang's model runner calls `self.model.forward(...)`, which runs no hook of the model's
    # own: the step boundaries are the model's `forward`, wrapped on the instance.
    guards = make()
    model = net("mlp")
    guards.trace(model, NET_MODULES)
    if compiled:
        model.compile(fullgraph=True)  # compiles __call__; forward still runs eagerly around it
    with capture_logs() as logs:
        step(guards, model.forward, CLEAN)
        assert origin_events(logs) == []
        step(guards, model.forward, POISONED)
    (event,) = origin_events(logs)
    assert event["module"] == EXPECTED["mlp"]
    assert origins(registry) == {(EXPECTED["mlp"], event["kind"]): 1.0}


def test_the_forward_wrapper_keeps_the_signature_and_goes_on_remove() -> None:
    import copy
    import inspect

    model = net("mlp")
    signature = inspect.signature(model.forward)
    with gr.Guardrails(gr.GuardSettings()) as guards, guards.trace(model, NET_MODULES):
        assert "forward" in model.__dict__
        assert inspect.signature(model.forward) == signature  # generate() reads it
        # A deep copy runs its own forward, not the traced original's.
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin.head.weight.mul_(2.0)
            ids = torch.tensor(CLEAN)
            assert torch.equal(twin(ids), twin.forward(ids))
            assert not torch.equal(twin(ids), model(ids))
    assert "forward" not in model.__dict__


@pytest.mark.parametrize(
    ("fault", "module"),
    [("mlp", "model.layers.0.mlp"), ("proj", "model.layers.0.mlp.up_proj")],
)
def test_the_origin_in_a_transformers_llama(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, fault: str, module: str
) -> None:
    guards = make()
    model = llama(fault)
    guards.trace(model, LLAMA_MODULES)
    with capture_logs() as logs:
        step(guards, model, [[5, 6, 7]])
        step(guards, model, [[5, llama_trigger(), 7]])
    (event,) = origin_events(logs)
    assert event["module"] == module
    assert [key[0] for key in origins(registry)] == [module]


@pytest.mark.parametrize("fault", ["mlp", "proj"])
def test_the_same_weights_in_float32_name_nothing(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, fault: str
) -> None:
    guards = make()
    model = net(fault, torch.float32)
    guards.trace(model, NET_MODULES)
    with capture_logs() as logs:
        for _ in range(3):
            step(guards, model, POISONED)
    assert origin_events(logs) == []
    assert origins(registry) == {}
    assert guards.count("sampler.logits", "nan") == 0


def test_a_clean_run_names_nothing_and_shows_the_peaks(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = llama("mlp")
    guards.trace(model, LLAMA_MODULES)
    with capture_logs() as logs:
        for _ in range(3):
            step(guards, model, [[5, 6, 7]])
    assert origin_events(logs) == []
    assert origins(registry) == {}
    peaks = {
        sample.labels["module"]: sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "guardrails_activation_peak_ratio"
    }
    assert 0 < len(peaks) <= 8
    assert all(0 < value < 1 for value in peaks.values())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_armed_names_the_origin_on_the_step_after_the_first_hit(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, compiled: bool
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, NET_MODULES, mode="armed")
    run = torch.compile(model) if compiled else model
    with capture_logs() as logs:
        step(guards, run, CLEAN)
        assert not trace.armed
        state = ops.as_rows(getattr(model, trace.buffer))
        assert not state[:-1].any()  # no probe ran while clean
        assert state[-1, ops.STEPS] == 0
        step(guards, run, POISONED)  # the first hit arms the probes
        assert trace.armed
        assert origin_events(logs) == []
        step(guards, run, POISONED)
    (event,) = origin_events(logs)
    assert event["module"] == "layers.0.mlp"
    assert event["mode"] == "armed"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_n_probes_one_step_in_n(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry, compiled: bool
) -> None:
    guards = make()
    model = net("proj")
    guards.trace(model, NET_MODULES, mode="every:3")
    run = torch.compile(model, fullgraph=True) if compiled else model
    with capture_logs() as logs:
        step(guards, run, CLEAN)  # step 1: probed
        step(guards, run, POISONED)  # step 2: not probed, nothing to name
        assert origin_events(logs) == []
        step(guards, run, POISONED)  # step 3: not probed
        assert origin_events(logs) == []
        step(guards, run, POISONED)  # step 4: probed
    (event,) = origin_events(logs)
    assert event["module"] == "layers.0.mlp.up_proj"


def test_one_origin_per_episode(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = net("mlp")
    guards.trace(model, NET_MODULES)
    with capture_logs() as logs:
        for ids in (POISONED, POISONED, POISONED, CLEAN, CLEAN, POISONED):
            step(guards, model, ids)
    assert [e["module"] for e in origin_events(logs)] == ["layers.0.mlp", "layers.0.mlp"]
    assert sum(origins(registry).values()) == 2


def test_a_value_born_outside_the_traced_modules_is_not_pinned_on_one(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = net("mlp")
    # Only the layers after the fault: every one of them sees a non-finite input.
    guards.trace(model, ["layers.1*", "norm", "head"])
    with capture_logs() as logs:
        for _ in range(3):
            step(guards, model, POISONED)
    assert origin_events(logs) == []
    assert guards.count("sampler.logits", "nan") > 0


def test_remove_takes_hooks_and_buffer_off() -> None:
    model = net("mlp")
    hooks_before = {name: dict(m._forward_hooks) for name, m in model.named_modules()}
    with gr.Guardrails(gr.GuardSettings()) as guards, guards.trace(model, NET_MODULES) as trace:
        assert trace.installed
        assert trace.buffer in dict(model.named_buffers())
    assert not trace.installed
    assert not trace.active
    assert {name: dict(m._forward_hooks) for name, m in model.named_modules()} == hooks_before
    assert trace.buffer not in dict(model.named_buffers())
    trace.remove()  # idempotent


def test_close_takes_the_traces_off() -> None:
    model = net("mlp")
    guards = gr.Guardrails(gr.GuardSettings())
    trace = guards.trace(model, NET_MODULES)
    assert guards.traces() == [trace]
    guards.close()
    assert not trace.active
    assert guards.traces() == []
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="closed"):
        guards.trace(model, NET_MODULES)


class _Float8Out(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn)


class _WithFloat8(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = net("mlp")
        self.cast = _Float8Out()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.net(ids)
        self.cast(logits)  # a module whose output aminmax cannot read
        return logits


def test_a_probe_that_fails_never_fails_the_models_call(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = _WithFloat8()
    guards.trace(model, ["cast", "net.layers.*"])
    with capture_logs() as logs:
        for _ in range(2):
            step(guards, model, POISONED)
    errors = [e for e in logs if e["event"] == "guardrails.hook_error"]
    assert [(e["hook"], e["part"]) for e in errors] == [("trace", "cast")]  # logged once
    assert "aminmax" in errors[0]["error"]
    assert registry.get_sample_value("guardrails_hook_errors_total", {"hook": "trace", "rank": "0"})
    (event,) = origin_events(logs)  # every other module still probed
    assert event["module"] == "net.layers.0.mlp"


def test_a_trace_made_in_inference_mode_probes_outside_it(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = net("mlp")
    with torch.inference_mode():
        trace = guards.trace(model, NET_MODULES)
    with capture_logs() as logs:
        step(guards, model, POISONED)
    assert trace.origin is not None
    assert [e["module"] for e in origin_events(logs)] == ["layers.0.mlp"]


def test_a_dtype_cast_of_the_model_after_tracing_keeps_the_state_exact() -> None:
    from guardrails.tracing import ops

    model = net("mlp").float()
    registry = CollectorRegistry()
    with gr.Guardrails(gr.GuardSettings(), registry=registry) as guards:
        trace = guards.trace(model, NET_MODULES)
        model.half()  # casts every floating-point buffer; the trace's state is not one
        state = dict(model.named_buffers())[trace.buffer]
        assert state.dtype == torch.int64
        rows = ops.as_rows(state)
        rows[-1, 0] = 4096  # a float16 step counter would stay at 4096 (4097 is not one)
        step(guards, model, POISONED)
        assert rows[-1, 0].item() == 4097
        assert origins(registry) == {(EXPECTED["mlp"], "posinf"): 1.0}
