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
