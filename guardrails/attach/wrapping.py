"""`around()`: the one wrapper guardrails puts on code it does not own.

Attach points, the heartbeat, model loaders and engine hook parts (through
`guardrails.attach.patching.ImportPatch`, which resolves, installs, marks and removes it) and
the `guard_output` decorator (`guardrails.attach.handles.GuardedFunction`) all wrap with it, so
sync, async and generator functions are handled alike everywhere.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["around"]


def around(
    func: Callable[..., Any],
    before: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None,
    after: Callable[[tuple[Any, ...], dict[str, Any], Any], None] | None = None,
    through: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = None,
) -> Callable[..., Any]:
    """`func` wrapped: the one wrapper guardrails puts on code it does not own.

    Exactly one of: `before(args, kwargs)` runs before each call; `after(args, kwargs,
    result)` after it; `through(func, args, kwargs)` makes the call itself (an engine hook's
    part) and returns its result (an awaitable, for an `async def`). What callers test for is
    kept: an `async def` stays a coroutine function (`after` sees the awaited value), a
    generator function stays one (`before` runs when it starts, as its body would). `after`
    or `through` on a generator function raises `TypeError`: what they would see is the
    generator, not its values."""
    if sum(hook is not None for hook in (before, after, through)) != 1:
        raise ValueError("around() needs exactly one of before, after, through")
    wrapper: Callable[..., Any]
    coroutine = inspect.iscoroutinefunction(func)
    generator = inspect.isgeneratorfunction(func)
    if through is not None:
        if generator:
            raise TypeError(f"{func.__qualname__} is a generator function: wrap its caller")
        call_through = through
        if coroutine:

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                return await call_through(func, args, kwargs)

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return call_through(func, args, kwargs)

    elif before is not None:
        call_before = before
        if coroutine:

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                call_before(args, kwargs)
                return await func(*args, **kwargs)

        elif generator:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                call_before(args, kwargs)
                return (yield from func(*args, **kwargs))

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                call_before(args, kwargs)
                return func(*args, **kwargs)

    else:
        assert after is not None
        call_after = after
        if generator:
            raise TypeError(
                f"{func.__qualname__} is a generator function: what it returns is the "
                "generator, not the logits; guard an argument, or the function that consumes it"
            )
        if coroutine:

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                result = await func(*args, **kwargs)
                call_after(args, kwargs, result)
                return result

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                result = func(*args, **kwargs)
                call_after(args, kwargs, result)
                return result

    return functools.wraps(func)(wrapper)
