"""What the engine hooks share: one wrapped engine method that waits for its module's import,
and the once-only report of a hook's own failure.

A hook (`guardrails.names.KNOWN_HOOKS`) is guardrails' own code around an engine method, for
what an `[[attach]]` point cannot do (ending a request). It must never be what breaks the
engine: a method that does not resolve is counted in `guardrails_attach_errors_total` and
logged, and any exception of the hook's own is logged once and the engine's call goes on as
if unhooked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["MethodHook", "OnceLog"]

_log = logging.getLogger("guardrails")


class MethodHook:
    """`module:Owner.method` wrapped by `half(wrapped, instance, args, kwargs)` once `module`
    is imported (at once if it already is); `.state` is pending, applied, disabled, error or
    removed, `.remove()` unwraps it."""

    def __init__(
        self,
        guards: Guardrails,
        hook: str,
        module: str,
        target: str,
        half: Callable[..., Any],
        enabled: bool = True,
    ) -> None:
        self.hook, self.module, self.target, self._half = hook, module, target, half
        self._guards = guards
        self._wrapper: Any = None
        self._owner: Any = None
        self._method = ""
        self.state = "pending" if enabled else "disabled"
        if enabled:
            wrapt.register_post_import_hook(self._apply, module)

    def _apply(self, module: Any) -> None:
        if self.state != "pending":
            return
        try:
            owner_name, _, method = self.target.partition(".")
            owner = getattr(module, owner_name)
            if not callable(getattr(owner, method, None)):
                raise AttributeError(f"{module.__name__}.{self.target} is not a function")
            wrapt.wrap_function_wrapper(owner, method, self._call)
            self._wrapper = owner.__dict__.get(method)
            self._owner, self._method = owner, method
            self.state = "applied"
        except Exception as exc:
            self.state = "error"
            self._guards.attach_errors.record(
                site=self.hook, target=f"{self.module}:{self.target}", error=exc
            )

    def _call(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        if self.state != "applied":
            return wrapped(*args, **kwargs)
        return self._half(wrapped, instance, args, kwargs)

    def remove(self) -> None:
        """Unwrap (when nothing wrapped it since); a pending hook simply never applies."""
        if self.state == "applied":
            current = self._owner.__dict__.get(self._method)
            if current is self._wrapper:
                setattr(self._owner, self._method, current.__wrapped__)
        self.state = "removed"

    def __repr__(self) -> str:
        return f"<MethodHook {self.hook} {self.module}:{self.target} {self.state}>"


class OnceLog:
    """Log a hook's own failure once per part, then count silently (never raise)."""

    def __init__(self, hook: str, what: str) -> None:
        self.hook = hook
        self.what = what
        self.failures = 0

    def __call__(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures == 1:
            _log.warning(
                "guardrails.hook_error hook=%s part=%s error=%s: %s (the engine goes on "
                "unhooked for this call; logged once)",
                self.hook,
                self.what,
                type(exc).__name__,
                exc,
            )
