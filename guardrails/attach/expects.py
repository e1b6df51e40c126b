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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from guardrails.settings.targets import installed_distribution

__all__ = ["Expect", "calls", "reads", "verify"]


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
