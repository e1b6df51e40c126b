"""Tracing under `guardrails run`: the engine's model is traced once it is built.

With `[trace] modules = [...]` (or `GUARDRAILS_TRACE`) set, `trace_built_models(guards)`
patches the loaders below, when their module is imported, so that the model each one builds
is traced through `guards.trace(model)` with the settings' patterns and mode, once per model:

    transformers.modeling_utils:PreTrainedModel.from_pretrained   the model it returns
                                                                  (generate, transformers serve)
    vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model     the runner's `.model` after
    vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model     it (vLLM's V2 and V1 runners)
    sglang.srt.model_executor.model_runner:ModelRunner.load_model the runner's `.model` after it

A pattern that matches no module of the loaded model (another architecture) is an attach
error (logged, counted in `guardrails_attach_errors_total{site="trace"}`, fatal only under
`strict_attach`); the model is then returned untraced. A loader whose module is never imported
(another engine) stays pending and costs nothing.

Models and traces are held weakly: an engine that drops its model (`transformers serve`
unloads an idle one and loads it again on the next request) frees it, and the model it loads
next is traced afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from guardrails import _process
from guardrails.attach.patching import ImportPatch, around
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.exceptions import Problem
from guardrails.settings.targets import Ref, parse_target

if TYPE_CHECKING:
    from guardrails.attach.resolve import Resolved
    from guardrails.settings import GuardSettings
    from guardrails.tracing.tracer import Trace

__all__ = ["LOADERS", "TracedLoader", "trace_built_models"]


class Guardrails(Protocol):
    """What the loaders use of a `guardrails.Guardrails` (which calls `trace_built_models`
    itself: named here by what it does, so this module never imports the service)."""

    @property
    def settings(self) -> GuardSettings: ...

    @property
    def closed(self) -> bool: ...

    def trace(self, model: Any) -> Trace: ...


# Loader -> where the model is once it ran: "return" (its result) or "self.model" (the
# attribute its receiver holds it in).
LOADERS: Final[dict[str, str]] = {
    "transformers.modeling_utils:PreTrainedModel.from_pretrained": "return",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model": "self.model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": "self.model",
    "sglang.srt.model_executor.model_runner:ModelRunner.load_model": "self.model",
}


class TracedLoader(ImportPatch):
    """A model loader, wrapped: the model it returns is traced (once)."""

    def __init__(
        self,
        point: AttachPoint,
        guards: Guardrails,
        on_error: Callable[[AttachError], None] | None,
        model_at: str = "return",
    ) -> None:
        super().__init__(point, on_error, None, lambda: guards.closed)
        if model_at not in ("return", "self.model"):
            raise ValueError(f"a loader's model is at 'return' or 'self.model', not {model_at!r}")
        self.model_at = model_at
        self._guards = weakref.ref(guards)
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = _process.lock(self, "_lock")
        self._traces: weakref.WeakValueDictionary[str, Trace] = weakref.WeakValueDictionary()
        self._acting = True

    @property
    def traces(self) -> list[Trace]:
        """The traces of the models this loader built that are still there."""
        with self._lock:
            return [trace for trace in self._traces.values() if trace.active]

    def _wrap(self, resolved: Resolved) -> Callable[..., Any]:
        from_self = self.model_at == "self.model"

        def traced(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
            if from_self:
                self._trace(getattr(args[0], "model", None) if args else None)
            else:
                self._trace(result)

        return around(resolved.func, after=traced)

    def _trace(self, model: Any) -> None:
        guards = self._guards()
        if guards is None or guards.closed or not self._acting or model is None:
            return
        with self._lock:
            if model in self._seen:
                return
            self._seen.add(model)
        try:
            trace = guards.trace(model)
        except Exception as exc:  # never the engine's model load that fails for a trace
            why = str(exc) if isinstance(exc, ValueError | TypeError) else repr(exc)
            error = AttachError([Problem(guards.settings.origin("trace", "modules"), why, None)])
            if self._on_error is None:
                raise error from exc
            self._on_error(error)
            return
        with self._lock:
            self._traces[trace.key] = trace

    def _stop(self) -> None:
        self._acting = False


def trace_built_models(
    guards: Guardrails, on_error: Callable[[AttachError], None] | None = None
) -> list[TracedLoader]:
    """Install the loader patches (pending until their module is imported); none when the
    settings trace no module or guardrails is switched off."""
    if not guards.settings.enabled or not guards.settings.trace.modules:
        return []  # GUARDRAILS_ENABLED=false: no site reports, so nothing would read them
    handles = []
    for text, model_at in LOADERS.items():
        point = AttachPoint(
            site="trace",
            target=parse_target(text),
            tensor=Ref("return"),
            origin=guards.settings.origin("trace", "modules"),
        )
        handle = TracedLoader(point, guards, on_error, model_at)
        handle.install()
        handles.append(handle)
    return handles
