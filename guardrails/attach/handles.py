"""Attaching sites to someone else's code, removably.

Every attach returns something with `.remove()` that also works as a context manager, like
torch's `RemovableHandle`: a decorated function (`GuardedFunction`, which stops guarding once
removed) or a `Handle` for a forward hook or a patched attribute.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from guardrails._removable import Removable

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
    """A function whose returned logits are guarded in place; `.remove()` stops guarding.

    An `async def` stays one: the call returns a coroutine, whose result is guarded once it is
    awaited, and `inspect.iscoroutinefunction` says so."""

    def __init__(
        self,
        func: Callable[..., Any],
        site: SiteCall,
        *,
        select: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        functools.update_wrapper(self, func)
        self.__wrapped__ = func
        self.site = site
        self._select = select or logits_of
        self.active = True
        self._async = inspect.iscoroutinefunction(func)
        if self._async:
            # Function-like to `inspect` with the wrapped code (its CO_COROUTINE flag), so that
            # a caller asking whether to await it (an event loop, a web framework) is told yes.
            self.__code__ = func.__code__
            self.__defaults__ = getattr(func, "__defaults__", None)
            self.__kwdefaults__ = getattr(func, "__kwdefaults__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._async:
            return self._guarded_await(*args, **kwargs)
        result = self.__wrapped__(*args, **kwargs)
        if self.active:
            self.site(self._select(result))
        return result

    async def _guarded_await(self, *args: Any, **kwargs: Any) -> Any:
        result = await self.__wrapped__(*args, **kwargs)
        if self.active:
            self.site(self._select(result))
        return result

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # Decorating a method: bind like a function would (a coroutine function stays one).
        if instance is None:
            return self
        return functools.partial(self._guarded_await if self._async else self.__call__, instance)

    def remove(self) -> None:
        self.active = False

    def __enter__(self) -> GuardedFunction:
        return self


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
