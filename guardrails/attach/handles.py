"""Attaching sites to someone else's code, removably.

Every attach returns something with `.remove()` that also works as a context manager, like
torch's `RemovableHandle`: a decorated function (`GuardedFunction`, which stops guarding once
removed; `guard_output` / `guard_input`) or a `Handle` for a forward hook or a patched
attribute.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from guardrails._removable import Removable
from guardrails.attach.wrapping import around
from guardrails.reporting.host_time import CLOCK, HostTime

if TYPE_CHECKING:
    from torch import nn

__all__ = ["GuardedFunction", "Handle", "Removable", "SiteCall", "attach_module", "logits_of"]


class SiteCall(Protocol):
    """What an attach point calls: any site (enabled or disabled)."""

    name: str

    def __call__(self, tensor: torch.Tensor, /) -> torch.Tensor | None: ...


def logits_of(value: Any) -> torch.Tensor:
    """The logits tensor in a model output: a tensor, `.logits` (transformers' outputs), a
    mapping with "logits", or the first element of a tuple/list."""
    if isinstance(value, torch.Tensor):
        return value
    found = getattr(value, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(value, dict):
        found = value.get("logits")
        if isinstance(found, torch.Tensor):
            return found
    if isinstance(value, tuple | list) and value:
        first = value[0]
        if isinstance(first, torch.Tensor):
            return first
    raise TypeError(
        f"guardrails: cannot find logits in a {type(value).__name__}; pass select= to say where"
    )


class Handle(Removable):
    """Undoes one attach when `.remove()` is called (idempotent) or its `with` block ends."""

    def __init__(self, undo: Callable[[], None], description: str) -> None:
        self._undo: Callable[[], None] | None = undo
        self.description = description

    @property
    def active(self) -> bool:
        return self._undo is not None

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> Handle:
        return self

    def __repr__(self) -> str:
        return f"<Handle {self.description} {'active' if self.active else 'removed'}>"


class GuardedFunction(Removable):
    """A function whose logits are guarded in place at `site` on every call: those it returns
    (`select` finds them in the result), or, with `arg`, the argument of that name before the
    call (the callee sees them healed). `.remove()` stops guarding.

    Wrapped by `guardrails.attach.wrapping.around`, as every attach is: an `async def` stays
    one (its awaited result is guarded), a generator function guards its argument when it
    starts (guarding what it returns raises `TypeError`), and a method binds like a function.
    Each call's own work around the site call (finding the logits) goes to `host_time`
    (`guardrails_host_seconds_total{part="attach:<site>"}` when it is the owner's)."""

    def __init__(
        self,
        func: Callable[..., Any],
        site: SiteCall,
        *,
        select: Callable[[Any], torch.Tensor] | None = None,
        arg: str | None = None,
        host_time: HostTime | None = None,
    ) -> None:
        functools.update_wrapper(self, func)
        self.__wrapped__ = func
        self.site = site
        self.active = True
        add = (HostTime() if host_time is None else host_time).add  # None: untold
        part = f"attach:{site.name}"

        def guard(value: Any, find: Callable[[Any], Any]) -> None:
            if not self.active:
                return
            start = CLOCK()
            found = find(value)
            add(part, CLOCK() - start)
            if found is not None:
                site(found)

        if arg is None:
            pick = select or logits_of

            def after(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
                guard(result, pick)

            self._call = around(func, after=after)
        else:
            read = _argument_reader(func, arg)

            def before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                guard((args, kwargs), read)

            self._call = around(func, before=before)
        if inspect.iscoroutinefunction(func):
            # Function-like to `inspect` with the wrapped code (its CO_COROUTINE flag), so that
            # a caller asking whether to await it (an event loop, a web framework) is told yes.
            self.__code__ = func.__code__
            self.__defaults__ = getattr(func, "__defaults__", None)
            self.__kwdefaults__ = getattr(func, "__kwdefaults__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # Decorating a method: bind like a function would (a coroutine function stays one).
        if instance is None:
            return self
        return types.MethodType(self._call, instance)

    def remove(self) -> None:
        self.active = False

    def __enter__(self) -> GuardedFunction:
        return self


def _argument_reader(
    func: Callable[..., Any], name: str
) -> Callable[[tuple[tuple[Any, ...], dict[str, Any]]], Any]:
    """(args, kwargs) -> the argument `name` of a call of `func` (None when left to its
    default); `ValueError` naming the arguments when `func` has none of that name."""
    params = list(inspect.signature(func).parameters.values())
    found = next((p for p in params if p.name == name), None)
    if found is None or found.kind in (found.VAR_POSITIONAL, found.VAR_KEYWORD):
        names = ", ".join(p.name for p in params) or "none"
        raise ValueError(f"guardrails: {func.__qualname__} has no argument {name!r} ({names})")
    position = (
        params.index(found)
        if found.kind in (found.POSITIONAL_ONLY, found.POSITIONAL_OR_KEYWORD)
        else None
    )

    def read(call: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = call
        if position is not None and position < len(args):
            return args[position]
        return kwargs.get(name)

    return read


def attach_module(
    module: nn.Module,
    site: SiteCall,
    *,
    select: Callable[[Any], torch.Tensor] | None = None,
) -> Handle:
    """Guard `module`'s output logits in place after every forward."""
    pick = select or logits_of

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        site(pick(output))

    handle = module.register_forward_hook(hook)
    return Handle(handle.remove, f"forward hook {site.name!r} on {type(module).__name__}")
