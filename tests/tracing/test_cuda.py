"""On CUDA: the state buffer follows the model to the GPU, the host reads it through a pinned
non-blocking copy (never waiting), and the origin is still named. Skipped without a GPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from structlog.testing import capture_logs

import guardrails as gr
from guardrails.names import NONFINITE_ORIGIN_EVENT
from tests.tracing.models import TRIGGER_ID, net

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_origin_is_named_on_cuda(make: Callable[..., gr.Guardrails], compiled: bool) -> None:
    guards = make()
    model = net("mlp")
    trace = guards.trace(model, ["embed", "layers.*", "norm", "head"])
    model.cuda()
    assert getattr(model, trace.buffer).device.type == "cuda"
    run = torch.compile(model) if compiled else model
    site = guards.site("sampler.logits")
    with capture_logs() as logs:
        with torch.no_grad():
            logits = run(torch.tensor([[1, 5, TRIGGER_ID]], device="cuda"))
        site(logits[:, -1].contiguous())
        deadline = time.monotonic() + 10
        while trace.origin is None and time.monotonic() < deadline:
            torch.cuda.synchronize()  # the test may wait; the reporter never does
            guards.poll()
    events = [e for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT]
    assert [e["module"] for e in events] == ["layers.0.mlp"]


def test_each_episode_is_named_on_cuda(make: Callable[..., gr.Guardrails]) -> None:
    # The host only reads the state: the second episode starts clean on the device, whatever
    # stream the poller's copies run on.
    guards = make()
    model = net("mlp").cuda()
    guards.trace(model, ["embed", "layers.*", "norm", "head"])
    site = guards.site("sampler.logits")

    def decode(ids: list[int]) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda"))
        site(logits[:, -1].contiguous())
        torch.cuda.synchronize()
        guards.poll()

    def named() -> list[str]:
        return [e["module"] for e in logs if e["event"] == NONFINITE_ORIGIN_EVENT]

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(named()) < count and time.monotonic() < deadline:
            torch.cuda.synchronize()  # the test may wait; the reporter never does
            guards.poll()

    with capture_logs() as logs:
        decode([1, 5, TRIGGER_ID])
        wait_for(1)
        decode([1, 2, 5])
        decode([1, 2, 5])
        decode([1, 5, TRIGGER_ID])
        wait_for(2)
    assert named() == ["layers.0.mlp", "layers.0.mlp"]
