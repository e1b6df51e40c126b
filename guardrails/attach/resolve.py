"""Resolving an attach point against the code it names, without changing anything.

`resolve()` walks `package.module:Class.method` with `getattr` and says how calls to the
target arrive (a bound method, a static or class method, a function); `reader()` turns a
tensor reference (`return.x`, `arg:logits`) into a function that picks that value out of one
call. Both raise the point's `AttachError` with a message naming what does not fit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from guardrails.attach.points import AttachPoint
from guardrails.settings.targets import Ref

__all__ = ["Resolved", "namespace", "reader", "resolve", "vocab_of"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Resolved:
    """Where a target lives and how calls to it arrive."""

    owner: Any  # the module, class or object holding the attribute
    name: str
    raw: Any  # the attribute as stored: function, staticmethod, classmethod
    func: Callable[..., Any]  # the function underneath
    receiver: int  # 1 when calls arrive with self/cls first
    own: bool  # defined on `owner` itself (restore it) or inherited (delete ours)


def resolve(point: AttachPoint, module: Any) -> Resolved:
    owner: Any = module
    value: Any = module
    walked = point.target.module
    for part in point.target.path:
        owner = value
        try:
            value = getattr(value, part)
        except AttributeError:
            raise point.error(f"{walked} has no attribute {part!r}") from None
        walked = f"{walked}{':' if walked == point.target.module else '.'}{part}"
    name = point.target.path[-1]
    if not callable(value):
        raise point.error(f"is not callable (it is a {type(value).__name__})")
    own = name in namespace(owner)
    if not isinstance(owner, type):
        return Resolved(owner, name, value, value, 0, own)
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return Resolved(owner, name, raw, raw.__func__, 0, own)
    if isinstance(raw, classmethod):
        return Resolved(owner, name, raw, raw.__func__, 1, own)
    if inspect.isfunction(raw):
        return Resolved(owner, name, raw, raw, 1, own)
    raise point.error(
        f"is a {type(raw).__name__}, not a function written in Python; patch the Python "
        "function that calls it"
    )


def namespace(owner: Any) -> Any:
    try:
        return vars(owner)
    except TypeError:
        return {}


@dataclass(frozen=True)
class _Slot:
    """Where an argument arrives: a position in `args`, a keyword, or both."""

    position: int | None
    keyword: str | None


def _locate(point: AttachPoint, ref: Ref, resolved: Resolved) -> _Slot:
    try:
        signature = inspect.signature(resolved.func)
    except (TypeError, ValueError) as exc:
        raise point.error(f"cannot read its signature for {ref} ({exc})") from None
    params = list(signature.parameters.values())
    visible = [p.name for p in params[resolved.receiver :]]
    if ref.name is not None:
        param = signature.parameters.get(ref.name)
        if param is None or params.index(param) < resolved.receiver:
            raise point.error(
                f"has no argument {ref.name!r} (its arguments: {', '.join(visible) or 'none'})"
            )
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise point.error(f"{ref}: name a regular parameter, not *{param.name}")
        position = params.index(param) if param.kind in _POSITIONAL else None
        keyword = None if param.kind is inspect.Parameter.POSITIONAL_ONLY else param.name
        return _Slot(position, keyword)
    position = resolved.receiver + (ref.index or 0)  # the grammar gives arg:N an index
    positional = [p for p in params if p.kind in _POSITIONAL]
    if position < len(positional):
        param = positional[position]
        keyword = None if param.kind is inspect.Parameter.POSITIONAL_ONLY else param.name
        return _Slot(position, keyword)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return _Slot(position, None)
    raise point.error(
        f"{ref} is out of range: it takes {len(positional) - resolved.receiver} positional "
        f"argument(s) ({', '.join(visible) or 'none'})"
    )


def reader(
    point: AttachPoint, ref: Ref, resolved: Resolved
) -> Callable[[tuple[Any, ...], dict[str, Any], Any], Any]:
    """A function (args, kwargs, result) -> the referenced value, or None when absent."""
    attrs = ref.attrs
    if ref.source == "arg":
        slot = _locate(point, ref, resolved)
        position, keyword = slot.position, slot.keyword

        def read_arg(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
            if position is not None and position < len(args):
                value = args[position]
            elif keyword is not None:
                value = kwargs.get(keyword)  # left to its default: nothing to guard
            else:
                return None
            return _walk(value, attrs)

        return read_arg
    index = ref.index

    def read_return(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
        value = result
        if index is not None and value is not None:
            value = value[index]
        return _walk(value, attrs)

    return read_return


def _walk(value: Any, attrs: tuple[str, ...]) -> Any:
    """`value.a.b...`, or None as soon as a step is None (nothing to guard)."""
    for attr in attrs:
        if value is None:
            return None
        value = getattr(value, attr)
    return value


def vocab_of(value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[-1])
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"expected an int or a [..., vocab] tensor, got {type(value).__name__}")
