"""What guardrails' code reads from an engine's objects, declared beside the code that reads it
and checked against the installed engine.

    reads("vllm.v1.outputs:ModelRunnerOutput", "req_ids", "sampled_token_ids")
    calls("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
          "scheduler_output", "model_runner_output")

An import path that resolves proves little: an engine release keeps `Scheduler.update_from_
output` and drops the `ModelRunnerOutput.req_id_to_index` a hook reads inside it (vLLM 0.34.0).
`verify()` checks each declaration without calling the engine: a class member is a class
attribute, a dataclass or msgspec field, an annotation, a slot, or an instance attribute
assigned as `self.name` in a class's source (the MRO's); a method's leading parameters after
`self` carry the declared names in that order. Each problem names the engine and its version.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from guardrails.settings.targets import Ref, installed_distribution

__all__ = ["Expect", "calls", "reads", "ref_problems", "verify"]


@dataclass(frozen=True)
class Expect:
    """One declaration: members of the class `owner` ("module:Class") that are read, or the
    leading parameters of the method `owner` ("module:Class.method") that are passed."""

    owner: str
    members: tuple[str, ...] = ()
    params: tuple[str, ...] | None = None  # set: `owner` names a method

    def __str__(self) -> str:
        if self.params is not None:
            return f"{self.owner}({', '.join(self.params)})"
        return f"{self.owner}.{{{', '.join(self.members)}}}"


def reads(owner: str, *members: str) -> Expect:
    """`owner` ("module:Class"): its instances' (or the class's) `members` are read."""
    return Expect(owner, members=members)


def calls(method: str, *params: str) -> Expect:
    """`method` ("module:Class.method") is called or wrapped with `params` first, after self."""
    return Expect(method, params=params)


def verify(expects: Iterable[Expect]) -> list[str]:
    """One line per declaration the installed engine does not satisfy; [] when all hold.
    A module that does not import is a problem too (never an exception)."""
    problems: list[str] = []
    for expect in expects:
        try:
            problems.extend(_verify(expect))
        except Exception as exc:  # an engine module that fails to import, a bad path
            problems.append(f"{expect.owner}: {type(exc).__name__}: {exc}{_version(expect)}")
    return problems


def _verify(expect: Expect) -> list[str]:
    module_name, _, path = expect.owner.partition(":")
    value: Any = importlib.import_module(module_name)
    walked = f"{module_name}:"
    for part in path.split("."):
        if not hasattr(value, part):
            return [f"{walked.rstrip('.:')} has no attribute {part!r}{_version(expect)}"]
        value, walked = getattr(value, part), f"{walked}{part}."
    if expect.params is not None:
        return _verify_params(expect, value)
    if not isinstance(value, type):
        return [f"{expect.owner} is not a class{_version(expect)}"]
    return [
        f"{expect.owner} has no field or attribute {name!r}{_version(expect)}"
        for name in expect.members
        if not _has_member(value, name)
    ]


def _verify_params(expect: Expect, method: Any) -> list[str]:
    want = list(expect.params or ())
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError) as exc:
        return [f"{expect.owner}: no signature to check ({exc}){_version(expect)}"]
    names = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    if names[: len(want)] != want:
        return [
            f"{expect.owner} takes ({', '.join(names)}), expected ({', '.join(want)}) "
            f"first{_version(expect)}"
        ]
    return []


def ref_problems(func: Callable[..., Any], receiver: int, ref: Ref) -> list[str]:
    """What an attach point's reference reads past the call's own value (`return.
    sampled_token_ids`, `arg:logits_output.next_token_logits`), checked against the annotation
    of the value it starts from: [] when it holds, or when nothing can be told (no
    annotation, one that does not resolve, not one class)."""
    if not ref.attrs:
        return []
    try:
        hints = typing.get_type_hints(func)
        if ref.source == "return":
            annotation = hints.get("return")
            if ref.index is not None:
                args = typing.get_args(annotation)
                fixed = typing.get_origin(annotation) is tuple and Ellipsis not in args
                annotation = args[ref.index] if fixed and ref.index < len(args) else None
        else:
            name = ref.name
            if name is None and ref.index is not None:
                params = list(inspect.signature(func).parameters.values())[receiver:]
                name = params[ref.index].name if ref.index < len(params) else None
            annotation = hints.get(name) if name is not None else None
    except Exception:  # a forward reference only a type checker resolves, a bad signature
        return []
    owner = _class_of(annotation)
    if owner is None or _has_member(owner, ref.attrs[0]):
        return []
    where = f"{owner.__module__}:{owner.__qualname__}"
    found = installed_distribution(owner.__module__.partition(".")[0])
    version = "" if found is None else f" ({found[0]} {found[1]})"
    return [f"{ref}: {where} has no field or attribute {ref.attrs[0]!r}{version}"]


def _class_of(annotation: Any) -> type | None:
    """The one class an annotation names (`X`, `X | None`, `Optional[X]`), else None."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and isinstance(members[0], type):
            return members[0]
    return None


def _has_member(cls: type, name: str) -> bool:
    if hasattr(cls, name):  # class attributes, methods, properties, msgspec fields, slots
        return True
    for klass in cls.__mro__:
        if klass is object:
            continue
        if name in getattr(klass, "__dataclass_fields__", ()):
            return True
        if name in vars(klass).get("__annotations__", {}):
            return True
        if name in _assigned_on_self(klass):
            return True
    return False


@functools.cache
def _assigned_on_self(klass: type) -> frozenset[str]:
    """Names the class's own source assigns as `self.name = ...` or `self.name: T = ...`."""
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", source))


def _version(expect: Expect) -> str:
    top = expect.owner.partition(":")[0].partition(".")[0]
    found = installed_distribution(top)
    if found is None:
        return ""
    distribution, version = found
    return f" ({distribution} {version})"
