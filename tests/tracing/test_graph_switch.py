"""Under a CUDA graph the switch is device state: a replay honours `armed` and `every:N`.

No Python runs at a replay, so what a capture records must read the switch on the device
(`guardrails.tracing.ops`: the gated bodies). On the CPU, `ops.simulate_capture()` runs those
same bodies at every call, which is what every replay of a captured call does; the CUDA tests
capture a real `torch.cuda.CUDAGraph` (skipped without a GPU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from structlog.testing import capture_logs

import guardrails as gr
from guardrails.names import NONFINITE_ORIGIN_EVENT
from guardrails.tracing import ops
from tests.tracing.models import TRIGGER_ID, net

MODULES = ["embed", "layers.*", "norm", "head"]
CLEAN = [[1, 2, 5]]
POISONED = [[1, 5, TRIGGER_ID]]


def state_of(model: torch.nn.Module, trace: object) -> torch.Tensor:
    return ops.as_rows(getattr(model, trace.buffer))  # type: ignore[attr-defined]


@pytest.fixture
def replays() -> Iterator[None]:
    with ops.simulate_capture():
        yield


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_armed_trace_probes_replays_only_after_its_first_hit(
    make: Callable[..., gr.Guardrails], compiled: bool, replays: None
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, MODULES, mode="armed")
    run = torch.compile(model, fullgraph=True) if compiled else model
    state = state_of(model, trace)
    with torch.no_grad():
        run(torch.tensor(POISONED))  # before any hit: the device switch is off
    assert state[-1, ops.STEPS] == 0
    assert state[-1, ops.EPISODES] == 0
    assert not state[:-1].any()
    trace.hit("sampler.logits")  # what the reporter does at a site's first non-finite count
    assert state[-1, ops.SWITCH_ON] == 1
    with torch.no_grad():
        run(torch.tensor(POISONED))
    assert state[-1, ops.STEPS] == 1
    assert state[-1, ops.EPISODES] == 1
    rows = trace.read()
    assert rows is not None
    origin = trace.resolve(rows)
    assert origin is not None
    assert origin.module == "layers.0.mlp"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_n_probes_one_replay_in_n(
    make: Callable[..., gr.Guardrails], compiled: bool, replays: None
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, MODULES, mode="every:3")
    run = torch.compile(model, fullgraph=True) if compiled else model
    state = state_of(model, trace)
    with torch.no_grad():
        for _ in range(7):
            run(torch.tensor(CLEAN))
    assert state[-1, ops.STEPS] == 3  # calls 1, 4 and 7
    with torch.no_grad():
        run(torch.tensor(POISONED))  # call 8: not probed
    assert state[-1, ops.EPISODES] == 0
    with torch.no_grad():
        run(torch.tensor(POISONED))  # call 9: not probed
        run(torch.tensor(POISONED))  # call 10: probed
    assert state[-1, ops.EPISODES] == 1


def test_an_always_trace_records_the_plain_bodies(
    make: Callable[..., gr.Guardrails], replays: None
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, MODULES)
    state = state_of(model, trace)
    with torch.no_grad():
        for _ in range(3):
            model(torch.tensor(CLEAN))
    assert state[-1, ops.STEPS] == 3


@pytest.mark.cuda
def test_a_captured_armed_trace_names_the_origin_after_its_first_hit(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = net("mlp").cuda()
    trace = guards.trace(model, MODULES, mode="armed")
    site = guards.site("sampler.logits")
    ids = torch.tensor(CLEAN, device="cuda")
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture, as engines do
                model(ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(ids)

    def replay(words: list[list[int]]) -> None:
        ids.copy_(torch.tensor(words, device="cuda"))
        graph.replay()
        site(logits[:, -1].contiguous())
        torch.cuda.synchronize()  # the test may wait; the reporter never does
        guards.poll()

    with capture_logs() as logs:
        replay(CLEAN)
        replay(POISONED)  # the first hit: arms the trace (its device switch)
        deadline = time.monotonic() + 10
        while not trace.armed and time.monotonic() < deadline:
            guards.poll()
        assert trace.armed
        assert [e for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT] == []
        for _ in range(20):
            replay(POISONED)
            if trace.origin is not None:
                break
    events = [e for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT]
    assert [e["module"] for e in events] == ["layers.0.mlp"]


@pytest.mark.cuda
def test_a_captured_every_n_trace_probes_one_replay_in_n(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = net("mlp").cuda()
    trace = guards.trace(model, MODULES, mode="every:2")
    ids = torch.tensor(CLEAN, device="cuda")
    with torch.no_grad():
        model(ids)  # warm-up: one call outside the capture (the host's count)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(ids)
    state = state_of(model, trace)
    before = state[-1, ops.STEPS].item()
    for _ in range(6):
        graph.replay()
    torch.cuda.synchronize()
    assert state[-1, ops.STEPS].item() - before == 3
