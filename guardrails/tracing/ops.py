"""The probes as PyTorch operators, so that a compiled model traces as an eager one does.

    guardrails::trace_probe_(Tensor(a!) state, Tensor? input, Tensor output, int row, str key)
    guardrails::trace_step_(Tensor(a!) state, str key)
    guardrails::trace_latch_(Tensor(a!) state, str key)

`state` is one float64 buffer per traced model, `[modules + 1, 8]` (a non-persistent buffer
of the model, so it follows `.to()`). Row `i < modules`, columns:

    0 1   min, max of module i's input at its latest call (0, 0: not read / not floating)
    2 3   min, max of its output at its latest call
    4     the step at which its output was first non-finite (0: never, since the last reset)
    5 6   input and output kinds at that step (bits: 1 nan, 2 +inf, 4 -inf)
    7     largest finite |output| seen (the early-warning peak)

Row `modules`, column 0 is the step counter. `trace_probe_` is one `aminmax` of the output
(and of the input), written into row `row`: one read each, no host sync. `trace_step_` (the
model's forward pre-hook) counts the step; `trace_latch_` (its forward hook) folds the step's
rows into columns 4-7 with a few vectorised operations over all rows, so a module's per-call
cost does not grow with what is latched. Nothing here reads a value on the host.

`key` names the tracer (`register()`), whose host-side switch (`armed`, `every:N`) the ops
consult in Python: under `torch.compile` the op stays opaque, so the switch is read at run
time, not baked into the graph. Under a CUDA graph the captured kernels replay as captured.
Eager hooks call the bodies (`write_probe`, `write_latch`) directly, as eager sites call
their kernels: the dispatcher's round trip through a Python custom op costs more than the
probe itself on the CPU (about 60 us against 40 us, measured).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Final, Protocol

import torch

from guardrails import _process

__all__ = [
    "COLUMNS",
    "IMPLEMENTATIONS",
    "Probed",
    "as_rows",
    "kind_bits",
    "latch",
    "new_state",
    "probe",
    "register",
    "step",
    "trace_latch_",
    "trace_probe_",
    "trace_step_",
    "write_latch",
    "write_probe",
]

COLUMNS: Final = 8
_IN_MIN, _IN_MAX, _OUT_MIN, _OUT_MAX, _FIRST, _IN_BITS, _OUT_BITS, _PEAK = range(COLUMNS)
_INF: Final = float("inf")


class Probed(Protocol):
    """What the ops ask of a tracer: whether this step is probed, and to note a dtype."""

    @property
    def probing(self) -> bool: ...

    def step(self) -> None:
        """A traced forward starts (every:N counts here)."""
        ...

    def saw(self, row: int, dtype: torch.dtype) -> None:
        """Row `row`'s output had `dtype` (host metadata, for the origin event)."""
        ...

    def failed(self, row: int, error: Exception) -> None:
        """Probing row `row` raised (a dtype `aminmax` lacks): count it, stop probing it."""
        ...

    def is_off(self, row: int) -> bool:
        """Whether row `row` stopped probing after a failure."""
        ...


_TRACERS: dict[str, weakref.ref[Probed]] = {}
_KEYS = itertools.count(1)
_LOCK = _process.module_lock(__name__, "_LOCK")


def register(tracer: Probed) -> str:
    """A key for `tracer`, held weakly: a removed tracer's compiled graphs probe nothing."""
    with _LOCK:
        key = f"t{next(_KEYS)}"
        _TRACERS[key] = weakref.ref(tracer, _forget(key))
    return key


def _forget(key: str) -> Callable[[weakref.ref[Probed]], None]:
    def forget(_ref: weakref.ref[Probed]) -> None:
        _TRACERS.pop(key, None)

    return forget


def _tracer(key: str) -> Probed | None:
    ref = _TRACERS.get(key)
    return None if ref is None else ref()


def new_state(rows: int, device: torch.device) -> torch.Tensor:
    """A trace's state: `rows` x COLUMNS float64 values, held as int64 words.

    The model holds it as a buffer, so it moves with `model.to(device)`; as an integer tensor
    no dtype cast of the model (`model.half()`, `.to(torch.bfloat16)`) touches it, where a
    float64 buffer would become float16 and its step counter stop at 2048. `as_rows` is the
    float64 view every body reads and writes (all zero words are 0.0).
    """
    return torch.zeros(rows, COLUMNS, dtype=torch.int64, device=device)


def as_rows(state: torch.Tensor) -> torch.Tensor:
    """The float64 view of a state made by `new_state` (the same memory)."""
    return state.view(torch.float64)


def kind_bits(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Bits 1 nan, 2 +inf, 4 -inf from a (min, max) pair (elementwise; NaN wins both)."""
    nan = torch.isnan(low) | torch.isnan(high)
    posinf = high == _INF
    neginf = low == -_INF
    return nan.double() + 2 * posinf.double() + 4 * neginf.double()


def _minmax_into(state: torch.Tensor, row: int, column: int, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor.detach())
    state[row, column : column + 2] = torch.stack((low, high))


def probe(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int, key: str
) -> None:
    """Write min/max of `output` (and `input`) into row `row` of `state` (the body of
    `trace_probe_`)."""
    tracer = _tracer(key)
    if tracer is None or not tracer.probing or tracer.is_off(row):
        return
    tracer.saw(row, output.dtype)
    try:
        write_probe(state, input, output, row)
    except Exception as exc:  # never the model's call that fails because of a probe
        tracer.failed(row, exc)


def write_probe(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int
) -> None:
    """The probe itself: min/max of `output` (and `input`) into row `row` of `state`."""
    if input is not None:
        _minmax_into(state, row, _IN_MIN, input)
    _minmax_into(state, row, _OUT_MIN, output)


@torch.library.custom_op("guardrails::trace_probe_", mutates_args=("state",))
def trace_probe_(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int, key: str
) -> None:
    probe(as_rows(state), input, output, row, key)


@trace_probe_.register_fake
def _trace_probe_fake(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int, key: str
) -> None:
    return None


def step(state: torch.Tensor, key: str) -> None:
    """A traced forward starts: count the step (on the device: graph replays count too)."""
    tracer = _tracer(key)
    if tracer is None:
        return
    tracer.step()
    if tracer.probing:
        state[-1, 0] += 1


@torch.library.custom_op("guardrails::trace_step_", mutates_args=("state",))
def trace_step_(state: torch.Tensor, key: str) -> None:
    step(as_rows(state), key)


@trace_step_.register_fake
def _trace_step_fake(state: torch.Tensor, key: str) -> None:
    return None


def latch(state: torch.Tensor, key: str) -> None:
    """A traced forward ended: latch each row's first non-finite step, track the peaks."""
    tracer = _tracer(key)
    if tracer is None or not tracer.probing:
        return
    write_latch(state)


def write_latch(state: torch.Tensor) -> None:
    """The latch itself (see `latch`)."""
    rows = state[:-1]
    step = state[-1, 0]
    out_bits = kind_bits(rows[:, _OUT_MIN], rows[:, _OUT_MAX])
    fresh = (out_bits > 0) & (rows[:, _FIRST] == 0)
    in_bits = kind_bits(rows[:, _IN_MIN], rows[:, _IN_MAX])
    latched = torch.stack((step.expand_as(out_bits), in_bits, out_bits), dim=1)
    rows[:, _FIRST:_PEAK] = torch.where(fresh.unsqueeze(1), latched, rows[:, _FIRST:_PEAK])
    peak = torch.maximum(rows[:, _OUT_MIN].abs(), rows[:, _OUT_MAX].abs())
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    rows[:, _PEAK] = torch.maximum(rows[:, _PEAK], peak)


@torch.library.custom_op("guardrails::trace_latch_", mutates_args=("state",))
def trace_latch_(state: torch.Tensor, key: str) -> None:
    latch(as_rows(state), key)


@trace_latch_.register_fake
def _trace_latch_fake(state: torch.Tensor, key: str) -> None:
    return None


# Each op's body by op name: what a test runs under a recording mode to see inside the op.
IMPLEMENTATIONS: Final[dict[str, Callable[..., None]]] = {
    "trace_probe_": probe,
    "trace_step_": step,
    "trace_latch_": latch,
}
