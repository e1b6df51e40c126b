"""`Traces`: the traces one `Guardrails` made, and the loader patches that make them.

    trace = traces.trace(model)            # guards.trace(model): probes on matching modules
    traces.configure()                     # guards.trace_configured(): trace what loads

A trace is reported through the owner's reporter from the moment it is made until it is
removed or its model is dropped (traces are held weakly: a server may drop its model); each
has the owner's `hook_errors` for its probes' own failures. `close()` removes the loader
patches and the traces left. Nothing here holds the owner: the loaders trace through this
object's `trace(model)`, holding it weakly. See
`guardrails.tracing` for the probes, and `guardrails.attach.loaders` for the loaders.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from guardrails import _process
from guardrails.attach.errors import Recorders
from guardrails.attach.loaders import TracedLoader, trace_built_models
from guardrails.attach.points import AttachError
from guardrails.reporting._reporter import Reporter
from guardrails.settings import GuardSettings
from guardrails.tracing.tracer import Trace

__all__ = ["Traces"]


class Traces:
    """The traces and trace loaders of one `Guardrails`, from its settings, reporter and
    recorders; `closed()` says whether the owner is closed."""

    def __init__(
        self,
        settings: GuardSettings,
        reporter: Reporter,
        recorders: Recorders,
        closed: Callable[[], bool],
    ) -> None:
        self._settings = settings
        self._closed = closed
        self._reporter = reporter
        self._recorders = recorders
        self._lock = _process.lock(self, "_lock")
        self._traces: weakref.WeakValueDictionary[str, Trace] = weakref.WeakValueDictionary()
        self._loaders: list[TracedLoader] = []

    def trace(
        self,
        model: nn.Module,
        modules: list[str] | tuple[str, ...] | None = None,
        *,
        mode: str | None = None,
    ) -> Trace:
        """Probes on the modules of `model` that match `modules` (default: the `[trace]`
        settings) in `mode` (default: settings), reported until removed. ValueError for a
        pattern that matches no module or a bad mode; RuntimeError once the owner is
        closed."""
        config = self._settings.trace
        patterns = list(config.modules if modules is None else modules)
        if self._closed():
            raise RuntimeError("this Guardrails instance is closed")
        trace = Trace(
            model,
            patterns,
            config.mode if mode is None else mode,
            on_remove=self._forget,
            errors=self._recorders.hook_errors,
        )
        self._reporter.add_trace(trace)
        with self._lock:
            self._traces[trace.key] = trace
        return trace

    def _forget(self, trace: Trace) -> None:
        self._reporter.drop_trace(trace)
        with self._lock:
            self._traces.pop(trace.key, None)

    def active(self) -> list[Trace]:
        """The traces neither removed nor ended with their model."""
        with self._lock:
            return [trace for trace in self._traces.values() if trace.active]

    def configure(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Install the loader patches that trace each model the engine builds through
        `trace(model)` (none when no module is traced); a model the patterns do not fit goes
        to `Recorders.failed`."""

        def failed(error: AttachError) -> None:
            self._recorders.failed("trace", "trace.modules", error, on_error)

        handles = trace_built_models(self._settings, self.trace, self._closed, failed)
        self._loaders.extend(handles)
        return list(handles)

    def loaders(self) -> list[TracedLoader]:
        """The loader patches `configure()` installed, removed ones included."""
        return list(self._loaders)

    def close(self) -> None:
        """Remove the loader patches and every trace left: nothing reports for them."""
        for loader in self._loaders:
            loader.remove()
        with self._lock:
            traces = list(self._traces.values())
        for trace in traces:
            trace.remove()
