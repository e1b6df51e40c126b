"""The probes as PyTorch operators, so that a compiled model traces as an eager one does.

    guardrails::trace_probe_(Tensor(a!) state, Tensor? input, Tensor output, int row, str key)
    guardrails::trace_step_(Tensor(a!) state, str key)
    guardrails::trace_latch_(Tensor(a!) state, str key)

`state` is one float64 buffer per traced model, `[modules + 1, 9]` (a non-persistent buffer
of the model, so it follows `.to()`). Row `i < modules`, columns:

    0 1   min, max of module i's input at its judged call this step (0, 0: none, not floating)
    2 3   min, max of its output at that call (0, 0: not called this step)
    4     the step the current episode started at, if its output was non-finite then (0: not)
    5 6   input and output kinds at that step (bits: 1 nan, 2 +inf, 4 -inf)
    7     largest finite |output| seen (the early-warning peak)
    8     1 once its output held -inf in a probed step with no NaN/+Inf anywhere (a mask)

Row `modules`: column 0 counts the probed steps, 1 is 1 when the latest probed step was bad
(some output held NaN or +Inf), 2 counts the episodes started.

- `trace_step_` (the model's forward pre-hook) counts the step and zeroes columns 0-3: a
  module not called in a step is judged clean for it, never by an older call's values.
- `trace_probe_` (each traced module's forward hook) is one `aminmax` of the output and one of
  the input, written into row `row`: every call of a module is judged, and the first whose
  output held NaN/+Inf wins (later calls leave its values); else the latest call stands (the
  peak is that of the latest call of a step, for a module called several times in one).
- `trace_latch_` (the model's forward hook) folds the step into columns 4-8 with a few
  vectorised operations over all rows. An *episode* is a run of probed steps that are all bad;
  at the first step of one (the previous probed step was not bad) the latches are replaced by
  that step's rows, and later steps of the episode change nothing. Every episode therefore
  starts clean, on the device, in stream order: the host never writes the state.

Nothing here reads a value on the host. `key` names the tracer (`register()`), whose
host-side switch (`armed`, `every:N`) the ops consult in Python: under `torch.compile` the op
stays opaque, so the switch is read at run time, not baked into the graph. Under a CUDA graph
the captured kernels replay as captured. Eager hooks call the bodies (`write_step`,
`write_probe`, `write_latch`) directly, as eager sites call their kernels: the dispatcher's
round trip through a Python custom op costs more than the probe itself on the CPU (about
60 us against 40 us, measured).
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
    "EPISODES",
    "IMPLEMENTATIONS",
    "STEPS",
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
    "write_step",
]

COLUMNS: Final = 9
_IN_MIN, _IN_MAX, _OUT_MIN, _OUT_MAX, _FIRST, _IN_BITS, _OUT_BITS, _PEAK, _MASK = range(COLUMNS)
# The last row's columns.
STEPS: Final = 0
_BAD: Final = 1
EPISODES: Final = 2
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


def probe(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int, key: str
) -> None:
    """Fold min/max of `output` (and `input`) into row `row` of `state` (the body of
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
    """The probe itself: one `aminmax` of `output` and one of `input` into row `row` of
    `state`, unless an earlier call of this step put NaN/+Inf there (the first such call is
    the one judged; as cheap as an unconditional write, measured)."""
    if output.numel() == 0:
        return
    old = state[row, :_FIRST]
    if input is None or input.numel() == 0:
        low, high = torch.aminmax(output.detach())
        zero = torch.zeros_like(low)  # of one dtype with the rest: a faster stack
        new = torch.stack((zero, zero, low, high))
    else:
        new = torch.stack((*torch.aminmax(input.detach()), *torch.aminmax(output.detach())))
    # `max < inf` is False for NaN and +Inf alike (a NaN makes aminmax's max NaN).
    torch.where(old[_OUT_MAX] < _INF, new, old, out=old)


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
    """A traced forward starts: count the step and clear the rows' per-step columns (on the
    device: graph replays do it too)."""
    tracer = _tracer(key)
    if tracer is None:
        return
    tracer.step()
    if tracer.probing:
        write_step(state)


def write_step(state: torch.Tensor) -> None:
    """The step itself (see `step`)."""
    state[-1, STEPS] += 1
    state[:-1, :_FIRST] = 0


@torch.library.custom_op("guardrails::trace_step_", mutates_args=("state",))
def trace_step_(state: torch.Tensor, key: str) -> None:
    step(as_rows(state), key)


@trace_step_.register_fake
def _trace_step_fake(state: torch.Tensor, key: str) -> None:
    return None


def latch(state: torch.Tensor, key: str) -> None:
    """A traced forward ended: start an episode at its first bad step, track -inf writers and
    the peaks."""
    tracer = _tracer(key)
    if tracer is None or not tracer.probing:
        return
    write_latch(state)


def write_latch(state: torch.Tensor) -> None:
    """The latch itself (see `latch` and the module docstring)."""
    rows = state[:-1]
    meta = state[-1]
    out_min, out_max = rows[:, _OUT_MIN], rows[:, _OUT_MAX]
    out_bits = kind_bits(out_min, out_max)
    in_bits = kind_bits(rows[:, _IN_MIN], rows[:, _IN_MAX])
    bad = (out_max < _INF).logical_not().any()  # some output held NaN or +Inf
    start = bad & (meta[_BAD] == 0)
    # A step counter left at 0 (an armed trace switched on in the middle of a call) would
    # read as "not latched".
    at = torch.where(out_bits > 0, meta[STEPS].clamp(min=1), 0.0)
    latched = torch.stack((at, in_bits, out_bits), dim=1)
    rows[:, _FIRST:_PEAK] = torch.where(start, latched, rows[:, _FIRST:_PEAK])
    peak = torch.maximum(out_min.abs(), out_max.abs())
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    mask = (out_min == -_INF) & bad.logical_not()
    rows[:, _PEAK:] = torch.stack(
        (torch.maximum(rows[:, _PEAK], peak), torch.maximum(rows[:, _MASK], mask.double())), dim=1
    )
    # Last: a CPU reader reads this row first (`Trace.read`), so a new episode's count
    # comes with its rows.
    meta[_BAD : EPISODES + 1] = torch.stack((bad.double(), meta[EPISODES] + start.double()))


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
