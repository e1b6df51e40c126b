"""What the engine hooks share: one wrapped engine method that waits for its module's import,
and the report of a hook's own failure.

A hook (`guardrails.names.KNOWN_HOOKS`) is guardrails' own code around an engine method, for
what an `[[attach]]` point cannot do (ending a request). It must never be what breaks the
engine: a method that does not resolve is counted in `guardrails_attach_errors_total` and
logged, and any exception of the hook's own is counted in
`guardrails_hook_errors_total{hook, rank}` (every time; the series exists at 0 once the hook
applies), logged once per part as `guardrails.hook_error` through the host's logging
(`guardrails.logs.HostLogger`), and the engine's call goes on as if unhooked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import wrapt

from guardrails.attach.expects import Expect, verify
from guardrails.attach.points import AttachError
from guardrails.exceptions import Problem
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.request_aborts import RequestAborts

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["HookErrors", "MethodHook", "PartFailures", "request_aborts"]


class MethodHook:
    """`module:Owner.method` wrapped by `half(wrapped, instance, args, kwargs)` once `module`
    is imported (at once if it already is), from `install()` on: hook installers only build
    these, and `Guardrails.install_hooks()` installs them, so that `guardrails check` can
    inspect a hook's halves without wrapping anything.

    `reads` declares what the half reads from the engine beyond the method's name
    (`guardrails.attach.expects`): checked when the module is imported, before anything is
    wrapped. A half whose engine does not have it is not applied (state "mismatch"): reported
    once (`guardrails_attach_errors_total`, event `guardrails.attach_error`), marked off at
    once in `guardrails_site_not_called{site="hook:Owner.method"}`, and the engine's method
    runs as it is, with no error at every step.

    `.state` is pending, applied, disabled, inapplicable (`when` names other versions of the
    engine), mismatch, error or removed; `.calls` counts the calls it handled. `expect_calls`
    marks a half that runs in the heartbeat's process whenever the heartbeat does (a model-runner
    half): the liveness self-check reports it when it sees no call, under `watch_name` (the
    hook's name; `expect_calls="group"` watches it as "hook:group", apart from the hook's
    other halves). Halves of one name are alternatives (one per model runner, only one of
    which runs): they are judged on the sum of their calls. `.remove()` unwraps it.
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
        self.hook, self.module, self.target, self._half = hook, module, target, half
        self.expect_calls = expect_calls
        self.when = when
        self.reads = tuple(reads)
        self.calls = 0
        self._guards = guards
        self._wrapper: Any = None
        self._owner: Any = None
        self._method = ""
        self.state = "pending" if enabled else "disabled"

    @property
    def path(self) -> str:
        return f"{self.module}:{self.target}"

    @property
    def watch_name(self) -> str | None:
        """The name the liveness self-check watches this half under, or None."""
        if isinstance(self.expect_calls, str):
            return f"{self.hook}:{self.expect_calls}"
        return self.hook if self.expect_calls else None

    def install(self) -> None:
        """Wrap the method when its module is imported (now, if it is)."""
        if self.state != "pending":
            return
        if self.when is not None:
            from guardrails.settings.targets import requirement_holds

            if requirement_holds(self.when) is False:
                self.state = "inapplicable"
                return
        wrapt.register_post_import_hook(self._apply, self.module)

    def inspect(self) -> list[str]:
        """Import the module, find the method and verify what the half reads, without
        wrapping anything (`guardrails check`): [] when all holds, else one line per
        problem. ImportError of the method's own module propagates."""
        import importlib

        module = importlib.import_module(self.module)
        try:
            self._resolve(module)
        except AttributeError as exc:
            return [str(exc)]
        return verify(self.reads)

    def _resolve(self, module: Any) -> tuple[Any, str]:
        owner_name, _, method = self.target.partition(".")
        owner = getattr(module, owner_name, None)
        if owner is None:
            raise AttributeError(f"{module.__name__} has no attribute {owner_name!r}")
        if not callable(getattr(owner, method, None)):
            raise AttributeError(f"{module.__name__}.{self.target} is not a function")
        return owner, method

    def _apply(self, module: Any) -> None:
        if self.state != "pending":
            return
        try:
            owner, method = self._resolve(module)
            problems = verify(self.reads)
            if problems:
                self._mismatch(problems)
                return
            wrapt.wrap_function_wrapper(owner, method, self._call)
            self._wrapper = owner.__dict__.get(method)
            self._owner, self._method = owner, method
            self.state = "applied"
            self._guards.hook_errors.prepare(self.hook)
            self._guards.request_aborts.prepare_hook(self.hook)
        except Exception as exc:
            self.state = "error"
            self._guards.attach_errors.record(site=self.hook, target=self.path, error=exc)

    def _mismatch(self, problems: list[str]) -> None:
        self.state = "mismatch"
        error = AttachError([Problem(self.path, f"reads {p}") for p in problems])
        self._guards.attach_errors.record(site=self.hook, target=self.path, error=error)
        self._guards.hook_off(f"{self.hook}:{self.target}", self.path, self.state)

    def _call(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        if self.state != "applied":
            return wrapped(*args, **kwargs)
        self.calls += 1
        return self._half(wrapped, instance, args, kwargs)

    def remove(self) -> None:
        """Unwrap (when nothing wrapped it since); a pending hook simply never applies."""
        if self.state == "applied":
            current = self._owner.__dict__.get(self._method)
            if current is self._wrapper:
                setattr(self._owner, self._method, current.__wrapped__)
        self.state = "removed"

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
