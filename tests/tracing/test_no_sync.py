"""The probes never make the host wait: no `.item()`, no `bool(tensor)`, no host copy on
the path a traced forward takes, seen by a TorchFunctionMode that records every call."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import guardrails as gr
from guardrails.tracing.ops import IMPLEMENTATIONS
from tests.tracing.models import TRIGGER_ID, AlwaysProbing, net

SYNCS = {"item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "nonzero"}


class Recorder(TorchFunctionMode):
    """Records every torch call; guardrails' trace ops run their bodies under the recorder
    (a mode is off inside its own handler, so an op's insides would go unseen)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        self.names.append(name)
        body = IMPLEMENTATIONS.get(name.partition(".")[0])
        if body is not None:
            with self:
                return body(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def forward_calls(mode: str, ids: list[list[int]]) -> list[str]:
    model = net("mlp")
    with gr.Guardrails(gr.GuardSettings()) as guards:
        guards.trace(model, ["embed", "layers.*", "norm", "head"], mode=mode)
        with torch.no_grad():
            model(torch.tensor(ids))  # the first call: nothing left to warm up
            recorder = Recorder()
            with recorder:
                model(torch.tensor(ids))
    return recorder.names


def test_a_traced_forward_makes_no_host_sync() -> None:
    for ids in ([[1, 2, 5]], [[1, 5, TRIGGER_ID]]):
        names = forward_calls("always", ids)
        # The recorder sees inside the probes (else this test could not fail).
        assert names.count("aminmax") >= 2 * 9
        assert not SYNCS & set(names), sorted(SYNCS & set(names))


def test_an_every_n_forward_makes_no_host_sync() -> None:
    names = forward_calls("every:2", [[1, 5, TRIGGER_ID]])
    assert not SYNCS & set(names)


def test_the_ops_pass_opcheck() -> None:
    from guardrails.tracing import ops

    tracer = AlwaysProbing()
    key = ops.register(tracer)
    state = ops.new_state(4, torch.device("cpu"))
    x = torch.randn(2, 3, dtype=torch.float16)
    y = torch.full((2, 3), float("inf"), dtype=torch.float16)
    torch.library.opcheck(torch.ops.guardrails.trace_probe_.default, (state, x, y, 1, key))
    torch.library.opcheck(torch.ops.guardrails.trace_probe_.default, (state, None, y, 2, key))
    torch.library.opcheck(torch.ops.guardrails.trace_step_.default, (state, key))
    torch.library.opcheck(torch.ops.guardrails.trace_latch_.default, (state, key))
    # opcheck runs on copies; the ops themselves, in order:
    torch.ops.guardrails.trace_step_(state, key)
    torch.ops.guardrails.trace_probe_(state, x, y, 1, key)
    torch.ops.guardrails.trace_latch_(state, key)
    rows = ops.as_rows(state)
    assert rows[1, 4:7].tolist() == [1.0, 0.0, 2.0]  # step 1, finite input, +inf output
    assert rows[2, 4] == 0  # a row never written stays unlatched
