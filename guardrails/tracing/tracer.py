"""`Trace`: detect-only probes on a model's modules, and the origin report they feed.

    with guards.trace(model, modules=["model.layers.*"]) as trace:
        model(input_ids)            # probes write device flags; nothing waits
    trace.origin                    # the latest origin reported (or None)

What a call costs: per traced module, one forward hook that calls one custom op
(`guardrails.tracing.ops`): an `aminmax` of its output and one of its input, written into a
row of a buffer on the model's device; per model call, its `forward` wrapped (on the
instance: engines that call `model.forward(...)` directly, as SGLang's runner, run no hook of
the model's own) to count the step before it and fold the rows into latched flags after it,
with a few vectorised operations. No host sync,
no allocation that grows with the model's tensors, the same ops under `torch.compile`.

The host looks only when the reporter does (`Reporter.poll`, every `reporting.every_calls`
site calls, and its poller): on the CPU the buffer is read directly; on CUDA a non-blocking
copy into pinned memory is started and the newest completed copy read, as for the sites'
counts. The host only reads: an episode (a run of steps where some traced output held NaN or
+Inf) starts clean on the device (`guardrails.tracing.ops`), so nothing is written from the
poller's thread or stream. The trace keeps its own episode state, advanced once per report
pass (`Trace.report`, which says what to count and show; the reporter delivers it). A
site's non-finite hit marks an origin as wanted; the next read
that holds an episode not yet resolved reports its origin (event `guardrails.nonfinite_origin`,
counter `guardrails_nonfinite_origin_total`): once per episode, the latest one the host sees.
The peaks feed the gauge `guardrails_activation_peak_ratio` for at most `PEAK_SERIES` modules.

A probe judges floating-point tensors only: its input is a module's first floating-point
positional argument (SGLang's layers take int64 `positions` first) or else its
`hidden_states` keyword; its output is the first floating-point tensor of what the module
returns (SGLang's linear layers return `(output, bias)`, its norms `(x, residual)`).

The model is held weakly and the trace lives as long as the model's hooks: a model dropped
(`transformers serve` unloading an idle one) is collected, its trace ends with it, and the
service and the reporter, which hold traces weakly, forget it.

Modes: `always`; `armed` probes nothing until a site's first hit (its hooks only test one
attribute while clean; the origin comes from the next poisoned step); `every:N` probes one
model call in N (the other calls' hooks test the same attribute). The hooks are on from the
start in every mode: Dynamo does not guard on hooks, so one added after `torch.compile`
traced the model would never run.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import torch

from guardrails import _process
from guardrails._cuda import outside_captures
from guardrails._removable import Removable
from guardrails._suggest import closest
from guardrails.tracing import ops
from guardrails.tracing.modes import TraceMode, parse_mode
from guardrails.tracing.origin import Origin, find_origin, peak_ratios

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle


__all__ = ["PEAK_SERIES", "Trace", "TraceReport", "match_modules"]

# The gauge's module labels: the first modules to rank among the largest peaks, at most.
PEAK_SERIES: Final = 8
_probe: Final = torch.ops.guardrails.trace_probe_
_step: Final = torch.ops.guardrails.trace_step_
_latch: Final = torch.ops.guardrails.trace_latch_
# Constant-folded to True while torch.compile traces (the way sites switch to their ops).
_compiling: Final = torch.compiler.is_compiling


class ErrorSink(Protocol):
    """Where a probe's failure is counted and logged (the owning service's `HookErrors`)."""

    def record(self, hook: str, part: str, error: BaseException, *, log: bool) -> None: ...


def match_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The names in `model.named_modules()` (the model itself excluded) that match a glob
    of `patterns`, in that order; ValueError for a pattern that matches nothing."""
    if isinstance(patterns, str):
        raise TypeError("modules must be a list of glob patterns, not one string")
    if not patterns:
        raise ValueError("trace needs at least one module pattern, such as 'model.layers.*'")
    names = [name for name, _ in model.named_modules() if name]
    missing = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if missing:
        raise ValueError(
            f"trace: module pattern {missing[0]!r} matches no module of "
            f"{type(model).__name__}"
            + closest(missing[0], names)
            + f" (first names: {', '.join(names[:5]) or 'none'})"
        )
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The floating tensor a module returns: itself, the first floating one of a tuple
    (`(output, bias)`, `(x, residual)`), or the first of a mapping's values (transformers'
    ModelOutput)."""
    if isinstance(value, dict):
        value = tuple(value.values())
    if isinstance(value, tuple | list):
        value = next((item for item in value if _floating(item)), None)
    return value if _floating(value) else None


def _input_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The input a probe judges: the first floating positional argument (never an integer
    `positions`), else the `hidden_states` keyword."""
    for value in args:
        if _floating(value):
            found: torch.Tensor = value
            return found
    hidden = kwargs.get("hidden_states")
    return hidden if _floating(hidden) else None


@dataclass(frozen=True)
class TraceReport:
    """What one report pass found in a trace (`Trace.report`): an episode's `origin` with
    the `site` whose hit asked for it (None, None: none this pass), and the gauge's values,
    (module, largest finite |output| / its dtype's largest finite value), for the modules it
    shows (empty: nothing measured yet)."""

    origin: Origin | None
    site: str | None
    peaks: tuple[tuple[str, float], ...]


class Trace(Removable):
    """The probes on one model (see the module docstring); a removable handle and a
    context manager. Made by `Guardrails.trace()`."""

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[str],
        mode: str | TraceMode = "always",
        *,
        on_remove: Callable[[Trace], None] | None = None,
        errors: ErrorSink | None = None,
    ) -> None:
        self.mode = parse_mode(mode)
        self.names = tuple(match_modules(model, modules))
        self.patterns = tuple(modules)
        self.model_name = type(model).__name__
        # Weakly: the model's hooks hold this trace, so it ends with its model (see
        # `_model_collected`), and a model the engine drops is collected.
        self._model = weakref.ref(model, _when_collected(weakref.ref(self)))
        self._on_remove = on_remove
        self._lock = _process.lock(self, "_lock")
        self._handles: list[RemovableHandle | _StepWrap] = []
        self._dtypes: list[torch.dtype | None] = [None] * len(self.names)
        self._count = 0
        self._removed = False
        self._errors = errors
        self._off: set[int] = set()  # rows whose probe failed (counted and logged once)
        self.probing = not self.mode.armed
        self.key = ops.register(self)
        self.buffer = f"guardrails_trace_{self.key}"
        device = _device_of(model)
        # An ordinary tensor even when traced inside inference mode, so that calls made
        # outside it can still write it (as the sites' buffers).
        with torch.inference_mode(False):
            state = ops.new_state(len(self.names) + 1, device)
            ops.init_switch(ops.as_rows(state), on=not self.mode.armed, every=self.mode.every)
        model.register_buffer(self.buffer, state, persistent=False)
        # Not `always`: a CUDA graph's capture must record the gated bodies (`ops`), which
        # read the switch on the device at each replay.
        self._gated = self.mode.armed or self.mode.every > 1
        self._rows_of: torch.Tensor | None = None  # the buffer `_rows` views
        self._rows: torch.Tensor | None = None
        self._mirror: _Mirror | None = None
        # Episode state, advanced by the reporter's passes (`report`).
        self.wanted: str | None = None  # the site whose hit asks for an origin
        self._resolved = 0  # the latest episode whose origin was looked for
        self.origin: Origin | None = None
        self.armed = False  # an armed trace after its first hit
        self.misses = 0  # report passes without a hit since `wanted` was set
        self._gauged: list[str] = []  # the gauge's modules: the first to rank, at most 8
        # Armed too: a hook added after torch.compile traced the model would not be seen
        # (Dynamo does not guard on hooks), so an armed trace's hooks are there from the start
        # and do nothing but test one attribute until the first hit.
        self._install()

    # -- the hot path (traced by torch.compile) -------------------------------------------

    def _install(self) -> None:
        with self._lock:
            if self._handles:
                return
            model = self._model()
            if model is None:
                return
            modules = dict(model.named_modules())
            for row, name in enumerate(self.names):
                hook = self._probe_hook(row)
                self._handles.append(modules[name].register_forward_hook(hook, with_kwargs=True))
            self._handles.append(_StepWrap(model, self._on_start, self._on_end))

    def _raw(self) -> torch.Tensor:
        """The model's buffer as the ops take it (int64 words; see `ops.new_state`)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the traced model was collected")
        state: torch.Tensor = getattr(model, self.buffer)
        return state

    @property
    def device(self) -> torch.device:
        """The device of the model's buffer (where reading it copies from); the CPU once the
        model is gone (nothing left to copy)."""
        model = self._model()
        state = None if model is None else getattr(model, self.buffer, None)
        return torch.device("cpu") if state is None else state.device

    def _state(self) -> torch.Tensor:
        """The buffer's float64 rows (a view: writes land in the model's buffer), made again
        only when the model's buffer is another tensor (`model.to(device)`)."""
        raw = self._raw()
        rows = self._rows
        if raw is not self._rows_of or rows is None:
            self._rows_of, self._rows = raw, (rows := ops.as_rows(raw))
        return rows

    # Compiled code calls the ops (opaque to the compiler, the switch read when they run);
    # eager code reads the switch here and calls the ops' bodies, skipping the dispatcher.

    def _on_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if _compiling():
            _step(self._raw(), self.key)
            return
        if self._gated and ops.capturing(self._raw()):
            with torch.no_grad():
                ops.gated_step(self._state())
            return
        self.step()
        if self.probing:
            with torch.no_grad():
                ops.write_step(self._state())

    def _on_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _compiling():
            _latch(self._raw(), self.key)
        elif self._gated and ops.capturing(self._raw()):
            with torch.no_grad():
                ops.gated_latch(self._state())
        elif self.probing:
            with torch.no_grad():
                ops.write_latch(self._state())

    def _probe_hook(self, row: int) -> Callable[..., None]:
        key = self.key
        dtypes = self._dtypes
        off = self._off

        def probe(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            if _compiling():
                out = _first_tensor(output)
                if out is not None:
                    _probe(self._raw(), _input_of(args, kwargs), out, row, key)
                return
            gated = self._gated and ops.capturing(self._raw())
            if (self.probing or gated) and row not in off:
                out = _first_tensor(output)
                if out is not None:
                    dtypes[row] = out.dtype
                    write = ops.gated_probe if gated else ops.write_probe
                    try:
                        write(self._state(), _input_of(args, kwargs), out, row)
                    except Exception as exc:  # never the model's call that fails for a probe
                        self.failed(row, exc)

        return probe

    # -- called by the ops (host side) ----------------------------------------------------

    def step(self) -> None:
        every = self.mode.every
        if every > 1 and not self.mode.armed:
            self.probing = self._count % every == 0
        self._count += 1

    def saw(self, row: int, dtype: torch.dtype) -> None:
        self._dtypes[row] = dtype

    def failed(self, row: int, error: Exception) -> None:
        """A probe raised: that module is probed no more; counted in
        `guardrails_hook_errors_total{hook="trace"}` and logged once per module."""
        first = row not in self._off
        self._off.add(row)
        if self._errors is not None:
            self._errors.record("trace", self.names[row], error, log=first)

    def is_off(self, row: int) -> bool:
        return row in self._off

    @property
    def steps(self) -> int:
        """Model calls seen (probed or not) since the probes were installed."""
        return self._count

    # -- called by the reporter -----------------------------------------------------------

    def report(self, hit: str | None, clean: bool) -> TraceReport | None:
        """One report pass: `hit` names the site whose new non-finite values this pass
        brought (None: none), `clean` says a logits site was called with none. Advances the
        episode state and returns what to count and show, or None when there is nothing to
        read (an armed trace before its first hit, no completed copy yet, its model gone)."""
        if hit is not None:
            self.hit(hit)
        elif clean and self.wanted is not None:
            self.misses += 1
        if self.mode.armed and not self.armed:
            return None
        rows = self.read()
        if rows is None:
            return None
        # The peaks first: whatever fails there leaves the origin to the next pass.
        peaks = self._peak_values(rows)
        origin, site = None, None
        if self.wanted is not None:
            origin = self.resolve(rows)
            if origin is not None:
                site, self.wanted = self.wanted, None
                self.origin = origin
            elif self.misses > 1:
                # Two passes without a hit and no latch: the value was born outside the
                # traced modules (or in an unprobed step); nothing to name.
                self.wanted = None
        return TraceReport(origin, site, peaks)

    def _peak_values(self, rows: Sequence[Sequence[float]]) -> tuple[tuple[str, float], ...]:
        ranked = self.peaks(rows)
        if not ranked:
            return ()
        gauged = self._gauged
        for module, _ratio in ranked[:PEAK_SERIES]:
            if module not in gauged and len(gauged) < PEAK_SERIES:
                gauged.append(module)
        values = dict(ranked)
        return tuple((module, values.get(module, 0.0)) for module in gauged)

    def hit(self, site: str) -> None:
        """A site reported non-finite values: want an origin; arm an armed trace."""
        self.misses = 0
        if self.wanted is None:
            self.wanted = site
        if self.mode.armed and not self.armed and self.active:
            self.armed = True
            self.probing = True
            with contextlib.suppress(RuntimeError):  # the model was collected meanwhile
                ops.switch_on(self._state())  # what a CUDA graph's replays read

    def read(self) -> list[list[float]] | None:
        """The state's rows as the host last saw them (never waits; None before a first
        completed copy on CUDA, and once the model is gone)."""
        model = self._model()  # held while reading: the garbage collector may run meanwhile
        if model is None:
            return None
        state = self._state()
        if state.device.type == "cpu":
            # The last row first: the latch writes it last (see `ops.write_latch`).
            meta: list[float] = state[-1].tolist()
            rows: list[list[float]] = state[:-1].tolist()
            return [*rows, meta]
        if self._mirror is None or self._mirror.device != state.device:
            self._mirror = _Mirror(state)
        return self._mirror.latest(state)

    def resolve(self, rows: Sequence[Sequence[float]]) -> Origin | None:
        """The origin of the latest episode in `rows`, once per episode: None for an episode
        already resolved, before any, and for one born outside the traced modules."""
        episode = int(rows[-1][ops.EPISODES])
        if episode == self._resolved:
            return None
        self._resolved = episode  # its first step's rows are final (`ops.write_latch`)
        dtypes = [None if d is None else str(d).removeprefix("torch.") for d in self._dtypes]
        return find_origin(self.names, rows[:-1], dtypes)

    def peaks(self, rows: Sequence[Sequence[float]]) -> list[tuple[str, float]]:
        maxima = [_largest(d) for d in self._dtypes]
        return peak_ratios(self.names, rows[:-1], maxima)

    # -- the handle -----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """False once removed, or once its model was collected."""
        return not self._removed

    @property
    def installed(self) -> bool:
        """Whether the hooks are on (until `remove()`)."""
        return bool(self._handles)

    def remove(self) -> None:
        """Take the hooks and the buffer off the model, and the trace out of its service.
        Idempotent; after the model was collected, only the latter is left to do."""
        with self._lock:
            self._removed = True
            handles, self._handles = self._handles, []
            on_remove, self._on_remove = self._on_remove, None
        for handle in handles:
            handle.remove()
        model = self._model()
        if model is not None:
            model._buffers.pop(self.buffer, None)
        if on_remove is not None:
            on_remove(self)

    def _model_collected(self) -> None:
        """The model is gone, and its hooks and buffer with it: the trace ends. Run by the
        garbage collector, on any thread, maybe inside a lock's holder: it takes no lock and
        calls nothing; the service and the reporter hold traces weakly and skip ended ones."""
        self._removed = True
        self._handles = []
        self._rows_of = self._rows = None
        self._mirror = None

    def __repr__(self) -> str:
        return f"<Trace {self.mode} modules={len(self.names)} installed={self.installed}>"


class _StepWrap:
    """A model call's step boundaries: the model's `forward`, wrapped on the instance, runs
    `start(model, args)` before it and `end(model, args, output)` after it.

    Not forward hooks: an engine may call `model.forward(...)` directly (SGLang's model
    runner does), which runs no hook of the model's own, while `model(...)` calls
    `self.forward` too. The wrapper is a method bound to the model (a deep copy of the model
    gets one bound to the copy, which runs the copy's own `forward`), keeps the wrapped
    signature (`functools.wraps`: transformers' `generate()` reads it), and looks the class's
    `forward` up at each call; this handle holds the model weakly, so a trace its caller keeps
    never keeps its model. `remove()` puts back what was there (an instance `forward` of
    another wrapper's, or none), unless something wrapped it since."""

    def __init__(
        self,
        model: nn.Module,
        start: Callable[[nn.Module, tuple[Any, ...]], None],
        end: Callable[[nn.Module, tuple[Any, ...], Any], None],
    ) -> None:
        self._model = weakref.ref(model)
        before = model.__dict__.get("forward")  # another wrapper's, or None: the class's
        cls = type(model)

        @functools.wraps(cls.forward if before is None else before)
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            start(module, args)
            if before is None:
                output = cls.forward(module, *args, **kwargs)
            else:
                output = before(*args, **kwargs)
            end(module, args, output)
            return output

        self._token = object()
        forward._guardrails_step = (self._token, before)  # type: ignore[attr-defined]
        model.forward = types.MethodType(forward, model)

    def remove(self) -> None:
        model = self._model()
        current = None if model is None else model.__dict__.get("forward")
        mark = getattr(getattr(current, "__func__", None), "_guardrails_step", None)
        if model is None or mark is None or mark[0] is not self._token:
            return
        if mark[1] is None:
            del model.forward
        else:
            model.forward = mark[1]


def _when_collected(trace: weakref.ref[Trace]) -> Callable[[weakref.ref[nn.Module]], None]:
    def collected(_model: weakref.ref[nn.Module]) -> None:
        found = trace()
        if found is not None:
            found._model_collected()

    return collected


@functools.cache
def _largest(dtype: torch.dtype | None) -> float | None:
    """The dtype's largest finite value (None: not seen yet, or not floating)."""
    if dtype is None or not dtype.is_floating_point:
        return None
    return float(torch.finfo(dtype).max)


def _device_of(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


class _Mirror:
    """A pinned host copy of a CUDA state buffer, refreshed without waiting."""

    def __init__(self, state: torch.Tensor) -> None:
        self.device = state.device
        self.host = torch.zeros(state.shape, dtype=state.dtype, pin_memory=True)
        self.event: Any = None
        self.ready: list[list[float]] | None = None

    def latest(self, state: torch.Tensor) -> list[list[float]] | None:
        with outside_captures(), torch.cuda.device(self.device):
            if self.event is not None and self.event.query():
                self.ready = self.host.tolist()
                self.event = None
            if self.event is None and self.host.shape == state.shape:
                self.host.copy_(state, non_blocking=True)
                # (torch.cuda.Event is untyped in torch's stubs.)
                self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self.event.record()
        return self.ready
