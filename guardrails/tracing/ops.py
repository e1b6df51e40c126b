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
(some output held NaN or +Inf), 2 counts the episodes started; 3-6 are the switch as the
device reads it under a CUDA graph (see below): 3 on (1: probe; an armed trace's is 0 until
its first hit), 4 N of `every:N` (1 otherwise), 5 the model calls counted on the device,
6 whether the current call is probed.

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
stays opaque, so the switch is read at run time, not baked into the graph. Eager hooks call
the bodies (`write_step`, `write_probe`, `write_latch`) directly, as eager sites call their
kernels: even the ops' bare dispatcher round trip (about 2.5 us on the CPU, see `_LIBRARY`)
is paid only where the compiler needs an opaque op.

Under a CUDA graph (vLLM's and SGLang's decode graphs) no Python runs at replay: what was
captured replays. A host switch read at capture would freeze it (an armed trace captured
before its hit would never probe; `every:N` would probe every replay or none). So while a
stream is capturing, a trace that is not `always` records the gated bodies (`gated_step`,
`gated_probe`, `gated_latch`): they read the switch from the state on the device (columns
3-6 of the last row) and compute every call, writing only on a probed one. A replay thus
honours `armed` (the host's `switch_on` writes column 3 once, at the first hit: the one word
the host ever writes, which no device body writes) and `every:N` (counted on the device, one
probed replay in N). What a replay costs is the full probe's, whether it writes or not: a
graph cannot skip a kernel it captured. Calls outside a capture keep the host switch and cost
nothing while it is off. An `always` trace's eager hooks record the plain bodies; compiled
code records the gated ones for every trace (the op cannot see the mode), which with an
`always` trace's switch (on, every 1) do what the plain ones do.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Final, Protocol

import torch

from guardrails import _process
from guardrails._cuda import capturing_on, outside_captures, side_streams

__all__ = [
    "COLUMNS",
    "EPISODES",
    "IMPLEMENTATIONS",
    "STEPS",
    "Probed",
    "as_rows",
    "capturing",
    "gated_latch",
    "gated_probe",
    "gated_step",
    "init_switch",
    "kind_bits",
    "latch",
    "new_state",
    "probe",
    "register",
    "simulate_capture",
    "step",
    "switch_on",
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
SWITCH_ON: Final = 3
_EVERY: Final = 4
_CALLS: Final = 5
_NOW: Final = 6
_INF: Final = float("inf")
# Tests: run the gated bodies as a capture would, on any device (`simulate_capture`).
_SIMULATED = threading.local()


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


def init_switch(state: torch.Tensor, *, on: bool, every: int) -> None:
    """Write the device switch of a new state (float64 rows): on or off, one call in `every`."""
    state[-1, SWITCH_ON] = 1.0 if on else 0.0
    state[-1, _EVERY] = float(every)


def switch_on(state: torch.Tensor) -> None:
    """Turn the device switch on (an armed trace's first hit). The host's one write: a word
    no device body writes; a replay that reads it before the write lands probes from the
    next one. On CUDA the write goes on guardrails' side stream, outside any capture."""
    if state.device.type != "cuda":
        state[-1, SWITCH_ON] = 1.0
        return
    with outside_captures(), side_streams([state.device]):
        state[-1, SWITCH_ON].fill_(1.0)


def capturing(state: torch.Tensor) -> bool:
    """Whether calls on `state` are being captured into a CUDA graph now (or a test
    simulates it): the gated bodies must be recorded then."""
    if getattr(_SIMULATED, "on", False):
        return True
    return capturing_on(state.device)


@contextlib.contextmanager
def simulate_capture() -> Iterator[None]:
    """Tests: the calling thread runs the gated bodies, as a CUDA graph's capture records
    them, on any device (what each replay then does is what each call here does)."""
    _SIMULATED.on = True
    try:
        yield
    finally:
        _SIMULATED.on = False


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
    if tracer is None or tracer.is_off(row):
        return
    gated = capturing(state)
    if not (gated or tracer.probing):
        return
    tracer.saw(row, output.dtype)
    try:
        (gated_probe if gated else write_probe)(state, input, output, row)
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
    # `max < inf` is False for NaN and +Inf alike (a NaN makes aminmax's max NaN).
    torch.where(old[_OUT_MAX] < _INF, _min_max(input, output), old, out=old)


def gated_probe(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int
) -> None:
    """`write_probe` that writes only in a call the device switch probes (see the module
    docstring: what a CUDA graph records for a trace that is not `always`)."""
    if output.numel() == 0:
        return
    old = state[row, :_FIRST]
    write = (old[_OUT_MAX] < _INF) & (state[-1, _NOW] > 0)
    torch.where(write, _min_max(input, output), old, out=old)


def _min_max(input: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
    """(input min, input max, output min, output max); the input's are 0 without one."""
    if input is None or input.numel() == 0:
        low, high = torch.aminmax(output.detach())
        zero = torch.zeros_like(low)  # of one dtype with the rest: a faster stack
        return torch.stack((zero, zero, low, high))
    return torch.stack((*torch.aminmax(input.detach()), *torch.aminmax(output.detach())))


def trace_probe_(
    state: torch.Tensor, input: torch.Tensor | None, output: torch.Tensor, row: int, key: str
) -> None:
    """`guardrails::trace_probe_`'s kernel: `probe` on the float64 rows, unless the tracer is
    gone, or off and no stream captures (the armed trace's common case: a dict look-up, two
    attribute reads)."""
    tracer = _tracer(key)
    if tracer is None or not (tracer.probing or capturing(state)):
        return
    probe(as_rows(state), input, output, row, key)


def step(state: torch.Tensor, key: str) -> None:
    """A traced forward starts: count the step and clear the rows' per-step columns (on the
    device: graph replays do it too)."""
    tracer = _tracer(key)
    if tracer is None:
        return
    if capturing(state):
        gated_step(state)
        return
    tracer.step()
    if tracer.probing:
        write_step(state)


def write_step(state: torch.Tensor) -> None:
    """The step itself (see `step`)."""
    state[-1, STEPS] += 1
    state[:-1, :_FIRST] = 0


def gated_step(state: torch.Tensor) -> None:
    """The step as the device switch decides it: count the call, probe it when the switch is
    on and it is the first of `every` (columns 3-6 of the last row), and then do `write_step`'s
    work; otherwise leave the rows alone."""
    meta = state[-1]
    now = (meta[SWITCH_ON] > 0) & (torch.remainder(meta[_CALLS], meta[_EVERY]) == 0)
    now_value = now.double()
    meta[_CALLS : _NOW + 1] = torch.stack((meta[_CALLS] + 1, now_value))
    meta[STEPS] += now_value
    rows = state[:-1, :_FIRST]
    torch.where(now, torch.zeros_like(rows), rows, out=rows)


def trace_step_(state: torch.Tensor, key: str) -> None:
    """`guardrails::trace_step_`'s kernel (`step` on the float64 rows)."""
    step(as_rows(state), key)


def latch(state: torch.Tensor, key: str) -> None:
    """A traced forward ended: start an episode at its first bad step, track -inf writers and
    the peaks."""
    tracer = _tracer(key)
    if tracer is None:
        return
    if capturing(state):
        gated_latch(state)
    elif tracer.probing:
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


def gated_latch(state: torch.Tensor) -> None:
    """`write_latch` in a call the device switch probes; nothing otherwise (it latches a copy
    and keeps it only then: the state is a few hundred bytes)."""
    latched = state.clone()
    write_latch(latched)
    torch.where(state[-1, _NOW] > 0, latched, state, out=state)


def trace_latch_(state: torch.Tensor, key: str) -> None:
    """`guardrails::trace_latch_`'s kernel (`latch` on the float64 rows)."""
    latch(as_rows(state), key)


def _no_output(*args: object) -> None:
    """Every op's fake kernel: the ops write only `state` and return nothing."""


# The ops are defined on a `torch.library.Library` fragment, their kernels registered for
# every backend (CompositeExplicitAutograd: opaque to the compiler, one Python kernel): a call
# from compiled code costs the dispatcher's round trip to the kernel, about 4-5 us on the CPU,
# where `torch.library.custom_op`'s Python wrapper around the same kernel cost 11-28 us
# (measured on 2 cores, 20 calls in one compiled graph). That wrapper adds the autograd and
# version-counter handling the ops do not need: they return nothing, and `state` is an
# integer buffer no gradient reaches. Dynamo functionalizes them as it does any op whose
# schema declares its mutation (`Tensor(a!)`).
def _define_ops() -> torch.library.Library:
    library = torch.library.Library("guardrails", "FRAGMENT")  # type: ignore[no-untyped-call]
    for schema, kernel in (
        (
            "trace_probe_(Tensor(a!) state, Tensor? input, Tensor output, int row, str key) -> ()",
            trace_probe_,
        ),
        ("trace_step_(Tensor(a!) state, str key) -> ()", trace_step_),
        ("trace_latch_(Tensor(a!) state, str key) -> ()", trace_latch_),
    ):
        name = schema.partition("(")[0]
        library.define(schema)  # type: ignore[no-untyped-call]
        library.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"guardrails::{name}", _no_output, lib=library)
    return library


_LIBRARY: Final = _define_ops()  # held for the life of the process: it owns the ops


# Each op's body by op name: what a test runs under a recording mode to see inside the op.
IMPLEMENTATIONS: Final[dict[str, Callable[..., None]]] = {
    "trace_probe_": probe,
    "trace_step_": step,
    "trace_latch_": latch,
}
