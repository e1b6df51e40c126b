"""The kinds of value the settings hold, each with its validation bound to the type.

A field says what it is (`Switch`, `Port`, `TokenId`, `Targets`, ...) and the type checks
it, so the models carry no validators that only forward. Each check raises `ValueError`
with a message naming what was wrong; pydantic reports it at the field, and
`guardrails.settings.problems` adds the origin and the accepted values. List kinds check the
whole list at once, so a problem is reported at the key the user wrote, not at an item.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BeforeValidator, Field

from guardrails.flags import RowFlag
from guardrails.names import KNOWN_HOOKS, validate_site_name
from guardrails.settings.targets import parse_ref, parse_requirement, parse_target
from guardrails.tracing.modes import parse_mode

__all__ = [
    "ALL_DTYPES",
    "BindAddress",
    "CallCount",
    "DtypeName",
    "FlagNames",
    "HookNames",
    "LabelPairs",
    "MultiprocDir",
    "Port",
    "PositiveFinite",
    "Ref",
    "Requirement",
    "SiteName",
    "StepCount",
    "Switch",
    "Target",
    "Targets",
    "TokenId",
    "TraceMode",
    "TracePatterns",
    "Verified",
    "VocabSize",
    "is_loopback",
    "site_table_names",
]

_Tables = TypeVar("_Tables", bound=Mapping[str, object])

DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
ALL_DTYPES: tuple[DtypeName, ...] = ("float32", "bfloat16", "float16", "float64")


# -- switches and numbers ------------------------------------------------------------------


def _no_float_switch(value: object) -> object:
    # pydantic's lax bool also takes the floats 0.0 and 1.0 (from TOML): no documented
    # spelling is a float, and `enabled = 0.0` must not be one more way to switch off.
    if isinstance(value, float):
        raise ValueError("a switch takes true or false, not a float")
    return value


def _no_bool_count(value: object) -> object:
    # pydantic's lax int takes true/false (from TOML) as 1/0: `every_calls = true` is no count.
    if isinstance(value, bool):
        raise ValueError("a number is needed here, not true/false")
    return value


Switch = Annotated[bool, BeforeValidator(_no_float_switch)]
# Counts: true/false refused first, then the bounds, reported in pydantic's words.
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_no_bool_count)]
VocabSize = Annotated[int, Field(gt=0), BeforeValidator(_no_bool_count)]
Port = Annotated[int, Field(ge=0, le=65535), BeforeValidator(_no_bool_count)]
CallCount = Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_no_bool_count)]
StepCount = Annotated[int, Field(ge=1, le=1_000_000_000), BeforeValidator(_no_bool_count)]
PositiveFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]


# -- names and the attach languages --------------------------------------------------------


def _target(text: str) -> str:
    parse_target(text)
    return text


def _ref(text: str) -> str:
    parse_ref(text)
    return text


def _requirement(text: str) -> str:
    parse_requirement(text)
    return text


def _pinned(texts: tuple[str, ...]) -> tuple[str, ...]:
    names: set[str] = set()
    for text in texts:
        requirement = parse_requirement(text)
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise ValueError(f"{text!r} is not one engine version such as 'vllm==0.34.0'")
        if requirement.name in names:
            raise ValueError(f"{requirement.name} is named twice")
        names.add(requirement.name)
    return texts


def _one_or_more(value: object) -> object:
    # `heartbeat = "pkg.mod:Cls.meth"` in the file is one item, not a list of characters.
    return (value,) if isinstance(value, str) else value


def _targets(targets: tuple[str, ...]) -> tuple[str, ...]:
    for text in targets:
        parse_target(text)
    return tuple(dict.fromkeys(targets))


def _known_hooks(names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        if name not in KNOWN_HOOKS:
            known = ", ".join(sorted(KNOWN_HOOKS)) or "none"
            raise ValueError(f"unknown hook {name!r} (known: {known})")
    return tuple(dict.fromkeys(names))


def _known_flags(names: tuple[str, ...]) -> tuple[str, ...]:
    RowFlag.parse(names)  # raises ValueError naming the unknown flag
    return tuple(name.strip().lower() for name in names)


def site_table_names(sites: _Tables) -> _Tables:
    """`sites` unchanged once every key is a valid site name: checked as a whole table (not
    key by key), so that the problem is reported at `sites`."""
    for name in sites:
        validate_site_name(name)  # they become metric labels, like attach sites
    return sites


SiteName = Annotated[str, AfterValidator(validate_site_name)]
Target = Annotated[str, AfterValidator(_target)]
Ref = Annotated[str, AfterValidator(_ref)]
Requirement = Annotated[str, AfterValidator(_requirement)]
Targets = Annotated[tuple[str, ...], BeforeValidator(_one_or_more), AfterValidator(_targets)]
HookNames = Annotated[tuple[str, ...], AfterValidator(_known_hooks)]
Verified = Annotated[tuple[str, ...], BeforeValidator(_one_or_more), AfterValidator(_pinned)]
FlagNames = Annotated[tuple[str, ...], AfterValidator(_known_flags)]


# -- tracing -------------------------------------------------------------------------------


def _patterns(patterns: tuple[str, ...]) -> tuple[str, ...]:
    for pattern in patterns:
        if not pattern.strip() or any(ch.isspace() for ch in pattern):
            raise ValueError(
                f"{pattern!r} is not a module pattern (a dotted name or glob, no spaces)"
            )
    return tuple(dict.fromkeys(patterns))


def _mode(mode: str) -> str:
    return str(parse_mode(mode))


TracePatterns = Annotated[tuple[str, ...], BeforeValidator(_one_or_more), AfterValidator(_patterns)]
TraceMode = Annotated[str, AfterValidator(_mode)]


# -- the metrics server --------------------------------------------------------------------

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Labels of guardrails' own series (guardrails.reporting.metrics), which constant labels
# must not shadow.
# Every label of guardrails' own families (reporting.metrics.FAMILIES; a test keeps them equal):
# a constant label of the same name would make each increment of such a series fail.
_OWN_LABELS = frozenset(
    {"site", "kind", "reason", "rank", "stage", "target", "module", "hook", "part"}
)
# RFC 1123 host name labels; the idna codec refuses longer ones with a UnicodeError at bind.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _bind_address(addr: str) -> str:
    with_zone = addr.partition("%")[0] if ":" in addr else addr
    try:
        ipaddress.ip_address(with_zone)
    except ValueError:
        name = addr.removesuffix(".")
        if not (0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(p) for p in name.split("."))):
            raise ValueError(
                "not an IP address nor a host name (labels of 1-63 letters, digits and '-', "
                "253 characters in all)"
            ) from None
    return addr


def is_loopback(addr: str) -> bool:
    """Whether the bind address `addr` serves this host only."""
    try:
        return ipaddress.ip_address(addr.partition("%")[0]).is_loopback
    except ValueError:
        name = addr.removesuffix(".").lower()
        return name == "localhost" or name.endswith(".localhost")


def _label_pairs(value: object) -> object:
    # GUARDRAILS_METRICS_LABELS arrives as ("model_name=m", "engine=0").
    if isinstance(value, list | tuple):
        pairs: dict[str, object] = {}
        for item in value:
            name, eq, label = str(item).partition("=")
            if not eq:
                raise ValueError(f"{item!r} is not name=value")
            if name.strip() in pairs:
                raise ValueError(f"label {name.strip()!r} is given twice")
            pairs[name.strip()] = label.strip()
        return pairs
    return value


def _label_names(labels: dict[str, str]) -> dict[str, str]:
    for name in labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(
                f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                "not starting with __)"
            )
        if name in _OWN_LABELS:
            raise ValueError(f"{name!r} is a label guardrails sets itself")
    return labels


def _unset_when_empty(value: object) -> object:
    return None if value == "" else value


def _directory(path: Path | None) -> Path | None:
    # Absolute: the processes of a tree may change their working directory.
    if path is not None and not path.is_dir():
        raise ValueError(f"{str(path)!r} is not an existing directory")
    return None if path is None else path.absolute()


BindAddress = Annotated[str, Field(min_length=1), AfterValidator(_bind_address)]
LabelPairs = Annotated[dict[str, str], BeforeValidator(_label_pairs), AfterValidator(_label_names)]
MultiprocDir = Annotated[
    Path | None, BeforeValidator(_unset_when_empty), AfterValidator(_directory)
]
