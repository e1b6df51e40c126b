"""What the engine hooks share: a hook part (one engine method, wrapped the one way guardrails
wraps code, `guardrails.attach.patching.ImportPatch`) and the report of a hook's own failure.

A hook (`guardrails.names.KNOWN_HOOKS`) is guardrails' own code around an engine method, for
what an `[[attach]]` point cannot do (ending a request). It must never be what breaks the
engine: a method that does not resolve is counted in `guardrails_attach_errors_total` and
logged, and any exception of the hook's own is counted in
`guardrails_hook_errors_total{hook, rank}` (every time; the series exists at 0 once the hook
applies), logged once per part as `guardrails.hook_error` through the host's logging
(`guardrails.logs.HostLogger`), and the engine's call goes on as if unhooked. Each call's own
time (without the engine's call inside it; an `async def` part is not timed) goes to
`guardrails_host_seconds_total{part="hook:<hook>"}`.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from guardrails.attach.expects import Expect, verify
from guardrails.attach.patching import ImportPatch, NotApplied
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.resolve import Resolved, resolve
from guardrails.attach.wrapping import around
from guardrails.exceptions import Problem
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.host_time import CLOCK
from guardrails.reporting.request_aborts import RequestAborts
from guardrails.settings.targets import Ref, parse_target

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["HookErrors", "MethodHook", "PartFailures", "request_aborts"]


class MethodHook(ImportPatch):
    """`module:Owner.method` wrapped by `half(wrapped, instance, args, kwargs)` once `module`
    is imported (at once if it already is), from `install()` on: hook installers only build
    these, and `Guardrails.install_hooks()` installs them, so that `guardrails check` can
    inspect a hook's parts without wrapping anything. `wrapped` is the engine's method bound
    to `instance`; `args` and `kwargs` are the call's, without `instance`.

    `reads` declares what the half reads from the engine beyond the method's name
    (`guardrails.attach.expects`): checked when the module is imported, before anything is
    wrapped. A half whose engine does not have it is not applied (state "mismatch"): reported
    once (`guardrails_attach_errors_total`, event `guardrails.attach_error`), marked off at
    once in `guardrails_site_not_called{site="hook:Owner.method"}`, and the engine's method
    runs as it is, with no error at every step.

    `.state` is `ImportPatch`'s (pending, applied, disabled, inapplicable, mismatch, failed,
    removed); `.calls` counts the calls it handled. `expect_calls` marks a half that runs in
    the heartbeat's process whenever the heartbeat does (a model-runner half): the liveness
    self-check reports it when it sees no call, under `watch_name` (the hook's name;
    `expect_calls="group"` watches it as "hook:group", apart from the hook's other halves).
    Halves of one name are alternatives (one per model runner, only one of which runs): they
    are judged on the sum of their calls. `.remove()` unwraps it.
    """

    def __init__(
        self,
        guards: Guardrails,
        hook: str,
        module: str,
        target: str,
        half: Callable[..., Any],
        enabled: bool = True,
        *,
        expect_calls: bool | str = False,
        when: str | None = None,
        reads: Sequence[Expect] = (),
    ) -> None:
        point = AttachPoint(
            site=hook,
            target=parse_target(f"{module}:{target}"),
            tensor=Ref("return"),
            when=when,
            origin=f"hook {hook}",
        )
        super().__init__(point, self._failed, None, lambda: guards.closed)
        self.hook, self.module, self.target, self._half = hook, module, target, half
        self.expect_calls = expect_calls
        self.when = when
        self.reads = tuple(reads)
        self.calls = 0
        self._guards = guards
        self._acting = True
        self._mismatched: list[str] = []  # what `_wrap` found missing, reported after it
        if not enabled:
            self._state = "disabled"

    @property
    def path(self) -> str:
        return f"{self.module}:{self.target}"

    @property
    def watch_name(self) -> str | None:
        """The name the liveness self-check watches this half under, or None."""
        if isinstance(self.expect_calls, str):
            return f"{self.hook}:{self.expect_calls}"
        return self.hook if self.expect_calls else None

    def inspect(self) -> list[str]:
        """Import the module, find the method and verify what the half reads, without
        wrapping anything (`guardrails check`): [] when all holds, else one line per
        problem. ImportError of the method's own module propagates."""
        module = importlib.import_module(self.module)
        try:
            resolve(self.point, module)
        except AttachError as exc:
            return [problem.message for problem in exc.problems]
        return verify(self.reads)

    def _on_import(self, module: Any) -> None:
        super()._on_import(module)
        # Reported here, after `ImportPatch`'s lock is released: recording logs through the
        # host's logging and makes series, host code that may call back into guardrails.
        problems, self._mismatched = self._mismatched, []
        if problems:
            error = AttachError([Problem(self.path, f"reads {p}") for p in problems])
            self._guards.attach_errors.record(site=self.hook, target=self.path, error=error)
            self._guards.hook_off(f"{self.hook}:{self.target}", self.path, "mismatch")
        elif self.state == "applied":
            self._guards.hook_errors.prepare(self.hook)
            self._guards.request_aborts.prepare_hook(self.hook)

    def _wrap(self, resolved: Resolved) -> Callable[..., Any]:
        problems = verify(self.reads)
        if problems:
            self._mismatched = problems
            raise NotApplied("mismatch")
        try:
            return self._wrapper(resolved)
        except TypeError as exc:
            raise self.point.error(str(exc)) from None

    def _wrapper(self, resolved: Resolved) -> Callable[..., Any]:
        half, func = self._half, resolved.func
        add = self._guards.host_time.add
        part = f"hook:{self.hook}"
        bound = resolved.receiver == 1
        # The engine's own call, timed, so that the part's time leaves it out. One cell per
        # part: an engine calls one method from one thread at a time.
        inside = [0.0]

        def engine(*args: Any, **kwargs: Any) -> Any:
            start = CLOCK()
            try:
                return func(*args, **kwargs)
            finally:
                inside[0] += CLOCK() - start

        if inspect.iscoroutinefunction(func):
            # An API server's handler, not an engine step: its awaits are not guardrails'
            # time, so it is not timed.
            def through_async(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
                if not self._acting:
                    return func(*args, **kwargs)
                self.calls += 1
                if bound:
                    return half(types.MethodType(func, args[0]), args[0], args[1:], kwargs)
                return half(func, None, args, kwargs)

            return around(func, through=through_async)

        def through(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
            if not self._acting:
                return func(*args, **kwargs)
            self.calls += 1
            start, before = CLOCK(), inside[0]
            try:
                if bound:
                    instance = args[0]
                    return half(types.MethodType(engine, instance), instance, args[1:], kwargs)
                return half(engine, None, args, kwargs)
            finally:
                add(part, max(0.0, CLOCK() - start - (inside[0] - before)))

        return around(func, through=through)

    def _stop(self) -> None:
        self._acting = False

    def _failed(self, error: AttachError) -> None:
        self._guards.attach_errors.record(site=self.hook, target=self.path, error=error)

    def __repr__(self) -> str:
        return f"<MethodHook {self.hook} {self.path} {self.state}>"


def request_aborts(guards: Guardrails | None) -> RequestAborts:
    """Where a hook half counts and names the requests it ends: its owner's, or (no owner,
    a half built alone) the process's default series and the host's logging."""
    return RequestAborts() if guards is None else guards.request_aborts


class PartFailures:
    """Report a hook's own failure: counted every time, logged once per part, never raised.

    `guards`: the owning `Guardrails` (its registry, constant labels and logger); without it,
    the process's default series and the host's logging."""

    def __init__(self, hook: str, what: str, guards: Guardrails | None = None) -> None:
        self.hook = hook
        self.what = what
        self.failures = 0
        self._errors: HookErrors = HookErrors() if guards is None else guards.hook_errors

    def __call__(self, exc: BaseException) -> None:
        self.failures += 1
        self._errors.record(self.hook, self.what, exc, log=self.failures == 1)

    @property
    def logger(self) -> Any:
        """The owner's logger, for a hook's other events."""
        return self._errors.logger

    @property
    def rank(self) -> str:
        """The `rank` label of the owner's hook series."""
        return self._errors.rank
