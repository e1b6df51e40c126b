"""The tracer after its first episode: a dropped model is freed, every episode starts clean,
a step judges only the modules it called and every call of each, a mask's -inf is never an
origin, and SGLang-shaped layers (int64 positions first, tuples out) are judged by their
hidden states."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from torch import nn

import guardrails as gr
from guardrails.names import NONFINITE_ORIGIN_EVENT
from tests.tracing.models import (
    Branches,
    Masked,
    NegativeOverflow,
    SglangLike,
    Twice,
    hidden,
    net,
)
from tests.tracing.test_origin import NET_MODULES, POISONED, step


def run(guards: gr.Guardrails, model: nn.Module, *args: Any) -> None:
    """One decode step of a toy model: the model, then the sampler's site, then a poll."""
    with torch.no_grad():
        logits = model(*args)
    guards.site("sampler.logits")(logits.float().contiguous())
    guards.poll()


def named(logs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    return [(e["module"], e["kind"]) for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT]


def poll_errors(registry: CollectorRegistry) -> float:
    labels = {"stage": "poll", "rank": "0"}
    return registry.get_sample_value("guardrails_reporting_errors_total", labels) or 0.0


def test_a_dropped_model_is_collected_and_its_trace_forgotten(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, NET_MODULES)
    step(guards, model, POISONED)  # probed, read and reported: every holder has had its turn
    assert trace.origin is not None
    model_ref, trace_ref = weakref.ref(model), weakref.ref(trace)
    del model, trace
    gc.collect()
    assert model_ref() is None
    assert trace_ref() is None  # neither the service nor the reporter holds it
    assert guards.traces() == []
    guards.poll()
    assert poll_errors(registry) == 0


def test_a_trace_held_by_its_caller_ends_with_its_model(
    make: Callable[..., gr.Guardrails], registry: CollectorRegistry
) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, NET_MODULES)
    step(guards, model, POISONED)
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None
    assert not trace.active
    assert not trace.installed
    assert guards.traces() == []
    guards.poll()
    assert poll_errors(registry) == 0
    trace.remove()  # still idempotent


def test_an_episode_born_outside_the_traced_modules_leaves_the_next_one_named(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = Branches()
    guards.trace(model, ["main", "head"])  # `side` is not traced
    with capture_logs() as logs:
        run(guards, model, hidden(poisoned=True), True)  # born in `side`: nothing to name
        assert named(logs) == []
        for _ in range(2):
            run(guards, model, hidden())
        run(guards, model, hidden(poisoned=True))  # born in `main`
    assert named(logs) == [("main", "nan")]


def test_a_module_not_called_in_a_step_is_not_judged_for_it(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = Branches()
    guards.trace(model, ["side", "main", "head"])
    with capture_logs() as logs:
        run(guards, model, hidden(poisoned=True), True)  # born in `side`
        for _ in range(2):
            run(guards, model, hidden())  # `side` not called: its NaN is not this step's
        run(guards, model, hidden(poisoned=True))  # born in `main`; `side` never ran
    assert named(logs) == [("side", "nan"), ("main", "nan")]


def test_every_call_of_a_module_is_judged(make: Callable[..., gr.Guardrails]) -> None:
    guards = make()
    model = Twice()
    trace = guards.trace(model, ["shared", "head"])
    with capture_logs() as logs:
        run(guards, model, hidden())
        run(guards, model, hidden(poisoned=True))  # the first call is born NaN, the last clean
    assert named(logs) == [("shared", "nan")]
    assert trace.origin is not None
    assert trace.origin.step == 2


def test_a_mask_that_writes_neginf_is_never_the_origin(
    make: Callable[..., gr.Guardrails],
) -> None:
    guards = make()
    model = Masked()
    guards.trace(model, ["mask", "poison", "head"])
    with capture_logs() as logs:
        run(guards, model, hidden())  # the mask's -inf from step 1 on
        run(guards, model, hidden(poisoned=True))
        run(guards, model, hidden())
        run(guards, model, hidden())
        run(guards, model, hidden(poisoned=True))
    assert named(logs) == [("poison", "nan"), ("poison", "nan")]


def test_a_negative_overflow_is_named_as_neginf(make: Callable[..., gr.Guardrails]) -> None:
    guards = make()
    model = NegativeOverflow().half()
    guards.trace(model, ["scale", "center", "head"])
    x = hidden().half() / 10  # at most -1e4 after the scale: finite in float16
    with capture_logs() as logs:
        run(guards, model, x)
        x[0, 5] = 1.0  # -1e5: -inf in float16, and NaN once centred
        run(guards, model, x)
    assert named(logs) == [("scale", "neginf")]


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [(["layers.*"], []), (["embed", "layers.*"], [("embed", "nan")])],
    ids=["born-outside", "born-in-embed"],
)
def test_sglang_shaped_layers_are_judged_by_their_hidden_states(
    make: Callable[..., gr.Guardrails], patterns: list[str], expected: list[tuple[str, str]]
) -> None:
    # The layers take int64 positions first and return (hidden_states, residual): their
    # input is the hidden states, which already hold the NaN `embed` made.
    guards = make()
    model = SglangLike()
    guards.trace(model, patterns)
    with capture_logs() as logs:
        run(guards, model, hidden())
        run(guards, model, hidden(poisoned=True))
    assert named(logs) == expected
    assert guards.count("sampler.logits", "nan") > 0
